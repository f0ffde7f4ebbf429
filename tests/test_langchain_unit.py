"""Fast tests of the LangChain adapter on tiny random-weight members (real tokenizers).

They check the adapter's own logic: option mapping, the shared ensemble cache, message
conversion, token counting with the primary member's tokenizer, chunk / callback
accounting, timeouts and typed errors. Generation quality is the real-model tests' job.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any, Literal

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import JsonOutputKeyToolsParser, PydanticToolsParser
from langchain_core.runnables import ConfigurableField
from langchain_core.tools import tool
from langchain_ensemble import (
    ChatEnsemble,
    EnsembleLLM,
    GenerationTimeout,
    UnsupportedContentError,
)
from langchain_ensemble.base import split_model
from langchain_ensemble.messages import to_core_messages
from pydantic import BaseModel, Field
from typing_extensions import TypedDict

from ensemble_core import ConfigurationError, Ensemble, InputError, InvalidOptionError, normalize_messages
from ensemble_core.constraints.schemas import closed_schema
from ensemble_core.serving.runtime import Run as CoreRun

ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


class Pet(BaseModel):
    """A pet."""

    name: str
    kind: Literal["cat", "dog"]
    owner: Owner | None = None


class Owner(BaseModel):
    name: str


class PetDict(TypedDict):
    """A pet."""

    name: str
    age: int


Pet.model_rebuild()


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: Any, **kwargs: Any) -> None:
        self.tokens.append(token)


@pytest.fixture
def pair(tiny_gemma, tiny_llama) -> list:
    """Gemma first: the tiny Gemma writes visible text, so responses are not empty."""
    return [tiny_gemma, tiny_llama]


@pytest.fixture
def chat(pair) -> ChatEnsemble:
    return ChatEnsemble(members=pair, method="single", max_tokens=6)


# ---------------------------------------------------------------- construction and cache
def test_instances_share_one_ensemble_and_rebuild_nothing(pair, monkeypatch) -> None:
    first = ChatEnsemble(members=pair, method="single", max_tokens=6, method_config={"do_sample": False})
    built: list[Ensemble] = []
    original = Ensemble.__init__
    monkeypatch.setattr(Ensemble, "__init__", lambda self, *a, **k: built.append(self) or original(self, *a, **k))
    for _ in range(20):  # a config field given as a keyword is the same config; standard params are per call
        other = ChatEnsemble(members=pair, method="single", max_tokens=3, temperature=0.5, stop=["x"], top_p=0.9,
                             do_sample=False)
    assert other._core_ensemble() is first._core_ensemble()
    assert built == [], "building an instance rebuilt the ensemble"
    monkeypatch.setattr(Ensemble, "__init__", original)
    different = ChatEnsemble(members=pair, method="single", method_config={"do_sample": True})
    assert different._core_ensemble() is not first._core_ensemble()
    llm = EnsembleLLM(members=pair, method="single", do_sample=False)
    assert llm._core_ensemble() is first._core_ensemble()


def test_prebuilt_ensemble_and_model_name(pair) -> None:
    ensemble = Ensemble(pair, method="single")
    chat = ChatEnsemble(ensemble=ensemble)
    assert chat._core_ensemble() is ensemble and chat.method == "single"
    assert chat.model_name == "tiny-gemma3-270m-0+tiny-smollm2-135m-instruct-0"
    with pytest.raises(ConfigurationError, match="either ensemble="):
        ChatEnsemble(ensemble=ensemble, members=pair)
    with pytest.raises(ConfigurationError, match="either ensemble="):
        ChatEnsemble(ensemble=ensemble, method="safe")


def test_model_string_names_the_members() -> None:
    assert split_model("smollm2-135m-instruct+gemma3-270m") == ["smollm2-135m-instruct", "gemma3-270m"]
    with pytest.raises(InvalidOptionError, match="joined by"):
        split_model("a++b")
    with pytest.raises(ConfigurationError, match="names other members"):
        ChatEnsemble(model="a+b", members=["c", "d"], method="single")


def test_extra_keywords_are_method_config_fields(pair) -> None:
    chat = ChatEnsemble(members=pair, method="single", top_p=0.8, do_sample=False)
    assert chat.method_config == {"do_sample": False} and chat.top_p == 0.8
    assert chat._core_ensemble().config.do_sample is False
    with pytest.raises(ConfigurationError, match="Unknown option.*lookahed"):
        ChatEnsemble(members=pair, method="single", lookahed=3)
    with pytest.raises(ConfigurationError, match="given twice"):
        ChatEnsemble(members=pair, method="single", do_sample=True, method_config={"do_sample": False})
    with pytest.raises(ConfigurationError, match="method"):
        ChatEnsemble(members=pair, method="no-such-method")


@pytest.mark.parametrize(("option", "value", "match"), [
    ("temperature", -0.1, "temperature"), ("timeout", 0, "timeout"), ("max_retries", -1, "max_retries"),
    ("max_tokens", 0, "max_tokens"), ("top_p", 1.5, "top_p"), ("stop", [""], "stop"),
])
def test_bad_standard_params_raise_typed_errors(pair, option: str, value: Any, match: str) -> None:
    with pytest.raises(InvalidOptionError, match=match):
        ChatEnsemble(members=pair, method="single", **{option: value})


def test_standard_params_map_onto_core_overrides(pair) -> None:
    chat = ChatEnsemble(members=pair, method="single", temperature=0, max_tokens=7, stop=["a"], seed=3,
                        timeout=5, max_retries=2, api_key="unused")
    assert chat._generation_overrides({}, None) == {"do_sample": False, "max_new_tokens": 7, "seed": 3, "stop": ("a",)}
    # call values win; a call-level stop replaces the instance's (as in ChatOpenAI)
    assert chat._generation_overrides({"temperature": 0.7, "max_tokens": 2}, ["b", "b"]) == {
        "do_sample": True, "temperature": 0.7, "max_new_tokens": 2, "seed": 3, "stop": ("b",)}
    assert ChatEnsemble(members=pair, method="single")._generation_overrides({}, None) == {}  # None → method defaults
    run, ensemble, name = chat._prepare("hi", None, {"top_p": 0.5, "stream": True})
    assert run.overrides["top_p"] == 0.5 and run.timeout == 5 and name == chat.model_name
    with pytest.raises(ConfigurationError, match="Unknown option.*tool_list"):
        chat._prepare("hi", None, {"tool_list": []})
    run, _, _ = chat._prepare("hi", None, {"tools": [ADD], "tool_choice": "add"})  # tools are core options
    assert run.overrides["tools"] == [ADD] and run.overrides["tool_choice"] == "add"


def test_sampling_with_a_seed_is_reproducible(pair) -> None:
    sampled = ChatEnsemble(members=pair, method="single", max_tokens=8, temperature=1.5, seed=7)
    first = sampled.invoke("Hello")
    assert sampled.invoke("Hello").content == first.content
    assert sampled._core_ensemble().config.do_sample is False  # sampling is per call, the shared config is untouched
    greedy = ChatEnsemble(members=pair, method="single", max_tokens=8).invoke("Hello")
    others = {sampled.invoke("Hello", seed=s).content for s in (1, 2, 3)}
    assert others - {greedy.content}, "temperature > 0 must sample, not decode greedily"


def test_ls_params_and_profile(chat) -> None:
    params = chat._get_ls_params(stop=["z"], temperature=0.3)
    assert params == {"ls_provider": "ensemble", "ls_model_name": chat.model_name, "ls_model_type": "chat",
                      "ls_temperature": 0.3, "ls_max_tokens": 6, "ls_stop": ["z"]}
    assert chat._get_ls_params(model="x+y")["ls_model_name"] == "x+y"
    llm = EnsembleLLM(members=chat.members, method="single")
    assert llm._get_ls_params()["ls_model_type"] == "llm"
    assert chat.profile["max_input_tokens"] == chat._core_ensemble().context_window == 4096
    assert chat.profile["tool_calling"] is True and chat.profile["tool_choice"] is True
    assert chat.profile["structured_output"] is True


# ---------------------------------------------------------------- messages
def test_message_conversion_and_merging() -> None:
    messages = [
        SystemMessage("s1"), SystemMessage("s2"), HumanMessage("h1", name="ann"),
        HumanMessage([{"type": "text", "text": "h"}, "2"]), ChatMessage(role="ai", content="a1"),
        AIMessage([{"type": "reasoning", "reasoning": "hidden"}, {"type": "text", "text": "a2"}]), HumanMessage("h3"),
    ]
    core = to_core_messages(messages)
    assert [m["role"] for m in core] == ["system", "system", "user", "user", "assistant", "assistant", "user"]
    merged = normalize_messages(core)  # text blocks joined with a newline; reasoning is not replayed
    assert merged == [{"role": "system", "content": "s1\n\ns2"}, {"role": "user", "content": "h1\n\nh\n2"},
                      {"role": "assistant", "content": "a1\n\na2"}, {"role": "user", "content": "h3"}]


def test_tool_calls_and_results_round_trip(chat, tiny_gemma) -> None:
    """Tool calls and results reach the core; a member whose template knows no tools reads them as text."""
    messages = [HumanMessage("What is 6 times 7?"),
                AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7}, "id": "c1", "type": "tool_call"}]),
                ToolMessage("42", tool_call_id="c1", name="multiply"), FunctionMessage(name="f", content="3")]
    core = to_core_messages(messages)
    assert core[1]["tool_calls"] == [{"id": "c1", "name": "multiply", "arguments": {"a": 6, "b": 7}}]
    assert core[2] == {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "multiply"}
    assert core[3] == {"role": "tool", "content": "3", "name": "f"}
    text = tiny_gemma.render(core)
    assert '{"name": "multiply", "arguments": {"a": 6, "b": 7}}' in text
    assert "Tool result (multiply): 42" in text and "Tool result (f): 3" in text
    assert isinstance(chat.invoke(messages).content, str)


def test_a_result_with_only_the_call_id_gets_the_tool_name_and_developer_is_system(tiny_gemma) -> None:
    """``ToolMessage(content, tool_call_id=...)`` (no name, as results are usually written) is named after the call
    it answers, as in the LlamaIndex adapter; OpenAI's ``developer`` role is its system role."""
    messages = [ChatMessage(role="developer", content="Use the tools."), HumanMessage("What is 6 times 7?"),
                AIMessage("", tool_calls=[{"name": "multiply", "args": {"a": 6, "b": 7}, "id": "c1", "type": "tool_call"}]),
                ToolMessage("42", tool_call_id="c1"), ToolMessage("?", tool_call_id="unknown")]
    core = to_core_messages(messages)
    assert core[0]["role"] == "system"
    assert core[3]["name"] == "multiply" and core[4]["name"] is None
    assert "Tool result (multiply): 42" in tiny_gemma.render(core)


