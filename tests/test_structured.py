"""Tool calls and structured output in the core: request validation, prompts, parsing, and
constrained decoding through every method (tiny random-weight members: even random weights
must produce output that parses when a call is forced or a schema is requested)."""

from __future__ import annotations

import json

import pytest

from ensemble_core import Ensemble, InvalidOptionError, Member
from ensemble_core.constraints.grammar import JsonConstraint, tool_call_constraint
from ensemble_core.constraints.schemas import closed_schema, schema_sketch
from ensemble_core.constraints.structured import (
    ANSWER_INSTRUCTIONS,
    JSON_INSTRUCTIONS,
    NO_TOOL_TEXT,
    NO_TOOL_VALUE,
    VALUE_ANSWER_INSTRUCTIONS,
    ReplyStream,
    StructuredRequest,
    json_sequence,
    parse_output,
    read_value,
    structured_request,
    with_instructions,
)
from ensemble_core.errors import ConstraintError, InputError, InvalidSchemaError, UnknownToolError
from ensemble_core.testing import tiny_member

TOOLS = [{"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                                     "b": {"type": "integer", "minimum": 0, "maximum": 99}},
                   "required": ["a", "b"]}}},
    {"name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                       "required": ["city"]}}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                           "unit": {"enum": ["C", "F"]}, "ok": {"type": "boolean"}},
          "required": ["city", "unit", "ok"], "additionalProperties": False}
METHODS = ["single", "safe", "every-token", "specem", "generate-then-select"]


@pytest.fixture(scope="module")
def pair() -> list[Member]:
    return [tiny_member("smollm2-135m-instruct", seed=3, name="st-smollm2"), tiny_member("gemma3-270m", seed=3,
                                                                                         name="st-gemma")]


def test_requests_are_validated_with_typed_errors() -> None:
    r = structured_request(TOOLS, "any", None)
    assert r.choice == "required" and [t["name"] for t in r.tools] == ["multiply", "weather"] and r.forced_call
    assert structured_request(TOOLS, {"type": "function", "function": {"name": "weather"}}).choice == "weather"
    assert structured_request(None, None, {"type": "json_object"}).schema == {}
    assert structured_request(None, None, {"type": "json_schema", "json_schema": {"schema": SCHEMA}}).schema == SCHEMA
    assert not structured_request().active
    with pytest.raises(UnknownToolError, match="lookup"):
        structured_request(TOOLS, "lookup")
    with pytest.raises(InvalidOptionError, match="response_format"):
        structured_request(None, None, {"type": "yaml"})
    with pytest.raises(InvalidOptionError, match="response_format"):
        structured_request(None, None, "json")
    with pytest.raises(InvalidOptionError, match="tool_choice"):
        structured_request(None, "required")


