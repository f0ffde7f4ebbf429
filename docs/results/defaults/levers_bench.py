"""``ensemble bench`` with every SAFE row twice: the published drafting and the CPU levers, interleaved.

Why (#38, "fast by default"): whether ``prompt_lookup=4`` and ``draft_confidence=0.5`` may become
SAFE's CPU defaults is a ratio of two settings of the same row (speed) and a paired difference
(accuracy), and both are only fair when the two settings answer the same questions back to back.
The bench runs one setting per method; this wrapper adds, for every SAFE row it builds, the same
row with both levers on (label suffix ``levers``), then runs the ordinary interleaved driver.
The levers are SAFE's CPU defaults since this run: the ``--set`` below keeps the base rows at the
published drafting. Arguments are ``ensemble bench``'s, e.g.

    python docs/results/defaults/levers_bench.py --members smollm2-135m-instruct \\
        qwen2.5-coder-0.5b-instruct --dataset gsm8k --limit 15 --max-new-tokens 256 \\
        --methods single safe --set safe.prompt_lookup=0 --set safe.draft_confidence=0 --threads 2 \\
        --no-microbench --no-progress --resume --out docs/results/defaults/gsm8k-15
"""

from __future__ import annotations

import sys
from pathlib import Path

from ensemble_core import cli
from ensemble_core.bench import runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from variant_rows import with_variant  # noqa: E402

SUFFIX = "levers"
LEVERS = {"prompt_lookup": 4, "draft_confidence": 0.5}
_build_rows = runner.build_rows


def build_both(members, options):  # type: ignore[no-untyped-def]
    return with_variant(_build_rows, members, options, ["safe"], {"safe": LEVERS}, SUFFIX)


if __name__ == "__main__":
    runner.build_rows = build_both
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
