"""Per-member cost of a step and of a k-token verify pass, float32 vs bfloat16, and where greedy outputs part.

Run on a quiet machine: ``python docs/results/trio/cpu-kernels/member_costs.py [threads] [rounds]``.
For each bundled member and dtype: decode a GSM8K prompt greedily to ~250 cached tokens,
then time ``DecodeState.score`` of k new tokens (k = 1 is a decode step; k > 1 is a SAFE
verify window), cropping back after each; the dtypes alternate in every round so drift
hits both. Then 96 greedy tokens in each dtype from the same prompt: the first position
where they differ. Prints a markdown table and writes ``member_costs.json`` next to it.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch

from ensemble_core import Member
from ensemble_core.models.loading import cpu_has_native_bf16

PROMPT = ("Janet's ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins "
          "for her friends every day with four. She sells the remainder at the farmers' market daily for $2 "
          "per fresh duck egg. How much in dollars does she make every day at the farmers' market? "
          "Let's think step by step.")
MEMBERS = ("smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct")
DTYPES = ("float32", "bfloat16")
WINDOWS = (1, 2, 4, 6, 8, 12)


def greedy(member: Member, n: int) -> tuple[object, list[int]]:
    state = member.start(PROMPT)
    rows, out = state.score(), []
    for _ in range(n):
        out.append(int(rows[-1].argmax()))
        rows = state.score([out[-1]])
    return state, out


def time_window(state: object, k: int) -> float:
    base = len(state.ids)
    t0 = time.perf_counter()
    state.score([100 + i for i in range(k)])
    took = time.perf_counter() - t0
    state.crop(base)
    state.score()  # the last id again: the state is as before
    return took * 1e3


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
    torch.set_num_threads(threads)
    out: dict = {"threads": threads, "rounds": rounds, "native_bf16": cpu_has_native_bf16(), "members": {}}
    for name in MEMBERS:
        members = {d: Member.load(name, dtype=d) for d in DTYPES}
        states = {d: greedy(members[d], 150)[0] for d in DTYPES}
        times: dict = {d: {k: [] for k in WINDOWS} for d in DTYPES}
        for r in range(rounds):
            for d in DTYPES if r % 2 == 0 else DTYPES[::-1]:
                for k in WINDOWS:
                    times[d][k].append(time_window(states[d], k))
        texts = {d: greedy(members[d], 96)[1] for d in DTYPES}
        differ = next((i for i, (a, b) in enumerate(zip(*texts.values())) if a != b), None)
        out["members"][name] = {"ms": {d: {k: statistics.median(v) for k, v in times[d].items()} for d in DTYPES},
                                "first_greedy_difference": differ}
        del members, states
    lines = ["| member | dtype | " + " | ".join(f"{k} tok" for k in WINDOWS) + " | 8 tok / step | greedy parts at |",
             "|---|---|" + "---:|" * (len(WINDOWS) + 1) + "---|"]
    for name, m in out["members"].items():
        for d in DTYPES:
            ms = m["ms"][d]
            lines.append(f"| {name} | {d} | " + " | ".join(f"{ms[k]:.0f}" for k in WINDOWS)
                         + f" | {ms[8] / ms[1]:.2f}x | {m['first_greedy_difference'] if d == 'bfloat16' else ''} |")
    print("\n".join(lines))
    Path(__file__).with_name("member_costs.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