def test_provider_call_blocks_are_carried_by_tool_calls() -> None:
    """Anthropic-style list content with a tool_use block (langchain-tests' list-content history)."""
    call = {"name": "add", "args": {"a": 1, "b": 2}, "id": "abc", "type": "tool_call"}
    message = AIMessage([{"type": "text", "text": "some text"},
                         {"type": "tool_use", "id": "abc", "name": "add", "input": {"a": 1, "b": 2}}], tool_calls=[call])
    core = normalize_messages(to_core_messages([HumanMessage("1 + 2?"), message]))
    assert core[1] == {"role": "assistant", "content": "some text",
                       "tool_calls": [{"id": "abc", "name": "add", "arguments": {"a": 1, "b": 2}}]}


def test_non_text_content_and_bad_roles_are_rejected(chat) -> None:
    image = HumanMessage([{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "http://x/y.png"}}])
    with pytest.raises(UnsupportedContentError, match="'image'"):
        chat.invoke([image])
    with pytest.raises(InputError, match="role 'critic'"):
        chat.invoke([ChatMessage(role="critic", content="x")])
    with pytest.raises(InputError, match="No messages"):
        chat.invoke([])


# ---------------------------------------------------------------- tokens
def test_tokens_are_counted_with_the_primary_members_tokenizer(tiny_gemma, tiny_llama) -> None:
    gemma_first = ChatEnsemble(members=[tiny_gemma, tiny_llama], method="single")
    llama_first = ChatEnsemble(members=[tiny_llama, tiny_gemma], method="single")
    # " Incorrect": one Gemma token, two SmolLM2 tokens (GPT-2's fallback would not match either id)
    assert gemma_first.get_token_ids(" Incorrect") == tiny_gemma.tokenizer(" Incorrect", add_special_tokens=False)["input_ids"]
    assert gemma_first.get_num_tokens(" Incorrect") == 1
    assert llama_first.get_num_tokens(" Incorrect") == 2
    custom = ChatEnsemble(members=[tiny_gemma], method="single", custom_get_token_ids=lambda s: [1] * len(s))
    assert custom.get_num_tokens("abc") == 3


