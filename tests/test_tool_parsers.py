"""Reading tool calls in every format models write, and checking them against the tool's JSON Schema (no model).

Issue #39, items 2 and 3: ``tool_choice="auto"`` replies in Hermes tags, fenced or bare
JSON, after a sentence, Llama 3 and Mistral formats are calls; plain text stays text;
a call whose arguments break its tool's schema is an invalid call with the validator's
message, never a call. The last tests run the scripted member (a tiny model whose logits
are scripted) through ``generate``, ``stream`` and the adapters.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from ensemble_core.constraints.grammar import check_tools, tool_call_constraint
from ensemble_core.constraints.structured import StructuredRequest, parse_output, reply_content, structured_request
from ensemble_core.constraints.tool_parsers import (
    PARSERS,
    AutoParser,
    HermesParser,
    InvalidCall,
    JsonParser,
    Llama3Parser,
    MistralParser,
    ToolCall,
    ToolSet,
    get_parser,
    schema_error,
    schema_validator,
    tool_parameters,
)
from ensemble_core.errors import InvalidOptionError, InvalidSchemaError, UnsupportedSchemaFeatureError

MULTIPLY = {"type": "function", "function": {
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}
WEATHER = {"name": "weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string"}, "unit": {"enum": ["C", "F"]}}, "required": ["city"]}}
NOW = {"name": "now", "description": "The current time."}  # no parameters at all
BOOK = {"name": "book", "parameters": {
    "type": "object", "required": ["guest", "room"],
    "properties": {"guest": {"$ref": "#/$defs/Person"}, "room": {"$ref": "#/$defs/Room"}},
    "$defs": {"Person": {"type": "object", "properties": {"name": {"type": "string"},
                                                          "address": {"type": "object", "properties": {
                                                              "city": {"type": "string"}}, "required": ["city"]}},
                         "required": ["name"]},
              "Room": {"enum": ["single", "double"]}}}}
TOOLS = [MULTIPLY, WEATHER, NOW, BOOK]
AUTO = structured_request(TOOLS)

CALL = '{"name": "multiply", "arguments": {"a": 6, "b": 7}}'
SECOND = '{"name": "weather", "arguments": {"city": "Oslo", "unit": "C"}}'


def read(text: str, request: StructuredRequest = AUTO) -> tuple[str, list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    out = parse_output(text, request)
    return out.content, [(c.name, c.arguments) for c in out.tool_calls], out.invalid_tool_calls


def only_invalid(text: str, request: StructuredRequest = AUTO) -> dict[str, Any]:
    content, calls, invalid = read(text, request)
    assert calls == [] and len(invalid) == 1, (calls, invalid)
    return invalid[0]


# ----------------------------------------------------------------------------- every format
@pytest.mark.parametrize("text, content", [
    (CALL, ""),                                                                    # bare JSON (SmolLM2)
    (f"```json\n{CALL}\n```", ""),                                                 # fenced (Qwen)
    (f"```\n{CALL}\n```", ""),                                                     # bare fence
    (f"Sure! {CALL}", "Sure!"),                                                    # text then a call
    (f"Sure! Here it is:\n```json\n{CALL}\n```\nDone.", "Sure! Here it is:\nDone."),
    (f"<tool_call>\n{CALL}\n</tool_call>", ""),                                    # Hermes / Qwen template
    (f"Let me compute.\n<tool_call>\n{CALL}\n</tool_call>", "Let me compute."),
    (f"```json\n<tool_call>\n{CALL}\n</tool_call>\n```", ""),                      # Qwen fencing its tags
    (f"<tool_call>\n```json\n{CALL}\n```\n</tool_call>", ""),
    ('{"name": "multiply", "parameters": {"a": 6, "b": 7}}', ""),                  # Llama 3.x
    ('<|python_tag|>{"name": "multiply", "parameters": {"a": 6, "b": 7}}', ""),
    (f"[TOOL_CALLS] [{CALL}]", ""),                                                # Mistral
    ('[TOOL_CALLS]multiply[ARGS]{"a": 6, "b": 7}', ""),
    ('{"type": "function", "function": {"name": "multiply", "arguments": "{\\"a\\": 6, \\"b\\": 7}"}}', ""),  # OpenAI's own
])
def test_every_format_is_read_as_the_same_call(text: str, content: str) -> None:
    assert read(text) == (content, [("multiply", {"a": 6, "b": 7})], [])


@pytest.mark.parametrize("text", [
    f"{CALL}\n{SECOND}",                                      # one per line
    f"[{CALL}, {SECOND}]",                                    # a list
    f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n{SECOND}\n</tool_call>",  # Hermes parallel calls
    f"```json\n{CALL}\n```\n```json\n{SECOND}\n```",          # two fences
    '<|python_tag|>{"name": "multiply", "parameters": {"a": 6, "b": 7}}; '
    '{"name": "weather", "parameters": {"city": "Oslo", "unit": "C"}}',
    f"[TOOL_CALLS] [{CALL}, {SECOND}]",
])
def test_several_calls_in_one_reply(text: str) -> None:
    out = parse_output(text, AUTO)
    assert [(c.name, c.arguments) for c in out.tool_calls] == [("multiply", {"a": 6, "b": 7}),
                                                                ("weather", {"city": "Oslo", "unit": "C"})]
    assert out.content == "" and out.invalid_tool_calls == [] and len({c.id for c in out.tool_calls}) == 2


def test_text_around_and_between_calls_is_the_content() -> None:
    assert read(f"First this. {CALL} Then that.")[0] == "First this.\nThen that."
    assert read(f"Sure.\n\nTwo paragraphs. <tool_call>{CALL}</tool_call>")[0] == "Sure.\n\nTwo paragraphs."


@pytest.mark.parametrize("text", [
    "The answer is 42.",
    "Use a dict like {'a': 1} or a set {1, 2}; {x} is a placeholder.",
    'In JSON, {"a": 1} is an object and [1, 2] is an array.',
    '{"name": "Ada Lovelace", "born": 1815}',                 # JSON, but not a call of any tool
    '```python\ndef f(x):\n    return {"name": "multiply", "n": x}\n```',   # code, not JSON
    '```json\n{"result": {"value": 42}}\n```',                 # fenced data, not a call
    "Lists: [1, 2, 3] and [] and {}.",
])
def test_plain_text_stays_text(text: str) -> None:
    out = parse_output(text, AUTO)
    assert out.content == text and out.tool_calls == [] and out.invalid_tool_calls == []
    assert reply_content(text, out) == text


def test_each_parser_reads_only_its_format() -> None:
    tools = ToolSet(structured_request(TOOLS).tools)
    assert HermesParser().parse(CALL, tools) is None and MistralParser().parse(CALL, tools) is None
    assert Llama3Parser().parse(CALL, tools) is None  # "arguments" is not Llama's key: left to JsonParser
    assert JsonParser().parse("plain text", tools) is None and AutoParser().parse("plain text", tools) is None
    assert [c.name for c in JsonParser().parse(CALL, tools).calls] == ["multiply"]
    assert AutoParser.ORDER == ("hermes", "mistral", "llama3", "json") and set(AutoParser.ORDER) < set(PARSERS)
    assert isinstance(get_parser("hermes"), HermesParser) and isinstance(get_parser(), AutoParser)
    with pytest.raises(InvalidOptionError, match="tool_parser.*'hermes'"):
        get_parser("qwen")
    # a parser can be named for one family
    only_json = parse_output(f"<tool_call>{CALL}</tool_call>", AUTO, parser=JsonParser())
    assert only_json.content == "<tool_call>\n</tool_call>" and [c.name for c in only_json.tool_calls] == ["multiply"]


# ----------------------------------------------------------------------------- broken calls
@pytest.mark.parametrize("text, name", [
    ('{"name": "multiply", "arguments": {"a": 6,', "multiply"),                       # cut by the budget
    ('Sure! {"name": "multiply", "arguments": {"a": 6,', "multiply"),
    ('<tool_call>\n{"name": "multiply", "arguments": {"a": 6', "multiply"),          # unclosed last tag
    ('```json\n{"name": "multiply", "arguments": {"a": 6,', "multiply"),             # unclosed fence
    ("<tool_call>{'name': 'multiply', 'arguments': {'a': 6}}</tool_call>", None),   # not JSON
    ('{"name": "multiply", "arguments": {"a": 6, "b": 7,}}', "multiply"),           # trailing comma
    ('[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 6', "multiply"),
    ('<|python_tag|>{"name": "multiply", "parameters": {"a": 6', "multiply"),
])
def test_broken_json_is_an_invalid_call(text: str, name: str | None) -> None:
    bad = only_invalid(text)
    assert bad["name"] == name and bad["id"].startswith("call_") and "JSON" in bad["error"] and bad["args"]


def test_a_budget_cut_call_says_so_and_keeps_earlier_calls() -> None:
    text = f"<tool_call>\n{CALL}\n</tool_call>\n<tool_call>\n" + '{"name": "weather", "arguments": {"ci'
    content, calls, invalid = read(text)
    assert calls == [("multiply", {"a": 6, "b": 7})] and content == ""
    assert invalid[0]["name"] == "weather" and "token budget" in invalid[0]["error"]
    # an unclosed last tag whose call is complete (EOS before the closing tag) is a call
    assert read(f"<tool_call>\n{CALL}")[1] == [("multiply", {"a": 6, "b": 7})]


def test_a_tag_that_holds_no_call_is_invalid() -> None:
    assert "empty" in only_invalid("<tool_call></tool_call>")["error"]
    assert "not a call object" in only_invalid('<tool_call>{"result": 1}</tool_call>')["error"]


def test_unknown_tool_names_the_tools_that_exist() -> None:
    bad = only_invalid('{"name": "divide", "arguments": {"a": 1, "b": 2}}')
    assert bad["name"] == "divide" and "unknown tool 'divide'" in bad["error"]
    assert "multiply, weather, now, book" in bad["error"]
    assert "multiply, weather" in only_invalid(f"<tool_call>{json.dumps({'name': 'divide', 'arguments': {}})}</tool_call>")[
        "error"]


def test_arguments_as_a_json_string_are_decoded() -> None:
    assert read('{"name": "multiply", "arguments": "{\\"a\\": 2, \\"b\\": 3}"}')[1] == [("multiply", {"a": 2, "b": 3})]
    assert read('{"name": "now", "arguments": ""}')[1] == [("now", {})]
    bad = only_invalid('{"name": "multiply", "arguments": "{\\"a\\": 2,"}')
    assert bad["args"] == '{"a": 2,' and "not valid JSON" in bad["error"]
    assert "must be a JSON object" in only_invalid('{"name": "multiply", "arguments": [6, 7]}')["error"]


def test_arguments_beside_the_name_are_invalid_and_show_the_shape() -> None:
    bad = only_invalid('{"name": "multiply", "a": 6, "b": 7}')
    assert bad["name"] == "multiply" and '"arguments"' in bad["error"] and "'a', 'b'" in bad["error"]


# ----------------------------------------------------------------------------- schemas
@pytest.mark.parametrize("arguments, message", [
    ({"a": "six", "b": 7}, "'six' is not of type 'integer' (at $.a)"),               # wrong type
    ({"a": 6}, "'b' is a required property"),                                        # missing required
    ({"a": 6, "b": 7, "c": 8}, "Additional properties are not allowed ('c' was unexpected)"),  # closed schema
    ({"x": "hot"}, "'a' is a required property"),                                    # the issue's example
])
def test_arguments_that_break_the_schema_are_invalid_with_the_validators_message(arguments: dict[str, Any],
                                                                                  message: str) -> None:
    text = json.dumps({"name": "multiply", "arguments": arguments})
    for reply in (text, f"<tool_call>{text}</tool_call>", f"```json\n{text}\n```", f"Sure! {text}"):
        bad = only_invalid(reply)
        assert bad["name"] == "multiply" and message in bad["error"], bad
        assert "do not match the parameters of 'multiply'" in bad["error"] and json.loads(bad["args"]) == arguments


def test_the_issue_example_lists_every_broken_key() -> None:
    error = only_invalid('{"name": "multiply", "arguments": {"x": "hot"}}')["error"]
    assert "'a' is a required property" in error and "'b' is a required property" in error and "'x' was unexpected" in error


@pytest.mark.parametrize("tool", [NOW, {"name": "now", "parameters": {}},
                                  {"name": "now", "parameters": {"type": "object", "properties": {}}}])
def test_a_tool_without_parameters_accepts_only_an_empty_object(tool: dict[str, Any]) -> None:
    request = structured_request([tool])
    for text in ('{"name": "now", "arguments": {}}', '{"name": "now"}', '{"name": "now", "arguments": null}',
                 '<tool_call>{"name": "now", "arguments": {}}</tool_call>'):
        assert read(text, request)[1] == [("now", {})], text
    for arguments in ({"properties": {}}, {"tz": "UTC"}):
        bad = only_invalid(json.dumps({"name": "now", "arguments": arguments}), request)
        assert "Additional properties are not allowed" in bad["error"]


def test_validation_checks_what_the_grammar_enforces() -> None:
    """Forced calls decode under ``tool_parameters``; free calls are validated against the same schema."""
    for tool in (MULTIPLY, NOW):
        spec = structured_request([tool]).tools[0]
        forced = tool_call_constraint([tool], "required").schema["properties"]["arguments"]
        assert forced == tool_parameters(spec) and forced.get("additionalProperties") is False
    # $defs of a tool's parameters still resolve once they sit inside the call's schema (one tool, or anyOf of several)
    good = {"guest": {"name": "Ada"}, "room": "single"}
    for tools in ([BOOK], [MULTIPLY, BOOK]):
        call_schema = tool_call_constraint(tools, "required").schema
        assert schema_error({"name": "book", "arguments": good}, schema_validator(call_schema)) is None
        assert "'suite' is not one of" in schema_error({"name": "book", "arguments": {**good, "room": "suite"}},
                                                       schema_validator(call_schema))
    loose = {"name": "loose", "parameters": {"type": "object", "properties": {}, "additionalProperties": True}}
    assert read('{"name": "loose", "arguments": {"any": 1}}', structured_request([loose]))[1] == [("loose", {"any": 1})]


def test_nested_objects_enums_and_refs_are_checked() -> None:
    good = {"guest": {"name": "Ada", "address": {"city": "Oslo"}}, "room": "double"}
    assert read(json.dumps({"name": "book", "arguments": good}))[1] == [("book", good)]
    cases = [({"guest": {"name": "Ada", "address": {}}, "room": "double"}, "'city' is a required property (at $.guest.address)"),
             ({"guest": {"name": "Ada"}, "room": "suite"}, "'suite' is not one of ['single', 'double'] (at $.room)"),
             ({"guest": {"name": 7}, "room": "single"}, "7 is not of type 'string' (at $.guest.name)")]
    for arguments, message in cases:
        assert message in only_invalid(json.dumps({"name": "book", "arguments": arguments}))["error"]
    assert "'F'" in only_invalid('{"name": "weather", "arguments": {"city": "Oslo", "unit": "K"}}')["error"]


def test_forced_calls_are_validated_too() -> None:
    forced = structured_request(TOOLS, "multiply")
    assert read(CALL, forced)[1] == [("multiply", {"a": 6, "b": 7})]
    assert "'b' is a required property" in only_invalid('{"name": "multiply", "arguments": {"a": 6}}', forced)["error"]


def test_tool_choice_none_reads_no_calls() -> None:
    none = structured_request(TOOLS, "none")
    out = parse_output(CALL, none)
    assert out.content == CALL and out.tool_calls == [] and out.invalid_tool_calls == []


def test_a_response_format_value_is_checked_against_its_schema() -> None:
    schema = {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}}, "required": ["unit"]}
    request = structured_request(None, None, {"type": "json_schema", "json_schema": {"schema": schema}})
    ok = parse_output('{"unit": "C"}', request)
    assert ok.parsed == {"unit": "C"} and ok.parse_error is None
    wrong = parse_output('{"unit": "K"}', request)
    assert wrong.parsed == {"unit": "K"} and "'K' is not one of ['C', 'F'] (at $.unit)" in wrong.parse_error
    cut = parse_output('{"unit": ', request)
    assert cut.parsed is None and "not valid JSON" in cut.parse_error and cut.content == '{"unit": '
    any_object = structured_request(None, None, {"type": "json_object"})
    assert parse_output("[1]", any_object).parse_error and parse_output('{"a": 1}', any_object).parse_error is None


# ----------------------------------------------------------------------------- schemas checked when tools are bound
@pytest.mark.parametrize("parameters, error, problem", [
    ({"type": "objekt"}, InvalidSchemaError, r"tool 'bad' parameters: 'objekt' is not valid .*\(at \$\.type\)"),
    ({"type": "object", "properties": {"n": {"type": "integer", "minimum": "0"}}}, InvalidSchemaError,
     r"'0' is not of type 'number' \(at \$\.properties\.n\.minimum\)"),
    ({"type": "object", "properties": {"n": {"$ref": "#/$defs/Missing"}}}, InvalidSchemaError, "points to nothing"),
    ({"type": "object", "properties": {"n": {"$ref": "https://example.com/n.json"}}}, UnsupportedSchemaFeatureError,
     "another document"),
])
def test_a_schema_the_validator_rejects_raises_when_the_tools_are_checked(parameters: dict[str, Any],
                                                                          error: type[Exception], problem: str) -> None:
    tool = {"name": "bad", "parameters": parameters}
    for check in (lambda: structured_request([tool]), lambda: check_tools([tool])):
        with pytest.raises(error, match=problem) as info:
            check()
        assert info.value.fix and info.value.fix in str(info.value)
    if error is UnsupportedSchemaFeatureError:
        assert info.value.feature == "$ref to another document"


def test_unsupported_grammar_keywords_name_the_feature() -> None:
    for keyword, schema in [("not", {"not": {"type": "string"}}), ("if, then", {"if": {}, "then": {}}),
                            ("uniqueItems", {"type": "array", "uniqueItems": True})]:
        tool = {"name": "bad", "parameters": {"type": "object", "properties": {"x": schema}}}
        with pytest.raises(UnsupportedSchemaFeatureError, match="tool 'bad' parameters") as info:
            check_tools([tool])
        assert info.value.feature == keyword and isinstance(info.value, InvalidSchemaError)


def test_a_response_format_schema_is_checked_up_front() -> None:
    with pytest.raises(InvalidSchemaError, match="response_format: 'objekt'"):
        structured_request(None, None, {"type": "json_schema", "json_schema": {"schema": {"type": "objekt"}}})


def test_toolset_reads_names_and_arguments() -> None:
    tools = ToolSet(structured_request(TOOLS).tools)
    assert tools.names == ["multiply", "weather", "now", "book"]
    assert isinstance(tools.read("multiply", {"a": 1, "b": 2}), ToolCall)
    assert isinstance(tools.read(None, {}), InvalidCall) and "names no tool" in tools.read("", {}).error


# ----------------------------------------------------------------------------- every path, with a scripted member
SCRIPT = [f"```json\n{CALL}\n```",
          f"Sure! {CALL}",
          '{"name": "multiply", "arguments": {"x": "hot"}}',
          "No tool needed: 42."]


@pytest.fixture(scope="module")
def scripted_ensemble() -> Any:
    from test_llamaindex_agent import ScriptedLM

    from ensemble_core import Ensemble, Member
    from ensemble_core.testing import tiny_member

    count = {"n": 0}

    def reply(prompt: str) -> str:
        text = SCRIPT[count["n"] % len(SCRIPT)]
        count["n"] += 1
        return text

    base = tiny_member("smollm2-135m-instruct", seed=1)
    member = Member(ScriptedLM(base.model, base.tokenizer, reply), base.tokenizer, name="scripted-parsers",
                    prefix_cache=0)  # ScriptedLM tells requests apart by an empty cache
    # free decoding: what the parser and the schema check do with calls as written (under the default lazy
    # grammar a started call always matches its schema: tests/test_lazy_grammar.py)
    return Ensemble([member], method="single", max_new_tokens=64, lazy_tool_grammar=False)


def test_generate_and_stream_read_calls_the_same_way(scripted_ensemble: Any) -> None:
    ens = scripted_ensemble
    for streamed in (False, True):
        results = []
        for _ in SCRIPT:
            if streamed:
                stream = ens.stream("6 times 7?", tools=TOOLS)
                "".join(stream)
                results.append(stream.result)
            else:
                results.append(ens.generate("6 times 7?", tools=TOOLS))
        fenced, after, hot, text = results
        assert [(c.name, c.arguments) for c in fenced.tool_calls] == [("multiply", {"a": 6, "b": 7})]
        assert after.tool_calls and after.structured.content == "Sure!"
        assert hot.tool_calls == [] and "'a' is a required property" in hot.structured.invalid_tool_calls[0]["error"]
        assert text.tool_calls == [] and text.structured.invalid_tool_calls == [] and text.text == SCRIPT[3]


def test_langchain_reports_schema_breaking_calls_as_invalid(scripted_ensemble: Any) -> None:
    pytest.importorskip("langchain_core")
    from langchain_ensemble.messages import lc_tool_calls

    calls, invalid = lc_tool_calls(parse_output(SCRIPT[2], AUTO))
    assert calls == [] and invalid[0]["name"] == "multiply" and "required" in invalid[0]["error"]
    assert invalid[0]["type"] == "invalid_tool_call"
    calls, invalid = lc_tool_calls(parse_output(SCRIPT[0], AUTO))
    assert calls[0]["args"] == {"a": 6, "b": 7} and invalid == []


def test_llamaindex_reports_schema_breaking_calls_as_invalid(scripted_ensemble: Any) -> None:
    pytest.importorskip("llama_index.core")
    from llama_index.llms.ensemble.messages import INVALID_CALL, assistant_message, extra_kwargs

    for _ in SCRIPT:  # the script cycles: one of the next replies is the schema-breaking call
        result = scripted_ensemble.generate("x", tools=TOOLS)
        if result.text == SCRIPT[2]:
            break
    message = assistant_message(reply_content(result.text, result.structured), result.structured)
    # never a runnable call, never the final answer: a block of the reserved tool that no agent has
    blocks = [b for b in message.blocks if type(b).__name__ == "ToolCallBlock"]
    assert [b.tool_name for b in blocks] == [INVALID_CALL] and not message.content
    assert blocks[0].tool_kwargs["name"] == "multiply" and json.loads(blocks[0].tool_kwargs["arguments"]) == {"x": "hot"}
    assert "required" in blocks[0].tool_kwargs["error"]
    extra = extra_kwargs(result)
    assert extra["finish_reason"] == "stop" and "required" in extra["invalid_tool_calls"][0]["error"]


def test_the_new_error_pickles_and_names_its_feature() -> None:
    import pickle

    error = UnsupportedSchemaFeatureError("not", "tool 'x' parameters: Unimplemented keys: [\"not\"]", "Drop it.")
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is UnsupportedSchemaFeatureError and back.feature == "not" and str(back) == str(error)
    assert isinstance(back, InvalidSchemaError) and back.problem == error.problem


def test_tools_without_jsonschema_raise_a_typed_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Calls are never passed on unchecked: without the validator a request with tools says what to install."""
    import sys

    from ensemble_core.constraints import tool_parsers
    from ensemble_core.errors import MissingDependencyError

    monkeypatch.setitem(sys.modules, "jsonschema", None)
    tool_parsers._compiled.cache_clear()
    try:
        with pytest.raises(MissingDependencyError, match="jsonschema"):
            structured_request([{"name": "fresh", "parameters": {"type": "object", "properties": {}}}])
        assert not structured_request().active  # no tools, no schema: nothing to check
    finally:
        tool_parsers._compiled.cache_clear()


def test_patterns_are_read_as_ecma_262_as_the_grammar_reads_them() -> None:
    from ensemble_core.constraints.grammar import JsonConstraint
    from ensemble_core.constraints.tool_parsers import schema_validator

    for pattern, good, bad in [(r"^\p{L}+$", "héllo", "h1"), (r"^(?<year>\d{4})-\d{2}$", "2024-06", "24-06"),
                               (r"^\u{1F600}$", "\U0001F600", "x")]:
        schema = {"type": "string", "pattern": pattern}
        validator = schema_validator(schema, "response_format")  # Python's re refused all three
        assert validator.is_valid(good) and not validator.is_valid(bad)
        JsonConstraint(schema)  # the grammar enforces the same pattern
    with pytest.raises(InvalidSchemaError, match="regex"):
        schema_validator({"type": "string", "pattern": "(unclosed"})
