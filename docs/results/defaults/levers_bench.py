"""``ensemble bench`` with every SAFE row twice: the published drafting and the CPU levers, interleaved.

Why (#38, "fast by default"): whether ``prompt_lookup=4`` and ``draft_confidence=0.5`` may become
SAFE's CPU defaults is a ratio of two settings of the same row (speed) and a paired difference
(accuracy), and both are only fair when the two settings answer the same questions back to back.
The bench runs one setting per method; this wrapper adds, for every SAFE row it builds, the same
row with both levers on (label suffix ``levers``), then runs the ordinary interleaved driver.
Arguments are ``ensemble bench``'s, e.g.

    python docs/results/defaults/levers_bench.py --members smollm2-135m-instruct \\
        qwen2.5-coder-0.5b-instruct --dataset gsm8k --limit 15 --max-new-tokens 256 \\
        --methods single safe --threads 2 --no-microbench --no-progress \\
        --resume --out docs/results/defaults/gsm8k-15
"""

from __future__ import annotations

import dataclasses
import sys

from ensemble_core import cli
from ensemble_core.bench import runner

SUFFIX = "levers"
LEVERS = {"prompt_lookup": 4, "draft_confidence": 0.5}
_build_rows = runner.build_rows


def build_both(members, options):  # type: ignore[no-untyped-def]
    rows = _build_rows(members, options)
    if "safe" not in options.methods:
        return rows
    config = {k: dict(v) for k, v in options.method_config.items()}
    config["safe"] = {**config.get("safe", {}), **LEVERS}
    levers = _build_rows(members, dataclasses.replace(options, methods=("safe",), method_config=config))
    for row in levers:
        row.label = row.label[:-1] + f"; {SUFFIX}]" if row.label.endswith("]") else f"{row.label}[{SUFFIX}]"
    return rows + levers


if __name__ == "__main__":
    runner.build_rows = build_both
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
