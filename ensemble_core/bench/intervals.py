"""How sure a ratio of two rows is: a paired bootstrap over the questions.

Why: the issues' speed targets are ratios of two rows' totals over the same questions
("SAFE <= 1.0x Qwen alone per output character"), and a run has 20-50 questions whose
answers differ a lot in length and difficulty. Whether a ratio of 1.38x is a miss or
just the questions drawn is what a confidence interval says. The bootstrap is the usual
one for a ratio of sums (no normality assumed): draw the run's questions with
replacement, recompute *both* rows' aggregates on the same draw (paired: a hard question
is hard for every method), take the ratio; the 2.5th and 97.5th percentiles of many
draws bound the ratio. A fixed seed makes a summary reproducible from its records.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Any

from ensemble_core.bench.records import output_chars

Record = dict[str, Any]

#: Aggregates a ratio can be bootstrapped for: each recomputes a summary metric
#: (``records.summarize_rows``) from one draw of a row's per-question records.
AGGREGATES: dict[str, Callable[[Sequence[Record]], float | None]] = {
    "s_per_100_chars": lambda rs: _per_100_chars(rs),
    "mean_latency_s": lambda rs: _mean(rs, "latency_s"),
    "mean_ttft_s": lambda rs: _mean(rs, "ttft_s"),
    "mean_time_to_L_s": lambda rs: _mean(rs, "time_to_L_s"),
}


def _per_100_chars(records: Sequence[Record]) -> float | None:
    chars = sum(output_chars(r) for r in records)
    return 100 * sum(r["latency_s"] for r in records) / chars if chars else None


def _mean(records: Sequence[Record], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return sum(values) / len(values) if values else None


def paired(records: Sequence[Record], label_a: str, label_b: str) -> list[tuple[Record, Record]]:
    """The two rows' records of every question both answered without an error, in question order."""
    by_row: dict[str, dict[str, Record]] = {label_a: {}, label_b: {}}
    for r in records:
        if r.get("method") in by_row and "error" not in r:
            by_row[r["method"]][r["question_id"]] = r  # a later record of a question (--resume) replaces it
    a, b = by_row[label_a], by_row[label_b]
    return [(a[q], b[q]) for q in a if q in b]


def ratio_interval(
    pairs: Sequence[tuple[Record, Record]],
    metric: str,
    metric_b: str | None = None,
    *,
    level: float = 0.95,
    resamples: int = 2000,
    seed: int = 0,
) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of ``metric(A) / metric_b(B)`` over paired questions.

    None when the metric has no per-question form (see :data:`AGGREGATES`), when fewer than
    two questions pair up, or when no draw has a defined ratio.
    """
    agg_a, agg_b = AGGREGATES.get(metric), AGGREGATES.get(metric_b or metric)
    if agg_a is None or agg_b is None or len(pairs) < 2:
        return None
    if not 0.0 < level < 1.0 or resamples < 1:
        raise ValueError(f"level must be in (0, 1) and resamples >= 1, got {level} and {resamples}")
    rng = random.Random(seed)
    n = len(pairs)
    ratios = []
    for _ in range(resamples):
        draw = [pairs[rng.randrange(n)] for _ in range(n)]
        a, b = agg_a([p[0] for p in draw]), agg_b([p[1] for p in draw])
        if a is not None and b:
            ratios.append(a / b)
    if not ratios:
        return None
    ratios.sort()
    tail = (1.0 - level) / 2
    lo = ratios[int(tail * (len(ratios) - 1))]
    hi = ratios[int(round((1.0 - tail) * (len(ratios) - 1)))]
    return lo, hi


def describe(interval: tuple[float, float] | None, questions: int, level: float = 0.95) -> str:
    """``"95 % CI 1.30-1.47x over 50 questions"`` for a target's detail; empty without one."""
    if interval is None:
        return ""
    return f"{level:.0%} CI {interval[0]:.2f}-{interval[1]:.2f}x over {questions} questions".replace("%", " %", 1)
