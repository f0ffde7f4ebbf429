"""``ensemble bench`` with every ensemble row twice, the default reliability and ``reliability=none``, interleaved.

Why: the weighting's speed cost is a ratio of two settings of the same method, and ratios are only
fair when both run on the same questions back to back (the machine's load changes by the minute).
The bench runs one setting per method; this wrapper adds, for every ensemble row it builds, the same
row with ``reliability="none"`` (label suffix ``reliability=none``), then runs the ordinary
interleaved driver. Arguments are ``ensemble bench``'s, e.g.

    python docs/results/reliability/ab_bench.py --members smollm2-135m-instruct gemma3-270m \\
        qwen2.5-coder-0.5b-instruct --subsets 0,2 --dataset arith --limit 20 --max-new-tokens 48 \\
        --methods single safe every-token specem generate-then-select --safe-drafters 0 \\
        --threads 1 --no-microbench --no-progress --resume --out docs/results/reliability/arith-20-ab
"""

from __future__ import annotations

import dataclasses
import sys

from ensemble_core import cli
from ensemble_core.bench import runner

SUFFIX = "reliability=none"
_build_rows = runner.build_rows


def build_both(members, options):  # type: ignore[no-untyped-def]
    rows = _build_rows(members, options)
    config = {k: dict(v) for k, v in options.method_config.items()}
    config.setdefault("*", {})["reliability"] = "none"
    ensembles = tuple(m for m in options.methods if m != "single")
    if not ensembles:
        return rows
    published = _build_rows(members, dataclasses.replace(options, methods=ensembles, method_config=config))
    for row in published:
        row.label = row.label[:-1] + f"; {SUFFIX}]" if row.label.endswith("]") else f"{row.label}[{SUFFIX}]"
    return rows + published


if __name__ == "__main__":
    runner.build_rows = build_both
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
