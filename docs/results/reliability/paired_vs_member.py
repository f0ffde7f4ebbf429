"""Every row of a bench run against one member alone, question by question, and the members' oracle.

Usage: ``python docs/results/reliability/paired_vs_member.py RESULTS.jsonl[.gz] [MEMBER_ROW]``
(default member row: ``single[qwen2.5-coder-0.5b-instruct]``). Prints each row's accuracy, its
difference from the member with the bench's paired-bootstrap 95 % interval
(``ensemble_core.bench.records.accuracy_difference``, as in the summary's "Ensembles against their
best member"), the questions it got right where the member did not (wins) and the reverse
(losses), and how many questions any member alone answered right (an upper bound for selecting
one member's answer).
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict

from ensemble_core.bench.records import accuracy_difference


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
        pairs = [(got[q], right[member][q]) for q in got if q in right[member]]  # the bench's order: same draws
        diff, lo, hi = accuracy_difference(pairs) or (0.0, 0.0, 0.0)
        wins, losses = sum(a > b for a, b in pairs), sum(a < b for a, b in pairs)
        print(f"{sum(a for a, _ in pairs):3d}/{len(pairs)}  {100 * diff:+5.1f} points "
              f"({100 * lo:+.0f} to {100 * hi:+.0f})  wins {wins}  losses {losses}  {row}")
    singles = [row for row in right if row.startswith("single[")]
    print("any member alone right:", sum(any(right[s][q] for s in singles) for q in questions))


if __name__ == "__main__":
    main(*sys.argv[1:])
