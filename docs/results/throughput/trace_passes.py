"""Where a batched run's time goes: every ``batched_forward`` call of ``Ensemble.batch`` timed.

Run on a quiet machine: ``python docs/results/throughput/trace_passes.py [requests] [tokens] [threads] [gather]``
(``gather``: every pass gathers the rows' caches, as before :mod:`ensemble_core.decoding.slab`; runs
in both modes alternate with ``repeat`` as the fifth argument).
The bench's single-model case (SmolLM2 through the bundled pair's ``single`` method, GSM8K
prompts, zero-shot CoT): the wall time of the batch, split into its batched decode passes
(one token per row), its batched prefill passes and the rest (the request threads' work
between passes, one-row passes). Prints one line per part.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from ensemble_core import Ensemble, Member
from ensemble_core.bench.datasets import cot_prompt, load_dataset
from ensemble_core.decoding import scheduler as batching


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 64
    torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
    modes = ["slab", "gather"] if "repeat" in sys.argv[4:] else ["gather" if "gather" in sys.argv[4:] else "slab"]
    rounds = 3 if "repeat" in sys.argv[4:] else 1
    members = [Member.load("smollm2-135m-instruct"), Member.load("gemma3-270m")]
    ensemble = Ensemble(members, method="single", max_new_tokens=tokens, stop=("\nQuestion:",))
    prompts = [cot_prompt(p.question) for p in load_dataset("gsm8k", n)]
    ensemble.generate("Warm up.", max_new_tokens=4)
    for _ in range(rounds):
        for mode in modes:
            print(f"--- {mode}")
            trace(ensemble, prompts, n, use_slab=mode == "slab")


def trace(ensemble: Ensemble, prompts: list[str], n: int, use_slab: bool) -> None:
    calls: list[tuple[int, int, float]] = []  # rows, longest row, seconds
    plain = batching.batched_forward

    def timed(model, jobs, buffers=None, slab=None):  # noqa: ANN001, ANN202 - the wrapped function's own signature
        t0 = time.perf_counter()
        out = plain(model, jobs, buffers, slab if use_slab else None)
        calls.append((len(jobs), max(len(j.ids) for j in jobs), time.perf_counter() - t0))
        return out

    batching.batched_forward = timed
    try:
        t0 = time.perf_counter()
        results = ensemble.batch(prompts)
        wall = time.perf_counter() - t0
    finally:
        batching.batched_forward = plain
    decode = [c for c in calls if c[1] == 1]
    prefill = [c for c in calls if c[1] > 1]
    produced = sum(r.completion_tokens for r in results)
    print(f"{n} requests, {produced} tokens in {wall:.2f} s ({produced / wall:.1f} tok/s)")
    print(f"decode passes: {len(decode)}, {sum(c[2] for c in decode):.2f} s, median "
          f"{statistics.median(c[2] for c in decode) * 1e3:.0f} ms, {statistics.mean(c[0] for c in decode):.1f} rows")
    print(f"prefill passes: {len(prefill)}, {sum(c[2] for c in prefill):.2f} s "
          + str([(rows, longest, round(s, 2)) for rows, longest, s in prefill]))
    print(f"the rest: {wall - sum(c[2] for c in calls):.2f} s")


if __name__ == "__main__":
    main()
