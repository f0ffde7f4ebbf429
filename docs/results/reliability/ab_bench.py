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

import sys
from pathlib import Path

from ensemble_core import cli
from ensemble_core.bench import runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from variant_rows import with_variant  # noqa: E402

SUFFIX = "reliability=none"
_build_rows = runner.build_rows


def build_both(members, options):  # type: ignore[no-untyped-def]
    ensembles = [m for m in options.methods if m != "single"]
    return with_variant(_build_rows, members, options, ensembles, {"*": {"reliability": "none"}}, SUFFIX)


if __name__ == "__main__":
    runner.build_rows = build_both
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
