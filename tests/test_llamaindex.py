"""The LlamaIndex adapter: ``from llama_index.llms.ensemble import EnsembleLLM``.

Fast tests use tiny random-weight members (real tokenizers) for everything that does not
need sensible text: packaging, message conversion, options, metadata, caching. Tests
marked ``real`` run the bundled pair through the adapter: complete / chat / streams /
async (the event loop keeps running, cancellation stops the core), stop strings and the
usage that ``TokenCountingHandler`` reads.
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Literal

import llama_index.llms.ensemble as pkg
import pytest
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, ImageBlock, MessageRole, TextBlock
from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.prompts import PromptTemplate
from llama_index.core.tools import FunctionTool
from llama_index.llms.ensemble import EnsembleLLM, default_context_margin, shared_ensemble
from llama_index.llms.ensemble.messages import to_core_messages
from llamaindex_events import Events
from pydantic import BaseModel, Field

from ensemble_core import (
    ConfigurationError,
    GenerationCancelled,
    InputError,
    InvalidOptionError,
    Member,
    PromptTooLongError,
    UnsupportedContentError,
    normalize_messages,
)
from ensemble_core.text.chat import as_text_turns

REPO = Path(__file__).resolve().parents[1]
PAIR = ["smollm2-135m-instruct", "gemma3-270m"]
#: The method the real tests run (SAFE is the issue's target; see the report if it differs).
METHOD = "safe"
PROMPT = "What is the capital of France?"  # a short answer that ends at EOS keeps the real tests fast
MAX_NEW = 16


# --------------------------------------------------------------------------- packaging
def test_import_through_implicit_namespace_package() -> None:
    for folder in ("integrations/llama_index", "integrations/llama_index/llms"):
        assert not (REPO / folder / "__init__.py").exists(), f"{folder} must stay an implicit namespace package"
    import llama_index
    import llama_index.llms

    assert llama_index.__file__ is None and llama_index.llms.__file__ is None  # namespace packages, installed or not
    assert Path(pkg.__file__).parts[-4:] == ("llama_index", "llms", "ensemble", "__init__.py")
    assert Path(llama_index.core.__file__).parts[-3:] == ("llama_index", "core", "__init__.py")  # untouched
    assert EnsembleLLM.class_name() == "EnsembleLLM"


# --------------------------------------------------------------------------- messages
def test_messages_keep_their_turns_and_roles() -> None:
    messages = [
        ChatMessage(role=MessageRole.DEVELOPER, content="Be brief."),
        ChatMessage(role=MessageRole.USER, content="What is 2+2?"),
        ChatMessage(role=MessageRole.ASSISTANT, content="4"),
        ChatMessage(role=MessageRole.TOOL, content="42", additional_kwargs={"name": "calc"}),
        ChatMessage(role=MessageRole.MODEL, content="ok"),
    ]
    assert normalize_messages(to_core_messages(messages)) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "tool", "content": "42", "name": "calc"},
        {"role": "assistant", "content": "ok"},
    ]
    assert as_text_turns(normalize_messages(to_core_messages(messages)))[3] == {
        "role": "user", "content": "Tool result (calc): 42"}  # for members whose template knows no tools
    two_blocks = ChatMessage(role="user", blocks=[TextBlock(text="a"), TextBlock(text="b")])
    assert normalize_messages(to_core_messages([two_blocks])) == [{"role": "user", "content": "a\nb"}]


def test_non_text_content_and_empty_input_are_refused() -> None:
    image = ChatMessage(role="user", blocks=[TextBlock(text="What is this?"), ImageBlock(url="http://x/y.png")])
    with pytest.raises(UnsupportedContentError, match="'image' content part"):
        normalize_messages(to_core_messages([image]))
    with pytest.raises(InputError, match="No messages"):
        to_core_messages([])


# --------------------------------------------------------------------------- options (tiny members)
def counts(usage: dict) -> dict:
    """The token counts of a usage (not ``prompt_tokens_details``: a prompt sent again is read from the cache)."""
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")}


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama: Member, tiny_gemma: Member) -> EnsembleLLM:
    return EnsembleLLM(members=[tiny_llama, tiny_gemma], method="single", max_new_tokens=4)


def test_metadata_names_members_and_method(tiny_llm: EnsembleLLM, tiny_llama: Member, tiny_gemma: Member) -> None:
    meta = tiny_llm.metadata
    window = min(tiny_llama.context_window, tiny_gemma.context_window)
    assert meta.context_window == window - default_context_margin(window)
    assert meta.num_output == 4 and meta.is_chat_model and meta.is_function_calling_model
    assert meta.model_name == f"single({tiny_llama.name}+{tiny_gemma.name})"
    assert tiny_llm.to_dict()["members"] == [tiny_llama.name, tiny_gemma.name]
    custom = EnsembleLLM(members=[tiny_llama, tiny_gemma], method="single", context_margin=100)
    assert custom.metadata.context_window == window - 100


def test_identical_configurations_share_one_ensemble(tiny_llm: EnsembleLLM, tiny_llama: Member,
                                                     tiny_gemma: Member) -> None:
    again = EnsembleLLM(members=[tiny_llama, tiny_gemma], method="single", max_new_tokens=9, stop=["x"])
    assert again.ensemble is tiny_llm.ensemble  # per-call settings are not part of the key
    assert again._overrides({})["stop"] == ("x",)
    assert again._overrides({"stop": ["y", "x"]})["stop"] == ("y", "x")  # a per-call stop replaces the field's
    assert shared_ensemble([tiny_llama, tiny_gemma], "single", {}, {}) is tiny_llm.ensemble
    other = EnsembleLLM(members=[tiny_llama, tiny_gemma], method="single", method_config={"seed": 3})
    assert other.ensemble is not tiny_llm.ensemble


def test_too_long_prompt_raises_a_typed_error_everywhere(tiny_llm: EnsembleLLM) -> None:
    """The error names what a LlamaIndex user can change: LlamaIndex packed the prompt counting with its own
    tokenizer (digits: SmolLM2 needs 1.78x cl100k's tokens; ``tree_summarize`` over Russian text failed so)."""
    prompt = "word " * 5000  # the tiny members' window is 4096 tokens
    levers = r"Settings.tokenizer = llm.token_ids .* context_margin"
    with pytest.raises(PromptTooLongError, match=levers):
        tiny_llm.complete(prompt)
    with pytest.raises(PromptTooLongError, match=levers):
        list(tiny_llm.stream_chat([ChatMessage(role="user", content=prompt)]))

    async def run_async() -> None:
        with pytest.raises(PromptTooLongError, match=levers):
            await tiny_llm.acomplete(prompt)
        with pytest.raises(PromptTooLongError, match=levers):
            [c async for c in await tiny_llm.astream_complete(prompt)]

    asyncio.run(run_async())
    assert tiny_llm.complete("hi").raw["usage"]["completion_tokens"] <= 4  # and the ensemble is free again


def test_token_ids_let_llamaindex_count_as_the_members_do(tiny_llm: EnsembleLLM, tiny_llama: Member) -> None:
    """``Settings.tokenizer = llm.token_ids``: LlamaIndex's prompt helper counts with the primary member's
    tokenizer, so what it packs into ``context_window`` fits the member whatever the language."""
    from llama_index.core import PromptHelper

    digits = "1234567890 " * 400  # cl100k: ~1600 tokens; SmolLM2's tokenizer: one per digit
    assert tiny_llm.token_ids(digits) == tiny_llama.tokenizer(digits, add_special_tokens=False)["input_ids"]
    helper = PromptHelper.from_llm_metadata(tiny_llm.metadata, tokenizer=tiny_llm.token_ids)
    assert helper._token_counter.get_string_tokens(digits) == len(tiny_llm.token_ids(digits)) > 4000


def test_options_are_validated(tiny_llm: EnsembleLLM, tiny_llama: Member) -> None:
    with pytest.raises(ConfigurationError, match="max_new_tokens"):
        EnsembleLLM(members=[tiny_llama], method="single", method_config={"max_new_tokens": 5})
    with pytest.raises(InvalidOptionError, match="method"):
        EnsembleLLM(members=[tiny_llama], method="no-such-method")
    with pytest.raises(ConfigurationError, match="Unknown option"):
        tiny_llm.complete("hi", beams=3)
    with pytest.raises(InvalidOptionError, match="temperature"):
        tiny_llm.complete("hi", temperature=-1)
    with pytest.raises(InvalidOptionError, match="max_tokens"):
        tiny_llm.complete("hi", max_tokens=0)
    assert tiny_llm._overrides({"max_tokens": 3, "temperature": 0.7, "stop": "\n\n", "seed": 1}) == {
        "max_new_tokens": 3, "stop": ("\n\n",), "do_sample": True, "temperature": 0.7, "seed": 1}


def test_tiny_members_run_every_entry_point(tiny_llm: EnsembleLLM) -> None:
    """All eight entry points return well-formed responses with usage (text is random here)."""
    msgs = [ChatMessage(role="user", content="hi")]
    done = tiny_llm.complete("hi")
    assert done.raw["usage"]["completion_tokens"] <= 4 and done.raw["stats"]["method"] == "single"
    assert [r.delta for r in tiny_llm.stream_complete("hi")][-1] == ""
    assert tiny_llm.chat(msgs).message.role == MessageRole.ASSISTANT

    async def run_async() -> None:
        assert (await tiny_llm.acomplete("hi")).text == done.text
        assert (await tiny_llm.achat(msgs)).message.content == tiny_llm.chat(msgs).message.content
        chunks = [c async for c in await tiny_llm.astream_complete("hi")]
        assert chunks[-1].text == done.text and counts(chunks[-1].raw["usage"]) == counts(done.raw["usage"])
        chunks = [c async for c in await tiny_llm.astream_chat(msgs)]
        assert chunks[-1].raw["finish_reason"] in ("length", "eos", "stop")

    asyncio.run(run_async())



# --------------------------------------------------------------------------- function calling (tiny members)
class Kind(BaseModel):
    """The kind of pet and its legs (enums and a bounded integer: even random weights finish it)."""

    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=9)


