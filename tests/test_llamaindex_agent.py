"""A ReActAgent (text-based tool use) on the ensemble.

(``EnsembleLLM`` is also a function-calling LLM: the ``FunctionAgent`` tests, with forced
calls on the bundled pair and a scripted member in auto mode, are in ``test_agents.py``,
which reuses :class:`ScriptedLM` from here.)

Two tests, because the bundled models are tiny:

* the real pair runs the agent loop with a calculator tool to a final response without
  raising (whether the 135M/270M models call the tool correctly is up to them);
* a *scripted member* checks the part the tiny models cannot be relied on for: that a
  well-formed ReAct reply travelling through the ensemble core and this adapter is parsed
  into a tool call, the tool runs, its observation goes back through the adapter, and the
  final answer comes out. The scripted member is a real (tiny, random-weight) transformers
  model run by the real core through its KV cache; only its logits are replaced by a
  one-hot on the next token of a scripted reply. Nothing in the ensemble or the adapter
  is faked.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from llama_index.core.agent.workflow import ReActAgent
from llama_index.core.tools import FunctionTool
from llama_index.llms.ensemble import EnsembleLLM

from ensemble_core import Member
from ensemble_core.testing import tiny_member

PAIR = ["smollm2-135m-instruct", "gemma3-270m"]
METHOD = "safe"


def make_multiply(calls: list[tuple[float, float]]) -> FunctionTool:
    def multiply(a: float, b: float) -> float:
        """Multiply two numbers and return the product."""
        calls.append((a, b))
        return a * b

    return FunctionTool.from_defaults(multiply)


class ScriptedLM(torch.nn.Module):
    """A causal LM that writes ``reply(prompt_text)`` and then EOS, whatever its weights say.

    Wraps a tiny transformers model: the forward pass and its KV cache are the inner
    model's (so the core's incremental decoding runs for real); the returned logits are
    replaced by a one-hot on the scripted token for each position. The full id sequence
    is tracked from the cache length, as the core only feeds the uncached tail; the reply
    starts after the last assistant header (the first pass may also feed prompt-lookup guesses).
    A new request is one whose first pass finds the cache empty, so its members run without the
    prefix cache (``Member(..., prefix_cache=0)``): a restored prompt would look like the last request's
    continuation.
    """

    def __init__(self, inner: Any, tokenizer: Any, reply: Callable[[str], str]) -> None:
        super().__init__()
        self.inner, self.tokenizer, self.reply = inner, tokenizer, reply
        self.config = inner.config
        self.generation_config = inner.generation_config
        self._ids: list[int] = []
        self._prompt_ids: list[int] = []
        self._prompt_len = 0
        self._target: list[int] = []
        self.prompts: list[str] = []

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def dtype(self) -> torch.dtype:
        return self.inner.dtype

    def get_output_embeddings(self) -> Any:
        return self.inner.get_output_embeddings()

    def _prompt_end(self, ids: list[int]) -> int:
        """Where the reply starts: after the last assistant header that opens a turn (right after an
        ``<|im_end|>``), so that a first pass that also feeds prompt-lookup guesses (which may guess a
        header) does not count them as prompt."""
        marker = self.tokenizer("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
        closer = self.tokenizer("<|im_end|>\n", add_special_tokens=False)["input_ids"]
        for start in range(len(ids) - len(marker), -1, -1):
            if ids[start:start + len(marker)] == marker and ids[max(0, start - len(closer)):start] == closer:
                return start + len(marker)
        return len(ids)

    def forward(self, input_ids: torch.Tensor, cache: Any = None, **kwargs: Any) -> Any:
        past = cache.get_seq_length() if cache is not None else 0
        new = input_ids[0].tolist()
        self._ids = self._ids[:past] + new
        if past == 0:  # a new request, or its cache rebuilt after a crop (ids past the same prompt)
            end = self._prompt_end(self._ids)
            if self._ids[:end] != self._prompt_ids or len(self._ids) == end:
                self._prompt_ids, self._prompt_len = self._ids[:end], end
                prompt = self.tokenizer.decode(self._prompt_ids)
                self.prompts.append(prompt)
                script = self.tokenizer(self.reply(prompt), add_special_tokens=False)["input_ids"]
                self._target = list(script) + [self.tokenizer.eos_token_id]
        out = self.inner(input_ids=input_ids, cache=cache, **kwargs)
        rows = out.logits.shape[1]
        logits = torch.full_like(out.logits, -1e4)
        for r in range(rows):
            produced = len(self._ids) - rows + r + 1 - self._prompt_len  # tokens of the reply before this row's token
            logits[0, r, self._target[min(max(produced, 0), len(self._target) - 1)]] = 0.0
        out.logits = logits
        return out


def react_script(prompt: str) -> str:
    """Call the tool first; once an observation is in the conversation, answer with it."""
    conversation = prompt.split("## Current Conversation")[-1]
    observations = re.findall(r"Observation: ([^\n<]+)", conversation)
    if observations:
        return f"Thought: I can answer without using any more tools.\nAnswer: 6 times 7 is {observations[-1].strip()}."
    return ('Thought: The user asks for a product. I need to use a tool to help me answer the question.\n'
            'Action: multiply\nAction Input: {"a": 6, "b": 7}')


@pytest.fixture(scope="module")
def scripted_member() -> Member:
    base = tiny_member("smollm2-135m-instruct", seed=1)
    return Member(ScriptedLM(base.model, base.tokenizer, react_script), base.tokenizer, name="scripted-react",
                  prefix_cache=0)  # ScriptedLM tells requests apart by an empty cache


@pytest.mark.parametrize("streaming", [True, False])
async def test_react_tool_call_parsed_and_executed_through_the_adapter(scripted_member: Member,
                                                                      streaming: bool) -> None:
    calls: list[tuple[float, float]] = []
    llm = EnsembleLLM(members=[scripted_member], method="single", max_new_tokens=64)
    agent = ReActAgent(tools=[make_multiply(calls)], llm=llm, streaming=streaming)
    response = await agent.run("What is 6 times 7?", max_iterations=4)
    assert calls == [(6, 7)]  # the well-formed Action was parsed and the tool ran once
    assert str(response).strip() == "6 times 7 is 42."  # the final Answer, "Answer:" removed by the agent
    prompts = scripted_member.model.prompts[-2:]
    assert "Observation: 42" in prompts[1] and "Observation: 42" not in prompts[0].split("## Current Conversation")[-1]


@pytest.mark.real
async def test_react_agent_loop_runs_on_the_real_ensemble() -> None:
    calls: list[tuple[float, float]] = []
    llm = EnsembleLLM(members=PAIR, method=METHOD, max_new_tokens=48)
    agent = ReActAgent(tools=[make_multiply(calls)], llm=llm)  # streaming: astream_chat drives the loop
    handler = agent.run("What is 6 times 7? Use the multiply tool.", max_iterations=3, early_stopping_method="generate")
    steps = [type(ev).__name__ async for ev in handler.stream_events()]
    response = await handler
    assert str(response).strip()  # a final response, right or wrong
    assert "AgentInput" in steps and "AgentStream" in steps and "AgentOutput" in steps
    assert ("ToolCallResult" in steps) == bool(calls)  # a parsed tool call ran the tool and was reported
