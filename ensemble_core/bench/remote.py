"""What Ray members cost: wall time per output token and bytes per round, local vs Ray, interleaved.

``python -m ensemble_core.bench.remote`` starts a small local Ray (or joins ``--address``),
places each member of :data:`PAIR` in its own actor and runs the same greedy requests with local
and with Ray members, alternating (local, Ray, Ray, local, ...) so that machine load hits
both alike. Every Ray output is checked to equal the local one. Then one more pass with
byte counting on (it pickles every answer, so it is not timed) reports calls and bytes
per round, and last the latency of a call that does no work and of one that returns
a whole logits row (``--methods ""`` measures only these). The local members run with as many torch threads as each actor
(``--threads``, 1 by default), so the comparison is one model on one core either way,
and a local Ray's workers run at normal priority (``RAY_worker_niceness=0``; Ray's
default of 15 would slow the actors whenever anything else runs on the machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

#: The members it places: the pair its figures in docs/scaling.md were measured with (two small members, so
#: that the Ray overhead, not the models, is what a round costs).
PAIR = ("smollm2-135m-instruct", "gemma3-270m")
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
    "def fibonacci(n):\n    # complete this Python function",
    "Name a famous painting by Leonardo da Vinci and say where it hangs.",
    "List three primary colors.",
]


@dataclass
class Timing:
    """Seconds, output tokens and rounds of one backend over all requests of one method."""

    seconds: list[float] = field(default_factory=list)
    rounds: list[int] = field(default_factory=list)
    tokens: int = 0

    def add(self, seconds: float, result: Any) -> None:
        self.seconds.append(seconds)
        self.rounds.append(max(int(result.stats.get("rounds", 0)), 1))
        self.tokens += result.completion_tokens

    @property
    def ms_per_token(self) -> float:
        return 1000 * sum(self.seconds) / max(self.tokens, 1)


def _run(ensemble: Any, prompt: Any, tokens: int) -> tuple[float, Any]:
    t0 = time.perf_counter()
    result = ensemble.generate(prompt, max_new_tokens=tokens)
    return time.perf_counter() - t0, result


def place_pair(address: str | None, threads: int) -> list[Any]:
    """:data:`PAIR`, each member in its own actor (``threads`` torch threads each)."""
    from ensemble_core.ensemble import Ensemble
    from ensemble_core.remote import RayMemberSpec, RayOptions

    options = RayOptions(address=address, torch_threads=threads)
    return Ensemble([RayMemberSpec(m) for m in PAIR], method="single", ray_options=options).members


def measure(
    methods: list[str], prompts: list[str], tokens: int, repeats: int, remote_members: list[Any], threads: int
) -> list[dict[str, Any]]:
    """One row per method: timings of both backends, the ratio, bytes and calls per round."""
    import torch

    from ensemble_core.ensemble import Ensemble

    torch.set_num_threads(threads)
    local_members = Ensemble(list(PAIR), method="single").members
    rows = []
    for method in methods:
        local, remote = Ensemble(local_members, method=method), Ensemble(remote_members, method=method)
        for e in (local, remote):  # warm-up: first passes, token tables, union vocabulary
            _run(e, "Hello!", 8)
        times = {"local": Timing(), "ray": Timing()}
        mismatches = 0
        for r in range(repeats):
            for i, prompt in enumerate(prompts):
                order = ["local", "ray"] if (r + i) % 2 == 0 else ["ray", "local"]
                texts = {}
                for name in order:
                    seconds, result = _run(local if name == "local" else remote, prompt, tokens)
                    times[name].add(seconds, result)
                    texts[name] = result.text
                mismatches += texts["local"] != texts["ray"]
        for m in remote_members:
            m.link.wire.reset()
            m.link.count_bytes = True
        rounds = 0
        for prompt in prompts:
            rounds += int(remote.generate(prompt, max_new_tokens=tokens).stats.get("rounds", 0))
        wire = {
            m.name: (m.link.wire.calls, m.link.wire.sent, m.link.wire.received, dict(m.link.wire.by_op)) for m in remote_members
        }
        for m in remote_members:
            m.link.count_bytes = False
        lo, ra = times["local"], times["ray"]
        per_round = [1000 * (b - a) / n for a, b, n in zip(lo.seconds, ra.seconds, lo.rounds)]
        rows.append(
            {
                "method": method,
                "requests": len(lo.seconds),
                "tokens": lo.tokens,
                "rounds": sum(lo.rounds),
                "local_ms_per_token": lo.ms_per_token,
                "ray_ms_per_token": ra.ms_per_token,
                "ratio": ra.ms_per_token / lo.ms_per_token,
                "median_request_ratio": statistics.median(b / a for a, b in zip(lo.seconds, ra.seconds)),
                "overhead_ms_per_round": statistics.median(per_round),
                "mismatches": mismatches,
                "calls_per_round": sum(c for c, _, _, _ in wire.values()) / max(rounds, 1),
                "kib_sent_per_round": sum(s for _, s, _, _ in wire.values()) / 1024 / max(rounds, 1),
                "kib_received_per_round": sum(r for _, _, r, _ in wire.values()) / 1024 / max(rounds, 1),
                "wire": wire,
                "byte_rounds": rounds,
            }
        )
    return rows


def round_trips(members: list[Any], n: int = 40) -> list[dict[str, Any]]:
    """Median milliseconds of a call that does no work, and of one that returns one whole logits row.

    The row is the state's cached last row (``score()`` with nothing pending runs no model),
    so both figures are Ray's own cost on this machine, without compute.
    """
    out = []
    for m in members:
        ray, handle = m.link.ray, m.link.handle
        empty = []
        for _ in range(n):
            t0 = time.perf_counter()
            ray.get(handle.held.remote())
            empty.append(1000 * (time.perf_counter() - t0))
        state = m.start_from_ids([1, 2, 3])
        state.next_row()
        rows = []
        for _ in range(n):
            t0 = time.perf_counter()
            state.next_row()
            rows.append(1000 * (time.perf_counter() - t0))
        state.close()
        out.append(
            {
                "member": m.name,
                "vocab": m.vocab_size,
                "noop_ms": statistics.median(empty),
                "row_ms": statistics.median(rows),
                "row_kib": 4 * m.vocab_size / 1024,
            }
        )
    return out


def table(rows: list[dict[str, Any]]) -> str:
    """A markdown table of :func:`measure`'s rows, then the bytes by operation."""
    out = [
        "| method | requests | local ms/token | Ray ms/token | ratio (all) | median ratio per request | "
        "overhead ms/round | calls/round | KiB sent/round | KiB received/round | outputs equal |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['method']} | {r['requests']} | {r['local_ms_per_token']:.1f} | {r['ray_ms_per_token']:.1f} | "
            f"{r['ratio']:.3f} | {r['median_request_ratio']:.3f} | {r['overhead_ms_per_round']:.1f} | "
            f"{r['calls_per_round']:.2f} | {r['kib_sent_per_round']:.2f} | {r['kib_received_per_round']:.1f} | "
            f"{r['requests'] - r['mismatches']}/{r['requests']} |"
        )
    out += ["", "| method | member | operation | calls | KiB sent | KiB received |", "|---|---|---|---|---|---|"]
    for r in rows:
        for member, (_, _, _, ops) in r["wire"].items():
            for op, (calls, sent, received) in sorted(ops.items()):
                out.append(f"| {r['method']} | {member} | {op} | {calls} | {sent / 1024:.1f} | {received / 1024:.1f} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="safe,specem")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--address", default=None, help="join this Ray cluster (default: start a local one)")
    args = parser.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_worker_niceness", "0")  # a local Ray's actors compete with the local members as equals
    remote = place_pair(args.address, args.threads)
    methods = [m for m in args.methods.split(",") if m]
    if methods:
        print(table(measure(methods, PROMPTS[: args.prompts], args.tokens, args.repeats, remote, args.threads)))
    print("\n| member | vocabulary | empty call, ms | call returning one float32 row, ms | row KiB |\n|---|---|---|---|---|")
    for r in round_trips(remote):
        print(f"| {r['member']} | {r['vocab']} | {r['noop_ms']:.2f} | {r['row_ms']:.2f} | {r['row_kib']:.0f} |")


if __name__ == "__main__":
    main()