PETS: list[tuple[str, int]] = []


class PetArgs(BaseModel):
    kind: Literal["cat", "dog"]
    legs: int = Field(ge=0, le=9)


def pet(kind: str, legs: int) -> str:
    """Record a pet."""
    PETS.append((kind, legs))
    return f"{kind} with {legs} legs"


def _tools() -> list[FunctionTool]:
    """The ``pet`` tool (its arguments: an enum and an integer); empties the log PETS."""
    PETS.clear()
    return [FunctionTool.from_defaults(pet, fn_schema=PetArgs)]


def test_prepare_chat_with_tools_and_tool_choice(tiny_llm: EnsembleLLM) -> None:
    tools = _tools()
    prepared = tiny_llm._prepare_chat_with_tools(tools, user_msg="hi", chat_history=[ChatMessage(role="system", content="s")])
    assert [m.role for m in prepared["messages"]] == [MessageRole.SYSTEM, MessageRole.USER]
    assert prepared["tools"][0]["function"]["name"] == "pet" and prepared["tool_choice"] == "auto"
    assert tiny_llm._prepare_chat_with_tools(tools, tool_required=True)["tool_choice"] == "required"
    assert tiny_llm._prepare_chat_with_tools(tools, tool_required=True, tool_choice="pet")["tool_choice"] == "pet"
    assert tiny_llm._prepare_chat_with_tools([], user_msg="hi")["tools"] is None
    assert prepared["tools"][0]["function"]["parameters"]["additionalProperties"] is False  # closed unless strict=False
    loose = tiny_llm._prepare_chat_with_tools(tools, strict=False)["tools"][0]["function"]["parameters"]
    assert "additionalProperties" not in loose