def test_message_token_count_equals_usage_input_tokens(chat) -> None:
    messages = [SystemMessage("Be brief."), SystemMessage("Be kind."), HumanMessage("Hi"), HumanMessage("there")]
    result = chat.invoke(messages)
    assert result.usage_metadata["input_tokens"] == chat.get_num_tokens_from_messages(messages)
    assert result.usage_metadata["output_tokens"] == chat.get_num_tokens(result.content)
    assert result.usage_metadata["total_tokens"] == result.usage_metadata["input_tokens"] + result.usage_metadata["output_tokens"]
    # the same messages again: the members' prefix caches held all of the prompt but its last token
    again = chat.invoke(messages).usage_metadata
    assert again["input_token_details"]["cache_read"] == again["input_tokens"] - 1


def test_any_list_of_messages_is_counted_so_trim_messages_can_use_the_model(chat) -> None:
    """LangChain's ``trim_messages(token_counter=chat)`` counts pieces of a history no call would take alone
    (``[]``, the system message alone, an empty message); they raised ``InputError`` before."""
    from langchain_core.messages.utils import trim_messages

    assert chat.get_num_tokens_from_messages([]) == 0
    assert chat.get_num_tokens_from_messages([SystemMessage("Be brief.")]) == chat.get_num_tokens("System: Be brief.")
    assert chat.get_num_tokens_from_messages([HumanMessage("")]) == chat.get_num_tokens("Human: ")
    history = [SystemMessage("Be brief."), HumanMessage("What is 2 + 3?"), AIMessage("5."), HumanMessage("And 4 + 5?")]
    whole = chat.get_num_tokens_from_messages(history)

    def trimmed(budget: int) -> list:
        return trim_messages(history, max_tokens=budget, token_counter=chat, strategy="last", include_system=True,
                             start_on="human")

    # LangChain counts the system message apart and the rest in pieces: a margin over the whole count
    assert trimmed(whole + 32) == history
    kept = [trimmed(budget) for budget in range(0, whole + 33, 4)]
    assert all(k == [] or (k[0] == history[0] and k[1:] == history[len(history) + 1 - len(k):]) for k in kept), kept
    assert [len(k) for k in kept] == sorted(len(k) for k in kept) and len(kept[0]) < 2 < len(kept[-1])
    with pytest.raises(InputError, match="not a LangChain message"):
        chat.get_num_tokens_from_messages(["Hi"])


