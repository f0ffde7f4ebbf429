"""Every row of a bench run against one member alone, question by question, and the members' oracle.

Usage: ``python docs/results/reliability/paired_vs_member.py RESULTS.jsonl[.gz] [MEMBER_ROW]``
(default member row: ``single[qwen2.5-coder-0.5b-instruct]``). Prints each row's accuracy, its
difference from the member with a paired-bootstrap 95 % interval (10,000 resamples of the
questions), the questions it alone got right (wins) and got wrong (losses), and how many
questions any member alone answered right (an upper bound for selecting one member's answer).
"""

from __future__ import annotations

import gzip
import json
import random
import sys
from collections import defaultdict


def paired_interval(diffs: list[int], resamples: int = 10_000, seed: int = 0) -> tuple[float, float]:
    rnd, n = random.Random(seed), len(diffs)
    means = sorted(sum(diffs[rnd.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    return means[int(0.025 * resamples)], means[int(0.975 * resamples)]


def main(path: str, member: str = "single[qwen2.5-coder-0.5b-instruct]") -> None:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        records = [json.loads(line) for line in f]
    right: dict[str, dict[str, bool]] = defaultdict(dict)
    for r in records:
        right[r["method"]][r["question_id"]] = bool(r["correct"])
    questions = sorted(set.intersection(*(set(v) for v in right.values())))
    print(f"{len(questions)} questions answered by every row; against {member}")
    for row, got in right.items():
        diffs = [got[q] - right[member][q] for q in questions]
        lo, hi = paired_interval(diffs)
        print(f"{sum(got[q] for q in questions):3d}/{len(questions)}  {100 * sum(diffs) / len(questions):+5.1f} points "
              f"({100 * lo:+.0f} to {100 * hi:+.0f})  wins {diffs.count(1)}  losses {diffs.count(-1)}  {row}")
    singles = [row for row in right if row.startswith("single[")]
    print("any member alone right:", sum(any(right[s][q] for s in singles) for q in questions))


if __name__ == "__main__":
    main(*sys.argv[1:])
