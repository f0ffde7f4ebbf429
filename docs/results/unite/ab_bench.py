"""``ensemble bench`` with every UniTE row twice, the default ``sub_tokens="once"`` and the published ``"shared"``, interleaved.

Why: ``once`` changes the published UniTE scoring (a member's token counts for one candidate only, not
for every longer string that starts with it; ``ensemble_core.options.sub_token_rule``), which every
method that fuses with UniTE uses: SAFE at its ensemble points and the every-token baseline. Before it
is a default its accuracy is compared with the published rule's on the same questions, back to back.
Arguments are ``ensemble bench``'s, e.g.

    python docs/results/unite/ab_bench.py --members smollm2-135m-instruct qwen2.5-coder-0.5b-instruct \\
        --dataset gsm8k --limit 50 --max-new-tokens 256 --methods safe every-token --safe-drafters 1 \\
        --threads 1 --no-microbench --no-progress --resume --no-plots --out docs/results/unite/gsm8k-50
"""

from __future__ import annotations

import sys
from pathlib import Path

from ensemble_core import cli
from ensemble_core.bench import runner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from variant_rows import with_variant  # noqa: E402

SUFFIX = "sub_tokens=shared"
_build_rows = runner.build_rows


def build_both(members, options):  # type: ignore[no-untyped-def]
    fused = [m for m in options.methods if m in ("safe", "every-token")]
    return with_variant(_build_rows, members, options, fused, {"*": {"sub_tokens": "shared"}}, SUFFIX)


if __name__ == "__main__":
    runner.build_rows = build_both
    sys.exit(cli.main(["bench", *sys.argv[1:]]))