def test_tool_calls_come_back_as_blocks_and_round_trip(tiny_llm: EnsembleLLM) -> None:
    tools = _tools()
    response = tiny_llm.chat_with_tools(tools, user_msg="I have a cat.", tool_required=True, max_new_tokens=80)
    calls = tiny_llm.get_tool_calls_from_response(response)
    assert len(calls) == 1 and calls[0].tool_name == "pet" and calls[0].tool_id.startswith("call_")
    assert response.raw["finish_reason"] == "tool_calls" and response.additional_kwargs["finish_reason"] == "tool_calls"
    assert [type(b).__name__ for b in response.message.blocks] == ["ToolCallBlock"] and not response.message.content
    streamed = list(tiny_llm.stream_chat_with_tools(tools, user_msg="I have a cat.", tool_required=True,
                                                    max_new_tokens=80))
    assert len(streamed) == 1 and tiny_llm.get_tool_calls_from_response(streamed[-1])[0].tool_kwargs == calls[0].tool_kwargs
    history = [ChatMessage(role="user", content="I have a cat."), response.message,
               ChatMessage(role="tool", content="ok", additional_kwargs={"tool_call_id": calls[0].tool_id})]
    core = to_core_messages(history)
    assert core[1]["tool_calls"] == [{"id": calls[0].tool_id, "name": "pet", "arguments": calls[0].tool_kwargs}]
    assert core[2] == {"role": "tool", "content": [{"type": "text", "text": "ok"}], "tool_call_id": calls[0].tool_id,
                       "name": "pet"}  # the name is recovered from the call it answers
    assert tiny_llm.chat(history).message.role == MessageRole.ASSISTANT
    legacy = ChatResponse(message=ChatMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
        {"id": "c9", "type": "function", "function": {"name": "pet", "arguments": '{"kind": "dog", "legs": 4}'}}]}))
    assert tiny_llm.get_tool_calls_from_response(legacy)[0].tool_kwargs == {"kind": "dog", "legs": 4}
    text = ChatResponse(message=ChatMessage(role="assistant", content="no call"))
    assert tiny_llm.get_tool_calls_from_response(text, error_on_no_tool_call=False) == []
    with pytest.raises(ValueError, match="answered in text: 'no call'"):
        tiny_llm.get_tool_calls_from_response(text)


