"""Generate-then-select with other judges' weights, replayed on a recorded run (no model time).

Generate-then-select's answers are each member's greedy answer and its cross-scores do not depend
on the judges' weights; only the choice does (``argmax_c sum_v w_v s_vc``). A recorded run keeps
every question's score matrix (``stats.scores``) and the members' single answers (the ``single``
rows), so the choice under any weights can be recomputed. The chosen answer counts as right when
the recorded row chose the same member and was right, else when that member's single answer was
right (the row cuts an answer to the first member's token budget, which can differ a little).

    python docs/results/reliability/gts_replay.py docs/results/trio/gsm8k-specem-gts/results.jsonl.gz
"""

from __future__ import annotations

import collections
import gzip
import json
import sys

from ensemble_core.bench.records import accuracy_difference

#: Body sizes (``methods.reliability.body_parameters``) and chat templates of the bundled members.
SIZE = {"smollm2-135m-instruct": 106_168_320, "gemma3-270m": 100_270_080, "qwen2.5-coder-0.5b-instruct": 357_826_560}
TEMPLATE = {"smollm2-135m-instruct": True, "gemma3-270m": False, "qwen2.5-coder-0.5b-instruct": True}
STRONG = "qwen2.5-coder-0.5b-instruct"

RULES = {
    "none (uniform, published)": lambda m: 1.0,
    "template only (no template: 0.25)": lambda m: 1.0 if TEMPLATE[m] else 0.25,
    "size only": lambda m: SIZE[m],
    "sqrt(size) x template": lambda m: SIZE[m] ** 0.5 * (1.0 if TEMPLATE[m] else 0.25),
    "prior: size x template (default)": lambda m: SIZE[m] * (1.0 if TEMPLATE[m] else 0.25),
    "calibrated: only Qwen judges": lambda m: 1.0 if m == STRONG else 0.0,
    "prior, degenerate answers lose": lambda m: SIZE[m] * (1.0 if TEMPLATE[m] else 0.25),
}


def degenerate(answer: dict, text: str) -> bool:
    """Cut by the token budget, or more than a third of its lines repeat an earlier line."""
    lines = [line.strip() for line in text.split("\n") if line.strip()]
    repeated = 1 - len(set(lines)) / len(lines) if lines else 1.0
    return answer["end"] is None or repeated > 1 / 3


def main(path: str) -> None:
    records = [json.loads(line) for line in gzip.open(path, "rt")]
    by_q: dict[str, dict[str, dict]] = collections.defaultdict(dict)
    for r in records:
        if "error" not in r:
            by_q[r["question_id"]][r["method"]] = r
    labels = sorted({r["method"] for r in records if r["method"].startswith("generate-then-select")})
    print(f"{len(by_q)} questions; Qwen alone {sum(d[f'single[{STRONG}]']['correct'] for d in by_q.values())}")
    print("| row | judges' weights | replayed accuracy | vs Qwen alone (95 % CI) |\n|---|---|---|---|")
    for label in labels:
        for rule, weigh in RULES.items():
            pairs, right = [], 0
            for d in by_q.values():
                rec = d[label]
                s = rec["stats"]
                members = [a["member"] for a in s["answers"]]
                judges = [members[v] for v in range(len(s["scores"]))]
                w = [weigh(m) for m in judges]
                totals = [sum(w[v] * s["scores"][v][c] for v in range(len(w))) for c in range(len(members))]
                if "degenerate" in rule:
                    bad = [degenerate(a, d[f"single[{a['member']}]"]["output"]) for a in s["answers"]]
                    if not all(bad):
                        totals = [0.0 if b else t for b, t in zip(bad, totals)]
                best = max(range(len(members)), key=lambda c: (totals[c], -c))
                ok = rec["correct"] if best == s["chosen"] else d[f"single[{members[best]}]"]["correct"]
                right += ok
                pairs.append((ok, d[f"single[{STRONG}]"]["correct"]))
            diff, lo, hi = accuracy_difference(pairs)
            print(f"| {label} | {rule} | {right}/{len(pairs)} | {100 * diff:+.0f} ({100 * lo:+.0f} to {100 * hi:+.0f}) |")


if __name__ == "__main__":
    main(sys.argv[1])