def test_tool_choice_forms_and_tool_errors_name_their_field() -> None:
    """OpenAI's ``tool_choice`` forms (a mapping that names no function was read as ``"auto"``: a forced call
    passed as prose), and every tool error names the request field it is about (the server's ``param``)."""
    responses_form = structured_request(TOOLS, {"type": "function", "name": "multiply"})
    assert responses_form.choice == "multiply" and len(responses_form.tools) == 2
    only = {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": [
        {"type": "function", "function": {"name": "weather"}}]}}
    allowed = structured_request(TOOLS, only)
    assert allowed.choice == "required" and [t["name"] for t in allowed.tools] == ["weather"] and allowed.forced_call
    auto = structured_request(TOOLS, {"type": "allowed_tools", "allowed_tools": {"tools": [{"type": "function",
                                                                                          "name": "multiply"}]}})
    assert auto.choice == "auto" and [t["name"] for t in auto.tools] == ["multiply"]
    assert tool_call_constraint(TOOLS, only).schema["properties"]["name"] == {"const": "weather"}  # one tool: no anyOf

    def field_of(tools: object = TOOLS, choice: object = None, response_format: object = None) -> str | None:
        with pytest.raises((InputError, InvalidOptionError)) as err:
            structured_request(tools, choice, response_format)
        return err.value.option if isinstance(err.value, InvalidOptionError) else err.value.param

    for bad_choice in ({"type": "function"}, {}, {"type": "custom", "custom": {"name": "multiply"}},
                       {"type": "allowed_tools", "allowed_tools": {"mode": "sometimes", "tools": only["allowed_tools"]["tools"]}},
                       {"type": "allowed_tools", "allowed_tools": {"mode": "required", "tools": []}}, 7):
        assert field_of(choice=bad_choice) == "tool_choice", bad_choice
    assert field_of(choice={"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "lookup"}}]}}) == "tool_choice"  # UnknownToolError
    assert field_of(choice="lookup") == "tool_choice"
    assert field_of([{"type": "function", "function": {"parameters": {}}}]) == "tools"
    assert field_of([{"name": "f", "parameters": {"type": "string"}}]) == "tools"  # arguments are one object
    assert field_of([{"name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "banana"}}}}]) == "tools"
    assert field_of(None, None, {"type": "json_schema", "json_schema": {"schema": {"type": "banana"}}}) == "response_format"


def test_two_tools_of_one_name_are_refused_when_a_request_starts_whatever_the_choice(pair: list[Member]) -> None:
    """Bound, they pass (LangChain's standard tests bind a pydantic model next to its JSON Schema); a request that
    reads calls, forced or ``auto``, refuses them before decoding (``auto`` took the first spec's schema before)."""
    twice = TOOLS + TOOLS[:1]
    assert structured_request(twice, "required").choice == "required"
    ens = Ensemble(pair, method="single", max_new_tokens=4)
    for choice in ("required", "auto", "multiply"):
        with pytest.raises(ConstraintError, match="unique; repeated: multiply") as err:
            ens.generate("hi", tools=twice, tool_choice=choice)
        assert err.value.param == "tools"
    assert ens.generate("hi", tools=twice, tool_choice="none").finish_reason in ("stop", "length")  # nothing read


def test_a_schema_the_grammar_cannot_compile_is_refused_before_decoding(pair: list[Member]) -> None:
    ens = Ensemble(pair, method="safe", max_new_tokens=8)
    with pytest.raises(InvalidSchemaError):
        ens.generate("hi", response_format={"type": "object", "not": {"required": ["a"]}})


def test_members_without_tool_templates_get_the_instructions() -> None:
    request = structured_request(TOOLS, "required")
    messages = with_instructions([{"role": "user", "content": "6*7?"}], request, native_tools=False)
    assert messages[0]["role"] == "system" and '"name": "multiply"' in messages[0]["content"]
    assert "You must call one of the tools now." in messages[0]["content"]
    assert with_instructions([{"role": "user", "content": "x"}], request, native_tools=True)[0]["role"] == "user"


def test_with_a_schema_the_instructions_ask_for_the_answer_as_its_value() -> None:
    """Tools in ``auto`` and tool results in the history: the answer instructions say plain text, or, where a
    ``response_format`` asks for a value, that value (they contradicted the schema's instruction before:
    measured, 11 -> 8 answer turns on 24 create_agent tasks, docs/agents.md)."""
    history = [{"role": "user", "content": "6*7?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    free = with_instructions(history, structured_request(TOOLS), native_tools=False)
    valued = with_instructions(history, structured_request(TOOLS, None, SCHEMA), native_tools=False)[0]["content"]
    # the answer instructions come after the conversation (the call before it started with the same messages)
    assert free[-1] == {"role": "system", "content": ANSWER_INSTRUCTIONS} and free[1:-1] == history
    assert NO_TOOL_TEXT in free[0]["content"] and ANSWER_INSTRUCTIONS not in free[0]["content"]
    assert "plain text" not in valued
    assert VALUE_ANSWER_INSTRUCTIONS in valued and NO_TOOL_VALUE in valued and '"city"' in valued
    assert valued.index(VALUE_ANSWER_INSTRUCTIONS) < valued.index("of this form")  # "described below"


def test_parse_output_reads_calls_text_and_values() -> None:
    auto = structured_request(TOOLS)
    out = parse_output('{"name": "multiply", "arguments": {"a": 6, "b": 7}}', auto)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("multiply", {"a": 6, "b": 7})] and out.content == ""
    assert out.tool_calls[0].id.startswith("call_")
    tagged = parse_output('Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>', auto)
    assert tagged.tool_calls[0].name == "weather" and tagged.content == "Sure."
    assert parse_output("The answer is 42.", auto).tool_calls == []
    broken = parse_output('{"name": "multiply", "arguments": {"a": 6,', auto)
    assert broken.tool_calls == [] and broken.invalid_tool_calls and "not valid JSON" in broken.invalid_tool_calls[0]["error"]
    assert parse_output('{"city": "Oslo"}', StructuredRequest(schema=SCHEMA)).parsed == {"city": "Oslo"}


def test_several_calls_one_per_line_are_all_read() -> None:
    auto = structured_request(TOOLS)
    text = '{"name": "multiply", "arguments": {"a": 2, "b": 3}}\n{"name": "weather", "arguments": {"city": "Oslo"}}'
    out = parse_output(text, auto)
    assert [c.name for c in out.tool_calls] == ["multiply", "weather"] and out.content == ""
    assert len({c.id for c in out.tool_calls}) == 2
    assert json_sequence('{"a": 1} {"b": 2}\n') == [{"a": 1}, {"b": 2}]
    assert json_sequence('{"a": 1} trailing') is None and json_sequence("  ") is None


def test_json_mode_asks_for_an_object_without_showing_an_empty_schema() -> None:
    request = structured_request(None, None, {"type": "json_object"})
    system = with_instructions([{"role": "user", "content": "x"}], request, native_tools=False)[0]["content"]
    assert system == JSON_INSTRUCTIONS and "Schema" not in system
    schema = with_instructions([{"role": "user", "content": "x"}], StructuredRequest(schema=SCHEMA), False)[0]["content"]
    assert '"city"' in schema


def test_a_schema_is_shown_as_the_value_it_asks_for() -> None:
    """The system prompt shows a response format as its value's form, not as the JSON Schema: shown the
    schema, Qwen2.5-Coder-0.5B wrote it back or took it for a tool (docs/agents.md, "The schema as a form")."""
    system = with_instructions([{"role": "user", "content": "x"}], StructuredRequest(schema=SCHEMA), False)[0]["content"]
    assert system == ('Answer with one JSON object of this form, and nothing else: {"city": "<string, at most 10 '
                      'characters>", "unit": <one of "C", "F">, "ok": <true or false>}')
    assert "properties" not in system and "Schema" not in system
    described = {**SCHEMA, "description": "The weather  in one\n city."}  # a pydantic class's docstring
    shown = with_instructions([{"role": "user", "content": "x"}], StructuredRequest(schema=described), False)
    assert shown[0]["content"] == system + "\nThe weather in one city."
    # a pydantic-style schema: descriptions, optional fields, $defs, lists with bounds, maps, patterns, unions
    person = {"type": "object", "properties": {
        "name": {"type": "string", "description": "the full  name,\n as written"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"anyOf": [{"type": "string", "format": "email"}, {"type": "null"}], "default": None}},
        "required": ["name", "age"]}
    order = {"$defs": {"Person": person, "Item": {
        "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]+$"}, "qty": {"type": "number"}},
        "required": ["sku", "qty"], "additionalProperties": False}},
        "type": "object", "properties": {
            "customer": {"$ref": "#/$defs/Person"},
            "items": {"type": "array", "items": {"$ref": "#/$defs/Item"}, "minItems": 1},
            "tags": {"type": "object", "additionalProperties": {"type": "integer"}},
            "status": {"const": "open"}, "id": {"type": ["integer", "string"]}},
        "required": ["customer", "items", "tags", "status", "id"]}
    assert schema_sketch(order) == (
        '{"customer": {"name": "<the full name, as written>", "age": <integer, 0 to 150>, '
        '"email": "<string, email>" or null (optional)}, "items": [{"sku": "<string, matching ^[A-Z]+$>", '
        '"qty": <number>}, ...] (at least 1 items), "tags": {"<key>": <integer>, ...}, "status": "open", '
        '"id": <integer> or "<string>"}')
    # a recursive model is followed once; anything else still gets a form
    tree = {"$defs": {"T": {"type": "object", "properties": {"v": {"type": "integer"},
                                                          "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
                            "required": ["v"]}}, "$ref": "#/$defs/T"}
    assert schema_sketch(tree) == '{"v": <integer>, "kids": [<T>, ...] (optional)}'
    flags = {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}
    assert schema_sketch(flags) == "[<true or false>, ...] (at most 3 items)"
    assert schema_sketch({}) == "<any JSON value>" and schema_sketch({"$ref": "other.json"}) == "<other.json>"
    assert schema_sketch({"enum": list(range(30))}) == "<one of " + ", ".join(map(str, range(20))) + ", ...>"
    assert schema_sketch({"properties": {"a": 5}, "required": "a"}) == '{"a": <any JSON value, optional>}'  # no crash
    long = "x " * 100
    assert schema_sketch({"type": "string", "description": long}).endswith('...>"')
    listed = with_instructions([{"role": "user", "content": "x"}], StructuredRequest(schema={"type": "array"}), False)
    assert listed[0]["content"].startswith("Answer with one JSON value of this form")


def test_reply_stream_holds_back_what_may_become_a_call() -> None:
    r = ReplyStream(forced=False)
    assert r.push("The answer") == "The answer" and r.push(" is <tool") == " is"
    assert r.push("_call>{") == "" and r.text == "The answer is"
    assert r.rest("The answer is 42") == " 42" and r.rest("unrelated") == ""
    assert ReplyStream(forced=True).push("text") == ""
    held = ReplyStream(forced=False)
    assert held.push(' {"name"') == "" and held.holding
    assert ReplyStream.for_request(structured_request()) is None
    assert ReplyStream.for_request(structured_request(TOOLS, "none")) is None
    assert ReplyStream.for_request(structured_request(TOOLS, "required")).holding
    assert not ReplyStream.for_request(structured_request(TOOLS)).holding


def test_closed_schema_closes_every_object_it_declares() -> None:
    schema = {"type": "object", "properties": {"pet": {"type": "object", "properties": {"n": {"type": "string"}}},
                                               "tags": {"type": "array", "items": {"type": "object"}}},
              "$defs": {"X": {"properties": {"y": {}}}}, "additionalProperties": True}
    closed = closed_schema(schema)
    assert closed["additionalProperties"] is True  # said explicitly: kept
    assert closed["properties"]["pet"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["tags"]["items"]  # no properties: any object, not only {}
    assert closed["$defs"]["X"]["additionalProperties"] is False and "additionalProperties" not in schema["$defs"]["X"]


def test_closed_schema_keeps_allof_satisfiable() -> None:
    from ensemble_core.constraints.tool_parsers import schema_validator

    both = {"type": "object", "allOf": [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "object"}, "c": {"type": "object", "properties": {}}},
         "required": ["b"]}]}
    closed = closed_schema(both)
    assert schema_validator(closed).is_valid({"a": 1, "b": {"free": True}})  # closing left it satisfiable
    assert closed["allOf"][1]["properties"]["c"]["additionalProperties"] is False  # objects inside are closed
    JsonConstraint(closed)  # and the grammar compiles (it was 'Unsatisfiable schema')


@pytest.mark.parametrize("method", METHODS)
def test_forced_calls_and_schemas_always_parse(pair: list[Member], method: str) -> None:
    members = pair[:1] if method == "single" else pair
    # Random weights write up to 20 whitespace characters between JSON tokens (the grammar's
    # limit), so they need a larger budget than a real model would.
    ens = Ensemble(members, method=method, max_new_tokens=200)
    for prompt in ("Multiply 6 by 7.", "Wie ist das Wetter in Zürich?"):
        called = ens.generate(prompt, tools=TOOLS, tool_choice="required")
        assert called.finish_reason in ("eos", "stop"), called.text
        assert len(called.tool_calls) == 1 and called.tool_calls[0].name in ("multiply", "weather"), called.text
        named = ens.generate(prompt, tools=TOOLS, tool_choice="weather")
        assert [c.name for c in named.tool_calls] == ["weather"], named.text
        value = ens.generate(prompt, response_format={"type": "json_schema", "json_schema": {"schema": SCHEMA}})
        assert value.parsed is not None and set(value.parsed) == {"city", "unit", "ok"}, value.text
        assert value.parsed["unit"] in ("C", "F") and json.loads(value.text) == value.parsed


def test_streaming_a_constrained_request_equals_generate(pair: list[Member]) -> None:
    ens = Ensemble(pair, method="safe", max_new_tokens=200)
    result = ens.generate("Weather?", tools=TOOLS, tool_choice="weather")
    stream = ens.stream("Weather?", tools=TOOLS, tool_choice="weather")
    assert "".join(stream) == result.text and stream.result.tool_calls[0].arguments == result.tool_calls[0].arguments


def test_a_number_the_budget_cut_is_not_a_parsed_value() -> None:
    integer = {"type": "integer", "minimum": 0}
    cut = read_value("38", integer, finish_reason="length")
    assert cut.parsed is None and "token budget cut" in cut.parse_error
    assert read_value("38", integer, finish_reason="eos").parsed == 38  # ended by the model: a value
    for text in ('{"a": 38}', "[38]", '"38"', "true", "null"):  # these end themselves: complete even at the budget
        assert read_value(text, {"anyOf": [{}]}, finish_reason="length").parse_error is None
    e = Ensemble([tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)], method="single")
    r = e.generate("Pick a big number.", max_new_tokens=2, response_format=integer)  # its full reply is 16 digits
    assert r.finish_reason == "length" and r.parsed is None and "token budget cut" in r.structured.parse_error


def test_a_bare_schema_whose_type_is_a_list_is_a_response_format() -> None:
    for schema in ({"type": ["object", "null"]}, {"type": ["string", "integer"]}):
        assert structured_request(response_format=schema).schema == schema
    with pytest.raises(InvalidOptionError):
        structured_request(response_format={"type": ["xml"]})