def test_structured_predict_and_structured_llm(tiny_llama: Member, tiny_gemma: Member) -> None:
    """The default program mode decodes the value under the class's schema (no tool offered); "function" is
    LlamaIndex's FunctionCallingProgram (a forced call of a tool named after the class); both give a Kind."""
    llm = EnsembleLLM(members=[tiny_llama, tiny_gemma], method="single", max_new_tokens=80)
    with Events() as events:
        kind = llm.structured_predict(Kind, PromptTemplate("Describe {pet}."), pet="my cat")
        assert isinstance(kind, Kind)
        asked = events.chat_kwargs()[-1]
        assert asked["response_format"]["json_schema"]["schema"]["additionalProperties"] is False  # closed (strict)
        assert "tools" not in asked
        reply = llm.as_structured_llm(Kind).chat([ChatMessage(role="user", content="my dog")])
        assert isinstance(reply.raw, Kind) and json.loads(reply.message.content) == reply.raw.model_dump()
        assert "response_format" in events.chat_kwargs()[-1]
        function = EnsembleLLM(members=[tiny_llama, tiny_gemma], method="single", max_new_tokens=80,
                               pydantic_program_mode="function")
        assert isinstance(function.structured_predict(Kind, PromptTemplate("Describe {pet}."), pet="my cat"), Kind)
        asked = events.chat_kwargs()[-1]
        assert asked["tools"][0]["function"]["name"] == "Kind" and "response_format" not in asked
    predicted = llm.predict_and_call(_tools(), user_msg="I have a dog.", error_on_no_tool_call=False)
    assert isinstance(predicted.response, str) and len(PETS) <= 1  # auto: the random model may or may not call


def test_structured_streams_and_async(tiny_llama: Member) -> None:
    """Streamed structured output: partial values while the JSON grows, the checked value last (sync and
    async); LlamaIndex's instrumentation sees the start, progress and end events."""
    llm = EnsembleLLM(members=[tiny_llama], method="single", max_new_tokens=80)
    prompt = PromptTemplate("Describe {pet}.")
    with Events() as events:
        parts = list(llm.stream_structured_predict(Kind, prompt, pet="my cat"))
        assert len(parts) > 1 and isinstance(parts[-1], Kind)
        assert not isinstance(parts[0], Kind)  # a partial (Flexible) value first
        assert {"LLMStructuredPredictStartEvent", "LLMStructuredPredictInProgressEvent",
                "LLMStructuredPredictEndEvent"} <= events.kinds()
    assert parts[-1] == llm.structured_predict(Kind, prompt, pet="my cat")  # greedy: the same value

    async def both() -> tuple:
        value = await llm.astructured_predict(Kind, prompt, pet="my cat")
        stream = await llm.astream_structured_predict(Kind, prompt, pet="my cat")
        return value, [p async for p in stream]

    value, streamed = asyncio.run(both())
    assert value == parts[-1] and streamed[-1] == parts[-1] and len(streamed) == len(parts)
    reply = asyncio.run(llm.as_structured_llm(Kind).achat([ChatMessage(role="user", content="my cat")]))
    assert isinstance(reply.raw, Kind)