# ---------------------------------------------------------------- results, chunks, callbacks
def test_invoke_metadata(chat) -> None:
    result = chat.invoke("Hello", max_tokens=4)
    meta = result.response_metadata
    assert result.content and meta["model_name"] == chat.model_name
    assert meta["finish_reason"] == "length" and meta["stop_reason"] == "length"
    assert meta["method"] == "single" and meta["token_counter"] == "tiny-gemma3-270m-0"
    assert meta["stats"]["tokens"] == 4 and result.usage_metadata["output_tokens"] <= 4
    json.dumps(meta)  # the core stats stay JSON-serialisable through the adapter


def test_stream_chunks_callbacks_and_usage_once(chat) -> None:
    counter = TokenCounter()
    chunks = list(chat.stream("Hello", config={"callbacks": [counter]}))
    assert len(chunks) >= 2 and all(isinstance(c, AIMessageChunk) for c in chunks)
    assert counter.tokens == [c.content for c in chunks]  # exactly one callback per chunk, in order
    with_usage = [c for c in chunks if c.usage_metadata]
    assert with_usage == [chunks[-1]] and chunks[-1].chunk_position == "last"
    assert sum(1 for c in chunks if c.response_metadata.get("model_name")) == 1
    assert "".join(c.content for c in chunks) == chat.invoke("Hello").content  # greedy: same text


def test_streaming_flag_routes_invoke_through_stream(pair) -> None:
    counter = TokenCounter()
    chat = ChatEnsemble(members=pair, method="single", max_tokens=5, streaming=True)
    result = chat.invoke("Hello", config={"callbacks": [counter]})
    assert "".join(counter.tokens) == result.content and len(counter.tokens) >= 2
    assert result.usage_metadata["output_tokens"] > 0


async def test_llm_async_paths(pair) -> None:
    llm = EnsembleLLM(members=pair, method="single", max_tokens=5)
    text = llm.invoke("Hello")
    assert await llm.ainvoke("Hello") == text
    counter = TokenCounter()
    pieces = [p async for p in llm.astream("Hello", config={"callbacks": [counter]})]
    assert "".join(pieces) == text and counter.tokens == pieces
    streaming = EnsembleLLM(members=pair, method="single", max_tokens=5, streaming=True)
    counter = TokenCounter()
    assert await streaming.abatch(["Hello", "Hello"], config={"callbacks": [counter]}) == [text, text]
    assert sorted(counter.tokens) == sorted(pieces * 2)  # the two run concurrently: their tokens interleave


def test_llm_batch_runs_prompts_concurrently_with_an_error_per_item(pair) -> None:
    """``BaseLLM.batch`` sent every prompt to one ``generate``: one after another, and with
    ``return_exceptions=True`` one empty prompt came back as the error of every item."""
    llm = EnsembleLLM(members=pair, method="single", max_tokens=5)
    text = llm.invoke("Hello")
    out = llm.batch(["Hello", "", "Hello"], return_exceptions=True)
    assert out[0] == out[2] == text and isinstance(out[1], InputError)
    batcher = llm._core_ensemble().method.batcher
    before = batcher.stats.batched_calls
    assert len(llm.batch(["Hello", "Bye", "Hello"], max_tokens=40)) == 3
    assert batcher.stats.batched_calls > before  # their passes were shared


