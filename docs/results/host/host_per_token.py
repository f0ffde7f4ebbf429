"""The host's work per output token when the passes cost nothing (docs/gpu.md, "Host work per token").

Why: a replayed CUDA graph hands the host its pass in microseconds, so what a GPU then waits on is the
host's Python and tensor ops per request and token. Measured here with every pass of the bundled SmolLM2's
static slots (``passes="static"``, 16 slots as on a GPU) replaced by a preset logits tensor of its shape:
what remains is the host's work around the pass (the method's step, the token pipeline, the scheduler, the
slot bookkeeping, the detokeniser). ``method="single"``, greedy, 64 tokens per request, alone and 4 and 16
concurrent through ``Ensemble.batch``. Prints one JSON line per level: ms per output token (best and
median of ``runs``), tokens, md5 of the texts (the preset row chooses the same token everywhere: equal
trees give equal texts). On a CPU the vocabulary-wide ops (argmax, the kept rows' float copy) are
real work that a GPU does in a kernel; the op count per token (tests/test_static_passes.py) is the
device-independent figure. ``safe`` as the second argument times SAFE instead, with the published drafting
(CUDA's defaults) on two SmolLM2 members whose preset rows agree (every draft accepted), alone and 16
concurrent, best of three. Compare code trees interleaved:

    for i in 1 2 3; do PYTHONPATH=OLD python docs/results/host/host_per_token.py before [safe]; \\
                       PYTHONPATH=NEW python docs/results/host/host_per_token.py after [safe]; done
"""

from __future__ import annotations

import hashlib
import json
import statistics
import sys
import time
from typing import Any

import torch

from ensemble_core import Ensemble, Member
from ensemble_core.bench.datasets import cot_prompt, load_dataset
from ensemble_core.decoding.static import row_sizes

LEVELS = (1, 4, 16)
TOKENS = 64


def preset_passes(member: Member) -> None:
    """Every static pass of ``member`` returns one fixed logits row (seeded noise) at every position."""
    static = member.static
    assert static is not None and static.usable, static and static.reasons
    static.max_slots, static.rows = 16, row_sizes(16)  # a GPU's pool
    row = torch.randn(member.vocab_size, generator=torch.Generator().manual_seed(0)).to(member.model.dtype)
    presets: dict[tuple[int, ...], torch.Tensor] = {}

    def forward(keys: Any, values: Any, span: int, inputs: torch.Tensor, r: int, k: int,
                rows: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> torch.Tensor:
        # every position the same row (whatever joins which pass, the texts are the same token repeated), laid
        # out as a pass's logits are (contiguous: an expanded view would make the gather of the kept rows copy)
        shape = (r, k) if keep is None else (len(keep),)
        if shape not in presets:
            presets[shape] = row.expand(*shape, -1).contiguous()
        return presets[shape]

    static._forward = forward  # type: ignore[method-assign]


def main(label: str, method: str = "single") -> None:
    torch.set_num_threads(2)
    member = Member.load("smollm2-135m-instruct", passes="static")
    preset_passes(member)
    prompts = [cot_prompt(p.question) for p in load_dataset("gsm8k", max(LEVELS))]
    if method == "safe":
        verifier = Member.load("smollm2-135m-instruct", passes="static")  # a second model: its own slots
        preset_passes(verifier)
        ensemble = Ensemble([member, verifier], method="safe", max_new_tokens=TOKENS, draft_confidence=0.0,
                            prompt_lookup=0)
        levels, runs = (1, 16), 3
    else:
        ensemble = Ensemble([member], method="single", max_new_tokens=TOKENS)
        levels, runs = LEVELS, 5
    ensemble.batch(prompts[:2])  # warm-up
    for n in levels:
        times, texts = [], ""
        for _ in range(runs):
            start = time.perf_counter()
            results = ensemble.batch(prompts[:n])
            wall = time.perf_counter() - start
            tokens = sum(r.stats.tokens for r in results)
            times.append(wall / tokens * 1e3)
            texts = "".join(r.text for r in results)
        print(json.dumps({"tree": label, "method": method, "requests": n, "best_ms_per_token": round(min(times), 3),
                          "median_ms_per_token": round(statistics.median(times), 3), "tokens": tokens,
                          "md5": hashlib.md5(texts.encode()).hexdigest()[:10]}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this tree", *sys.argv[2:3])