def test_structured_value_cut_by_the_budget_names_the_fix(tiny_llama: Member) -> None:
    class Long(BaseModel):
        text: str = Field(min_length=1)
        more: list[str]

    llm = EnsembleLLM(members=[tiny_llama], method="single", max_new_tokens=3)
    with pytest.raises(ValueError, match=r"token budget cut the Long value.*Raise max_new_tokens"):
        llm.structured_predict(Long, PromptTemplate("Write {what}."), what="a story")
    with pytest.raises(ValueError, match="token budget cut"):
        list(llm.stream_structured_predict(Long, PromptTemplate("Write {what}."), what="a story"))


# --------------------------------------------------------------------------- real pair
@pytest.fixture(scope="module")
def llm() -> EnsembleLLM:
    return EnsembleLLM(members=PAIR, method=METHOD, max_new_tokens=MAX_NEW)


@pytest.fixture(scope="module")
def reference(llm: EnsembleLLM):
    return llm.complete(PROMPT)


def test_pickle_rebuilds_from_the_names_and_deepcopy_shares_the_models(llm: EnsembleLLM, tiny_llm: EnsembleLLM) -> None:
    """LlamaIndex's own pickling dropped loaded members with a warning (the copy ran the default pair);
    deepcopy raised on the ensemble's locks."""
    import copy
    import pickle

    from ensemble_core import NotPicklableError

    back = pickle.loads(pickle.dumps(llm))
    assert back.ensemble is llm.ensemble and back.members == PAIR and back.max_new_tokens == MAX_NEW
    with pytest.raises(NotPicklableError, match="tiny-"):
        pickle.dumps(tiny_llm)
    copied = copy.deepcopy(tiny_llm)
    assert copied.ensemble is tiny_llm.ensemble and copied.members[0] is tiny_llm.members[0]
    assert copied.complete("Hi").text == tiny_llm.complete("Hi").text


@pytest.mark.real
def test_real_metadata_and_shared_weights(llm: EnsembleLLM, real_pair: list[Member]) -> None:
    meta = llm.metadata
    assert meta.model_name == f"{METHOD}(smollm2-135m-instruct+gemma3-270m)"
    assert meta.context_window == 8192 - default_context_margin(8192)  # SmolLM2's window is the smaller
    # Weights come from the core's per-process cache: the same tensors as any other user's.
    for mine, loaded in zip(llm.ensemble.members, real_pair):
        assert mine.model is loaded.model


@pytest.mark.real
def test_real_weights_shared_with_the_langchain_adapter(llm: EnsembleLLM) -> None:
    pytest.importorskip("langchain_core", reason="the LangChain adapter needs langchain-core")
    from langchain_ensemble import ChatEnsemble

    chat = ChatEnsemble(members=PAIR, method=METHOD, max_tokens=MAX_NEW)
    theirs = chat._core_ensemble()  # noqa: SLF001 - the object the LangChain adapter generates with
    assert [m.model for m in theirs.members] == [m.model for m in llm.ensemble.members]
    assert all(a.model is b.model for a, b in zip(theirs.members, llm.ensemble.members))


@pytest.mark.real
def test_real_complete_carries_usage_and_stats(llm: EnsembleLLM, reference) -> None:
    assert reference.text.strip()
    usage = reference.raw["usage"]
    primary = llm.ensemble.method.primary
    assert usage["completion_tokens"] == primary.count_tokens(reference.text)
    assert usage["prompt_tokens"] == len(primary.encode_prompt(primary.render(PROMPT)))
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert reference.raw["stats"]["method"] == METHOD
    assert reference.additional_kwargs["ensemble_stats"] == reference.raw["stats"]
    assert reference.raw["finish_reason"] in ("eos", "length", "stop")


@pytest.mark.real
def test_real_stream_complete_equals_complete(llm: EnsembleLLM, reference) -> None:
    chunks = list(llm.stream_complete(PROMPT))
    assert "".join(c.delta for c in chunks) == reference.text == chunks[-1].text
    assert len(chunks) >= 2 and chunks[-1].delta == "" and counts(chunks[-1].raw["usage"]) == counts(reference.raw["usage"])
    # the same prompt again: the members' prefix caches held all of it but the last token
    assert chunks[-1].raw["usage"]["prompt_tokens_details"]["cached_tokens"] == reference.raw["usage"]["prompt_tokens"] - 1
    assert all(c.raw is None for c in chunks[:-1])  # usage is known once, at the end