async def test_async_paths_match_sync(chat) -> None:
    expected = chat.invoke("Hello").content
    assert (await chat.ainvoke("Hello")).content == expected
    counter = TokenCounter()
    chunks = [c async for c in chat.astream("Hello", config={"callbacks": [counter]})]
    assert "".join(c.content for c in chunks) == expected and counter.tokens == [c.content for c in chunks]
    assert [c for c in chunks if c.usage_metadata] == [chunks[-1]]


def test_llm_invoke_stream_batch_with_callbacks(pair) -> None:
    llm = EnsembleLLM(members=pair, method="single", max_tokens=5)
    counter = TokenCounter()
    text = llm.invoke("Hello", config={"callbacks": [counter]})
    assert text and counter.tokens == []  # no streaming: no token callbacks
    pieces = list(llm.stream("Hello", config={"callbacks": [counter]}))
    assert "".join(pieces) == text and counter.tokens == pieces  # BaseLLM.stream: _stream reports each chunk
    result = llm.generate(["Hello", "Bye"])
    assert [g[0].text for g in result.generations][0] == text
    usage = result.llm_output["token_usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    assert result.generations[0][0].generation_info["usage_metadata"]["output_tokens"] > 0
    streaming = EnsembleLLM(members=pair, method="single", max_tokens=5, streaming=True)
    counter = TokenCounter()
    assert streaming.invoke("Hello", config={"callbacks": [counter]}) == text and "".join(counter.tokens) == text
    assert len(counter.tokens) >= 2


# ---------------------------------------------------------------- tools and structured output
@tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def test_bind_tools_converts_tools_and_maps_tool_choice(chat) -> None:
    bound = chat.bind_tools([multiply, ADD], tool_choice="any")
    assert [t["function"]["name"] for t in bound.kwargs["tools"]] == ["multiply", "add"]
    assert bound.kwargs["tool_choice"] == "any"
    # objects in the parameters are closed (no undeclared arguments) unless strict=False
    assert all(t["function"]["parameters"]["additionalProperties"] is False for t in bound.kwargs["tools"])
    loose = chat.bind_tools([ADD], strict=False).kwargs["tools"][0]["function"]["parameters"]
    assert "additionalProperties" not in loose
    assert chat.bind_tools([ADD], tool_choice=True).kwargs["tool_choice"] == "required"
    for auto in (None, False, "auto"):
        assert "tool_choice" not in chat.bind_tools([ADD], tool_choice=auto).kwargs
    named = {"type": "function", "function": {"name": "add"}}
    assert chat.bind_tools([ADD], tool_choice=named).kwargs["tool_choice"] == named
    assert chat.bind_tools([ADD], tool_choice="none").kwargs["tool_choice"] == "none"
    with pytest.raises(InvalidOptionError, match="tool_choice"):
        chat.bind_tools([ADD], tool_choice=3)
    with pytest.raises(InvalidOptionError, match="tools"):
        chat.bind_tools(ADD)


def test_with_structured_output_uses_langchains_parsers(chat) -> None:
    cases = [(Pet, "json_schema", PydanticOutputParser), (PetDict, "json_schema", JsonOutputParser),
             (Pet.model_json_schema(), "json_schema", JsonOutputParser), (Pet, "function_calling", PydanticToolsParser),
             (PetDict, "function_calling", JsonOutputKeyToolsParser), (Pet, "json_mode", PydanticOutputParser),
             (None, "json_mode", JsonOutputParser)]
    for schema, method, parser in cases:
        runnable = chat.with_structured_output(schema, method=method)
        assert isinstance(runnable.last, parser), (schema, method)
        bound = runnable.first.kwargs
        assert bound["ls_structured_output_format"]["kwargs"]["method"] == method
        if method == "json_schema":
            fmt = bound["response_format"]
            assert fmt["type"] == "json_schema" and fmt["json_schema"]["name"] in ("Pet", "PetDict")
        elif method == "function_calling":
            assert bound["tool_choice"] == bound["tools"][0]["function"]["name"]
        else:
            assert bound["response_format"] == {"type": "json_object"}
    closed = chat.with_structured_output(Pet).first.kwargs["response_format"]["json_schema"]["schema"]
    assert closed["additionalProperties"] is False and closed["$defs"]["Owner"]["additionalProperties"] is False
    as_dict = chat.with_structured_output(Pet.model_json_schema()).first.kwargs["response_format"]["json_schema"]
    assert as_dict["schema"] == closed_schema(Pet.model_json_schema())  # closed unless strict=False
    loose = chat.with_structured_output(Pet.model_json_schema(), strict=False).first.kwargs["response_format"]
    assert "additionalProperties" not in loose["json_schema"]["schema"]
    opened = {**Pet.model_json_schema(), "additionalProperties": True}
    assert chat.with_structured_output(opened).first.kwargs["response_format"]["json_schema"]["schema"][
        "additionalProperties"] is True  # an explicit value is kept
    assert chat.with_structured_output(Pet, include_raw=True) is not None
    with pytest.raises(ConfigurationError, match="Unknown argument.*format"):
        chat.with_structured_output(Pet, format="json")
    with pytest.raises(InvalidOptionError, match="method"):
        chat.with_structured_output(Pet, method="xml")
    with pytest.raises(InvalidOptionError, match="'schema'"):
        chat.with_structured_output(None)
    # a schema whose top level is anyOf lost everything but its title as a tool (its forced call came back `{}`):
    # refused for function_calling, taken by json_schema
    shape = {"title": "Shape", "anyOf": [{"type": "object", "properties": {"radius": {"type": "number"}}},
                                         {"type": "object", "properties": {"side": {"type": "number"}}}]}
    with pytest.raises(InvalidOptionError, match="top level is 'anyOf'.*method='json_schema'"):
        chat.with_structured_output(shape, method="function_calling")
    assert chat.with_structured_output(shape).first.kwargs["response_format"]["json_schema"]["schema"]["anyOf"]


def test_structured_output_parses_and_a_cut_reply_is_refused(chat, pair) -> None:
    class Kind(BaseModel):  # enums and a bounded integer: even random weights finish it well within the budget
        kind: Literal["cat", "dog"]
        legs: int = Field(ge=0, le=9)

    roomy = ChatEnsemble(members=pair, method="single", max_tokens=200)
    out = roomy.with_structured_output(Kind, include_raw=True).invoke("My cat Tom.")
    assert isinstance(out["parsed"], Kind) and out["parsing_error"] is None
    assert out["raw"].response_metadata["finish_reason"] == "stop"
    cut = chat.with_structured_output(Pet, include_raw=True).invoke("My cat Tom.")  # max_tokens=6
    assert cut["raw"].response_metadata["finish_reason"] == "length"
    assert cut["parsed"] is None and "token budget" in str(cut["parsing_error"])  # not completed by parse_partial_json


def test_generated_call_round_trips_with_a_tool_message(chat) -> None:
    digits = {"type": "integer", "minimum": 0, "maximum": 9}  # bounded: random weights cannot loop on digits
    small_add = {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": digits, "b": digits}, "required": ["a", "b"]}}}
    bound = chat.bind_tools([small_add], tool_choice="add", max_tokens=200)
    call = bound.invoke("What is 2 + 3?")
    assert call.content == "" and call.tool_calls[0]["name"] == "add" and call.tool_calls[0]["id"].startswith("call_")
    assert call.response_metadata["finish_reason"] == "tool_calls"
    result = ToolMessage(str(sum(call.tool_calls[0]["args"].values())), tool_call_id=call.tool_calls[0]["id"], name="add")
    history = [HumanMessage("What is 2 + 3?"), call, result]
    core = to_core_messages(history)
    assert core[1]["tool_calls"][0]["id"] == call.tool_calls[0]["id"] and core[2]["tool_call_id"] == call.tool_calls[0]["id"]
    assert isinstance(chat.bind_tools([ADD]).invoke(history, max_tokens=4), AIMessage)
    with_tools = chat.get_num_tokens_from_messages(history, tools=[ADD])
    assert with_tools > chat.get_num_tokens_from_messages(history)  # the tools are part of the prompt


# ---------------------------------------------------------------- timeout and cancellation
def test_timeout_stops_the_core_and_raises(tiny_gemma, monkeypatch) -> None:
    chat = ChatEnsemble(members=[tiny_gemma], method="single", max_tokens=3000, timeout=0.2)
    method = chat._core_ensemble().method
    steps: list[bool] = []  # per round: had the deadline passed when it started?
    runs: list[CoreRun] = []
    original_init, original_step = CoreRun.__init__, type(method).step
    monkeypatch.setattr(CoreRun, "__init__", lambda self, *a, **k: runs.append(self) or original_init(self, *a, **k))
    monkeypatch.setattr(type(method), "step", lambda self, r: steps.append(runs[-1].timed_out) or original_step(self, r))
    with pytest.raises(GenerationTimeout, match="timeout=0.2"):
        chat.invoke("Tell me a long story")
    assert steps.count(True) <= 1  # the core stops after the round it is in when the deadline passes
    assert len(steps) < 3000
    chunks: list[str] = []
    # a per-call 2 s: the first text comes before the deadline also on a busy core (0.2 s once gave none);
    # 3000 tokens still take far longer
    with pytest.raises(TimeoutError):  # GenerationTimeout is a TimeoutError too
        for chunk in chat.stream("Tell me a long story", timeout=2.0):
            chunks.append(chunk.content)
    assert chunks, "text committed before the deadline is still streamed"


def test_leaving_a_stream_early_cancels_the_core_stream(chat, monkeypatch) -> None:
    runs: list[CoreRun] = []
    original = CoreRun.__iter__
    monkeypatch.setattr(CoreRun, "__iter__", lambda self: runs.append(self) or original(self))
    stream = chat.stream("Hello", max_tokens=50)
    next(stream)
    stream.close()
    assert runs[0].cancel_event.is_set()
    assert chat.invoke("Hello").content  # the ensemble's lock was released


def test_an_abandoned_stream_blocks_nobody_and_requests_interleave(chat) -> None:
    expected = [chat.invoke(p).content for p in ("Hello", "Bye")]
    abandoned = chat.stream("Hello", max_tokens=50)
    next(abandoned)  # started, neither finished nor closed
    assert chat.invoke("Hello", timeout=30).content == expected[0]
    assert [m.content for m in chat.batch(["Hello", "Bye"])] == expected  # parallel threads, rounds interleaved
    abandoned.close()


async def test_cancelled_task_cancels_generation(tiny_gemma) -> None:
    chat = ChatEnsemble(members=[tiny_gemma], method="single", max_tokens=3000)
    runs: list[CoreRun] = []
    original = CoreRun.astream
    first_chunk = asyncio.Event()

    def record(self):
        runs.append(self)
        return original(self)

    async def consume() -> None:
        async for _ in chat.astream("Tell me a long story"):
            first_chunk.set()

    CoreRun.astream = record
    try:
        task = asyncio.create_task(consume())
        await asyncio.wait_for(first_chunk.wait(), 30)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        CoreRun.astream = original
    run = runs[0]
    for _ in range(200):  # the worker finishes its current round, then stops
        if run.result is not None:
            break
        await asyncio.sleep(0.01)
    assert run.result is not None and run.result.finish_reason == "cancelled"
    assert run.result.stats["tokens"] < 3000


# ---------------------------------------------------------------- rebuilds: configurable_fields, model_copy
def _saved(member, path) -> str:
    """``member`` saved as a local directory: a member string (named after the directory) that loads in a blink."""
    member.model.save_pretrained(path)
    member.tokenizer.save_pretrained(path)
    return str(path)


def test_configurable_fields_rebuild_from_member_objects_and_a_prebuilt_ensemble(pair) -> None:
    # LangChain rebuilds the model from every current field value (the model_name derived from the members,
    # the empty method_config...) plus the configured ones: none of them is a clash
    chat = ChatEnsemble(members=pair, method="single", max_tokens=4)
    configurable = chat.configurable_fields(max_tokens=ConfigurableField(id="mt"))
    result = configurable.with_config(configurable={"mt": 2}).invoke("Hi")
    assert result.response_metadata["stats"]["tokens"] == 2
    assert result.response_metadata["model_name"] == chat.model_name
    built = Ensemble(pair, method="single")
    prebuilt = ChatEnsemble(ensemble=built, max_tokens=3).configurable_fields(temperature=ConfigurableField(id="t"))
    message = prebuilt.with_config(configurable={"t": 0.5}).invoke("Hi")
    assert message.response_metadata["ensemble"] == built.name and message.response_metadata["stats"]["tokens"] == 3
    # both given by the caller, and not the same members: still the typed errors
    with pytest.raises(ConfigurationError, match="names other members"):
        ChatEnsemble(members=pair, model="x+y")
    with pytest.raises(ConfigurationError, match="either ensemble="):
        ChatEnsemble(ensemble=built, method_config={"do_sample": False})


def test_a_configurable_model_or_members_switches_the_member_set(pair, tiny_llama, tmp_path) -> None:
    path = _saved(tiny_llama, tmp_path / "llama")
    chat = ChatEnsemble(members=pair, method="single", max_tokens=2)
    by_model = chat.configurable_fields(model_name=ConfigurableField(id="model"))
    switched = by_model.with_config(configurable={"model": path}).invoke("Hi").response_metadata
    assert switched["members"] == ["llama"] and switched["model_name"] == path and switched["method"] == "single"
    assert by_model.invoke("Hi").response_metadata["members"] == [m.name for m in pair]  # not configured: as built
    by_members = chat.configurable_fields(members=ConfigurableField(id="members"))
    assert by_members.with_config(configurable={"members": [tiny_llama]}).invoke("Hi").response_metadata[
        "model_name"] == tiny_llama.name
    # a member string naming a directory: model_name is the member's name, and a rebuild passes both
    local = ChatEnsemble(members=[path], method="single", max_tokens=2)
    assert local.model_name == "llama"
    assert local.configurable_fields(max_tokens=ConfigurableField(id="mt")).with_config(
        configurable={"mt": 1}).invoke("Hi").response_metadata["stats"]["tokens"] == 1
    # a prebuilt ensemble: a configured model runs those members with its method, as a per-call model= does
    prebuilt = ChatEnsemble(ensemble=Ensemble(pair, method="single"), max_tokens=2)
    meta = prebuilt.configurable_fields(model_name=ConfigurableField(id="model")).with_config(
        configurable={"model": path}).invoke("Hi").response_metadata
    assert meta["members"] == ["llama"] and meta["method"] == "single"


def test_model_copy_with_an_update_runs_the_new_values(pair, tiny_gemma) -> None:
    chat = ChatEnsemble(members=pair, method="single", max_tokens=3)
    copied = chat.model_copy(update={"members": [tiny_gemma]})
    assert copied.model_name == tiny_gemma.name and copied._core_ensemble() is not chat._core_ensemble()
    assert copied.invoke("Hi").response_metadata["members"] == [tiny_gemma.name]
    assert chat.invoke("Hi").response_metadata["members"] == [m.name for m in pair]  # the original is untouched
    assert chat.model_copy(update={"max_tokens": 1}).invoke("Hi").response_metadata["stats"]["tokens"] == 1
    assert chat.model_copy(update={"method": "every-token"})._core_ensemble().method_name == "every-token"
    with pytest.raises(InvalidOptionError, match="max_tokens"):  # validated like the constructor
        chat.model_copy(update={"max_tokens": -1})
    assert chat.model_copy()._core_ensemble() is chat._core_ensemble()


def test_deepcopy_shares_the_models_and_pickle_rebuilds_from_names(chat, pair, tmp_path) -> None:
    """copy.deepcopy (pydantic's model_copy(deep=True), frameworks copying a model) raised on the ensemble's
    locks; a pickle holds the names the members were given by and is rebuilt by the constructor."""
    import copy
    import pickle

    from ensemble_core import NotPicklableError

    stopped = ChatEnsemble(members=pair, method="single", max_tokens=6, stop=["zz"])
    for copied in (copy.deepcopy(stopped), stopped.model_copy(deep=True)):
        assert copied._core_ensemble() is stopped._core_ensemble() and copied.members[0] is pair[0]
        assert copied.stop == ["zz"] and copied.stop is not stopped.stop
        assert copied.invoke("Hi").content == stopped.invoke("Hi").content
    with pytest.raises(NotPicklableError, match="tiny-gemma3-270m-0.*by name"):
        pickle.dumps(chat)
    pair[1].model.save_pretrained(tmp_path / "llama")
    pair[1].tokenizer.save_pretrained(tmp_path / "llama")
    named = ChatEnsemble(members=[str(tmp_path / "llama")], method="single", max_tokens=4, temperature=0.0)
    back = pickle.loads(pickle.dumps(named))
    assert back._core_ensemble() is named._core_ensemble()  # rebuilt in this process: the shared ensemble
    assert back.max_tokens == 4 and back.invoke("Hi").content == named.invoke("Hi").content


def test_stream_usage_chooses_whether_the_last_chunk_carries_the_usage(chat, pair) -> None:
    """ChatOpenAI's option: None / True, the last chunk carries the usage; False leaves it out."""
    streamed = ChatEnsemble(members=pair, method="single", max_tokens=3, stream_usage=True)
    for chunks in (list(streamed.stream("Hi")), list(chat.stream("Hi", stream_usage=True)), list(chat.stream("Hi"))):
        assert [c for c in chunks if c.usage_metadata] == [chunks[-1]]
    assert chat.invoke("Hi", stream_usage=True).usage_metadata["output_tokens"] > 0
    quiet = ChatEnsemble(members=pair, method="single", max_tokens=3, stream_usage=False)
    for chunks in (list(quiet.stream("Hi")), list(chat.stream("Hi", stream_usage=False))):
        assert not any(c.usage_metadata for c in chunks) and chunks[-1].response_metadata["finish_reason"]
    assert quiet.invoke("Hi").usage_metadata["output_tokens"] > 0  # a whole answer is no stream
    assert list(quiet.stream("Hi", stream_usage=True))[-1].usage_metadata["output_tokens"] > 0  # the call's value wins
    llm = EnsembleLLM(members=pair, method="single", max_tokens=3)
    assert "usage_metadata" in list(llm._stream("Hi"))[-1].generation_info
    assert "usage_metadata" not in list(llm._stream("Hi", stream_usage=False))[-1].generation_info
    with pytest.raises(ConfigurationError, match="stream_usage"):
        ChatEnsemble(members=pair, method="single", stream_usage="sometimes")
    with pytest.raises(InvalidOptionError, match="stream_usage"):
        list(chat.stream("Hi", stream_usage=0))
