"""Busy and idle time of the bench's batched SAFE run: every ``Batcher._run_group`` timed.

Run on a quiet machine: ``python docs/results/throughput/trace_bench_safe.py [inline]``.
Runs ``measure_method("safe", ...)`` of ``ensemble bench --throughput`` at 8 concurrent
GSM8K requests, 64 tokens, 2 threads, with the one-by-one baseline in a worker process (the
CLI default) or in this process (``inline``), and prints the batch's wall time, the time its
passes were busy, how each flush started (whether every request had queued), and this
process's page faults and context switches during the batch (``/proc/self``).
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from dataclasses import replace
from typing import Any

import torch

from ensemble_core.bench import throughput as tp
from ensemble_core.bench.datasets import cot_prompt, load_dataset
from ensemble_core.decoding import scheduler as batching
from ensemble_core.ensemble import resolve_members
from ensemble_core.models.loading import MemberSpec
from ensemble_core.models.products import is_prepacked

CALLS: list[tuple[float, float]] = []
FLUSHES: list[tuple[bool, int]] = []
COUNTERS: dict[str, int] = {}


def _counters() -> dict[str, int]:
    """Minor/major page faults (``/proc/self/stat``) and context switches (``/proc/self/status``)."""
    fields = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
    out = {"minor_faults": int(fields[7]), "major_faults": int(fields[9])}
    for line in open("/proc/self/status"):
        if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
            key, value = line.split(":")
            out[key] = int(value)
    return out


def _instrument() -> None:
    run_group, ready = batching.Batcher._run_group, batching.Batcher._ready

    def timed(self: Any, member: Any, jobs: Any) -> None:
        t0 = time.perf_counter()
        run_group(self, member, jobs)
        CALLS.append((t0, time.perf_counter()))

    def counted(self: Any, max_wait: float) -> Any:
        taken = ready(self, max_wait)
        if taken:
            ps = list(self._participants.values())
            FLUSHES.append((all(p.waiting >= p.active for p in ps), len(ps)))
        return taken

    batching.Batcher._run_group, batching.Batcher._ready = timed, counted  # type: ignore[method-assign]
    batch = tp.Ensemble.batch

    def counted_batch(self: Any, *args: Any, **kwargs: Any) -> Any:
        before = _counters()
        try:
            return batch(self, *args, **kwargs)
        finally:
            COUNTERS.update({k: v - before[k] for k, v in _counters().items()})

    tp.Ensemble.batch = counted_batch  # type: ignore[method-assign]


def main() -> None:
    inline = "inline" in sys.argv[1:]
    torch.set_num_threads(2)
    _instrument()
    options = tp.ThroughputOptions(methods=("safe",), concurrency=(8,), sequential_requests=8, max_new_tokens=64,
                                   threads=2, out="/tmp/trace-bench-safe", baseline_process=not inline)
    specs = [MemberSpec("smollm2-135m-instruct"), MemberSpec("gemma3-270m")]
    members = resolve_members(specs)
    specs = [replace(s, prepack=is_prepacked(m.model)) for s, m in zip(specs, members)]  # as run_throughput does
    prompts = [cot_prompt(p.question) for p in load_dataset("gsm8k", 8)]
    level = tp.measure_method("safe", members, prompts, options, None, None if inline else specs)["levels"]["8"]
    busy = sum(end - start for start, end in CALLS)
    print(f"{'inline' if inline else 'process'} baseline: batch {level['seconds']} s, passes busy {busy:.1f} s, "
          f"idle {level['seconds'] - busy:.1f} s, {len(CALLS)} passes, speed-up {level['speedup']}x")
    print("flushes (everyone queued, requests):", Counter(FLUSHES).most_common(8))
    print("during the batch:", COUNTERS)


if __name__ == "__main__":
    main()