@pytest.mark.real
def test_real_stop_is_honoured(llm: EnsembleLLM, reference) -> None:
    text = reference.text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[len(words) // 2]
    cut = llm.complete(PROMPT, stop=[stop])
    assert cut.text == text[: text.index(stop)], (stop, text, cut.text)
    assert cut.raw["finish_reason"] == "stop"


@pytest.mark.real
async def test_real_async_does_not_block_the_event_loop(llm: EnsembleLLM, reference) -> None:
    ticks = 0
    stop_ticking = asyncio.Event()

    async def heartbeat() -> None:
        nonlocal ticks
        while not stop_ticking.is_set():
            ticks += 1
            await asyncio.sleep(0.01)

    beat = asyncio.create_task(heartbeat())
    before = ticks
    done = await llm.acomplete(PROMPT)
    ticks_during = ticks - before
    chunks, seen = [], []
    async for c in await llm.astream_chat([ChatMessage(role="user", content=PROMPT)]):
        chunks.append(c)
        seen.append(ticks)
    stop_ticking.set()
    await beat
    assert done.text == reference.text
    assert "".join(c.delta for c in chunks) == reference.text
    assert counts(chunks[-1].raw["usage"]) == counts(reference.raw["usage"])
    # The generation runs in a worker thread: the heartbeat keeps running during it (a blocked
    # loop would run it only after the call), and between the first and the last chunk.
    assert ticks_during >= 1 and seen[-1] > seen[0], (ticks_during, seen)


@pytest.mark.real
async def test_real_async_cancellation_stops_the_core(llm: EnsembleLLM) -> None:
    run = llm._run("Write a long story about a dragon and a lighthouse.", {"max_new_tokens": 200})  # noqa: SLF001 - observe the core run itself
    first = asyncio.get_running_loop().create_future()

    async def consume() -> None:
        async for delta in run.astream():
            if not first.done():
                first.set_result(delta)

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first, timeout=60)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert run.cancelled
    deadline = time.perf_counter() + 30
    while run.result is None and time.perf_counter() < deadline:  # the worker finishes its round, then stops
        await asyncio.sleep(0.05)
    assert run.result is not None and run.result.finish_reason == "cancelled"
    assert run.result.completion_tokens < 200
    # The ensemble is free again: a new request runs at once.
    assert (await llm.acomplete(PROMPT, max_new_tokens=2)).raw["usage"]["completion_tokens"] <= 2


@pytest.mark.real
def test_real_cancelled_while_waiting_for_the_ensemble(llm: EnsembleLLM) -> None:
    lock = llm.ensemble.lock
    with lock:  # another generation holds the ensemble
        run = llm._run(PROMPT, {})  # noqa: SLF001
        run.cancel()
        with pytest.raises(GenerationCancelled, match="waiting"):
            run.run()


@pytest.mark.real
def test_real_token_counting_handler_reads_the_usage(reference) -> None:
    """complete and stream_chat through a callback manager; also: a string prompt is one user turn."""
    counter = TokenCountingHandler()
    llm = EnsembleLLM(members=PAIR, method=METHOD, max_new_tokens=MAX_NEW, callback_manager=CallbackManager([counter]))
    done = llm.complete(PROMPT)
    streamed = list(llm.stream_chat([ChatMessage(role="user", content=PROMPT)]))
    assert done.text == reference.text
    assert "".join(c.delta for c in streamed) == streamed[-1].message.content == reference.text
    assert streamed[-1].raw["stats"]["method"] == METHOD and streamed[-1].delta == ""
    assert len(counter.llm_token_counts) == 2
    for event, usage in zip(counter.llm_token_counts, (done.raw["usage"], streamed[-1].raw["usage"])):
        # The handler's own tokenizer (tiktoken) would count the bare prompt, not the
        # chat-formatted one the members saw: equality means it read raw["usage"].
        assert event.prompt_token_count == usage["prompt_tokens"] > 2 * len(PROMPT.split())
        assert event.completion_token_count == usage["completion_tokens"]
    assert counter.total_llm_token_count == 2 * reference.raw["usage"]["total_tokens"]
