"""How much of an agent run's model time is prompt prefill: the case for reusing a prompt's cache across requests.

An agent sends its whole conversation (system prompt, the tools' schemas, the turns so far) with every model
call, and each member prefills it from scratch: the next call's prompt repeats the last one's and adds a call
and its result. This runs tasks of the agent suite (``agent_suite.py``, default settings) and sums, per
member, the passes that started a request's cache (prefill) apart from those that continued it
(decoding, drafts, verification), with the prompt lengths, so the share a cache reused across requests
(vLLM's automatic prefix caching) could save is read off the run: each prompt's length is printed
with the longest start it shares with an earlier prompt of the same run and member.

    .venv/bin/python docs/results/agents/prefill_share.py [langgraph:single:8 langgraph:safe:8 ...]

Each argument is ``framework:config:task`` (``agent_suite.FRAMEWORKS``, ``CONFIGS``, task ids).
"""

from __future__ import annotations

import importlib.util
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent


def _suite() -> Any:
    spec = importlib.util.spec_from_file_location("agent_suite", HERE / "agent_suite.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["agent_suite"] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def shared_prefix(a: list[int], b: list[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main(argv: list[str]) -> None:
    from ensemble_core.decoding import members

    torch.set_num_threads(1)
    suite = _suite()
    totals: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0, 0.0])  # passes, tokens, seconds
    prompts: list[tuple[str, int, int]] = []  # member, prompt tokens, of those the longest prefix of an earlier prompt
    seen: dict[str, list[list[int]]] = defaultdict(list)
    run_pass, run_steps = members.DecodeState._run, members.DecodeState.score_steps

    def timed_run(state: Any, pending: list[int], keep: int, greedy: bool = False) -> torch.Tensor:
        t0 = time.perf_counter()
        prefill = state.cached == 0
        rows = run_pass(state, pending, keep, greedy)
        kind = "prefill" if prefill else "continue"
        entry = totals[(state.member.name, kind)]
        entry[0], entry[1], entry[2] = entry[0] + 1, entry[1] + len(pending), entry[2] + time.perf_counter() - t0
        if prefill:
            earlier = seen[state.member.name]
            prompts.append((state.member.name, len(pending), max((shared_prefix(pending, e) for e in earlier), default=0)))
            earlier.append(list(pending))
        return rows

    def timed_steps(state: Any, n: int, choose: Any = None) -> Any:
        t0 = time.perf_counter()
        out = run_steps(state, n, choose)
        entry = totals[(state.member.name, "continue")]
        entry[0], entry[1], entry[2] = entry[0] + n, entry[1] + n, entry[2] + time.perf_counter() - t0
        return out

    members.DecodeState._run, members.DecodeState.score_steps = timed_run, timed_steps
    tasks = {t.id: t for t in suite.TASKS}
    plan = [arg.split(":") for arg in argv] or [["langgraph", "single", "8"], ["langgraph", "safe", "8"]]
    for framework, config, task_id in plan:
        totals.clear()
        prompts.clear()
        seen.clear()
        t0 = time.perf_counter()
        task = tasks[int(task_id)]
        run = suite.FRAMEWORKS[framework](task, suite.CONFIGS[config], 80)
        print(f"[{framework} {config} #{task_id}] finished={run.judge(task)['finished']} "
              f"wall {time.perf_counter() - t0:.1f} s")
        print(f"  prompts (member, tokens, of those shared with an earlier prompt's start): {prompts}")
        for (member, kind), (passes, tokens, seconds) in sorted(totals.items()):
            print(f"  {member} {kind}: {passes} passes, {tokens} tokens, {seconds:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
