"""ChatEnsemble / EnsembleLLM on the bundled real pair inside LangChain: LCEL chains, stop
sequences, a free event loop while streaming, callbacks, and the method's statistics."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from langchain_core.callbacks import BaseCallbackHandler
from langchain_core.messages import HumanMessage, SystemMessage
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_ensemble import ChatEnsemble, EnsembleLLM

from ensemble_core import DEFAULT_MEMBERS

pytestmark = pytest.mark.real

PAIR = ["smollm2-135m-instruct", "gemma3-270m"]
METHOD = "safe"
MAX_TOKENS = 16


class TokenCounter(BaseCallbackHandler):
    def __init__(self) -> None:
        self.tokens: list[str] = []

    def on_llm_new_token(self, token: Any, **kwargs: Any) -> None:
        self.tokens.append(token)


@pytest.fixture(scope="module")
def chat() -> ChatEnsemble:
    return ChatEnsemble(members=PAIR, method=METHOD, max_tokens=MAX_TOKENS)


def test_defaults_and_model_string_share_the_loaded_ensemble(chat: ChatEnsemble) -> None:
    default = ChatEnsemble(method=METHOD)
    assert default.members is None and default.model_name == "+".join(DEFAULT_MEMBERS)
    assert default._core_ensemble() is ChatEnsemble(members=list(DEFAULT_MEMBERS), method=METHOD)._core_ensemble()
    assert [m.name for m in default._core_ensemble().members] == list(DEFAULT_MEMBERS)
    assert ChatEnsemble(model="+".join(PAIR), method=METHOD)._core_ensemble() is chat._core_ensemble()


def test_lcel_chain_invoke_and_batch(chat: ChatEnsemble) -> None:
    prompt = ChatPromptTemplate.from_messages([("system", "Answer in one short sentence."), ("human", "{question}")])
    chain = prompt | chat | StrOutputParser()
    answer = chain.invoke({"question": "What is the capital of France?"})
    assert isinstance(answer, str) and answer.strip()
    assert "<|im_start|>" not in answer and "User:" not in answer and "capital of France?" not in answer  # no echo
    answers = chain.batch([{"question": "What is the capital of France?"}, {"question": "Name a color."}])
    assert len(answers) == 2 and all(isinstance(a, str) and a.strip() for a in answers)
    assert answers[0] == answer  # greedy decoding: batch and invoke agree
    short = (prompt | chat.bind(max_tokens=3)).invoke({"question": "What is the capital of France?"})
    assert short.usage_metadata["output_tokens"] <= 3 and short.response_metadata["finish_reason"] == "length"


def test_stop_sequences_metadata_and_merged_messages(chat: ChatEnsemble) -> None:
    # several system messages and consecutive user turns are merged by the core before rendering
    messages = [SystemMessage("Be brief."), SystemMessage("Be friendly."), HumanMessage("Hi!"),
                HumanMessage("Describe the sea in one sentence.")]
    full = chat.invoke(messages)
    meta, usage = full.response_metadata, full.usage_metadata
    assert meta["method"] == METHOD and meta["members"] == PAIR and meta["model_name"] == "+".join(PAIR)
    assert usage["input_tokens"] == chat.get_num_tokens_from_messages(messages)
    assert usage["output_tokens"] == chat.get_num_tokens(full.content) <= MAX_TOKENS
    if METHOD == "safe":
        stats = meta["stats"]
        assert 0.0 <= stats["e_t"] <= 1.0 and stats["drafter"] == meta["token_counter"]
        assert {m["name"] for m in stats["members"]} == set(PAIR) and all(m["seconds"] > 0 for m in stats["members"])

    words = full.content.split()
    assert len(words) >= 3, full.content
    stop = words[2]
    expected = full.content[: full.content.index(stop)]
    stopped = chat.invoke(messages, stop=[stop])
    assert stopped.content == expected and stopped.response_metadata["stop_reason"] == "stop"
    streamed = list(chat.stream(messages, stop=[stop]))
    assert "".join(c.content for c in streamed) == expected
    assert streamed[-1].response_metadata["stop_reason"] == "stop"
    instance_stop = ChatEnsemble(members=PAIR, method=METHOD, max_tokens=MAX_TOKENS, stop=[stop])
    assert instance_stop.invoke(messages).content == expected


async def test_astream_leaves_the_event_loop_free(chat: ChatEnsemble) -> None:
    ticks = 0
    running = True

    async def ticker() -> None:
        nonlocal ticks
        while running:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    ticks_at_chunk: list[int] = []
    text = ""
    try:
        async for chunk in chat.astream("Tell me about the moon."):
            ticks_at_chunk.append(ticks)
            text += chunk.content
    finally:
        running = False
        await task
    assert text and len(ticks_at_chunk) >= 3
    # the ticker kept running while the members computed: it advanced between chunks
    assert ticks_at_chunk[-1] - ticks_at_chunk[0] >= len(ticks_at_chunk) - 1


def test_llm_invoke_stream_batch_with_callbacks() -> None:
    llm = EnsembleLLM(members=PAIR, method=METHOD, max_tokens=6)
    counter = TokenCounter()
    texts = llm.batch(["Name a fruit.", "Name a color."], config={"callbacks": [counter]})
    assert len(texts) == 2 and all(t.strip() for t in texts) and counter.tokens == []  # not streaming: no tokens
    pieces = list(llm.stream("Name a fruit.", config={"callbacks": [counter]}))
    assert "".join(pieces) == texts[0] and counter.tokens == pieces and len(pieces) >= 2
    streaming = EnsembleLLM(members=PAIR, method=METHOD, max_tokens=6, streaming=True)
    counter = TokenCounter()
    assert streaming.invoke("Name a color.", config={"callbacks": [counter]}) == texts[1]
    assert "".join(counter.tokens) == texts[1] and len(counter.tokens) >= 2  # each streamed chunk reported once
