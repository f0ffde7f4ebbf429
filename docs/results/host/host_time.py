"""Host time outside the model's passes per output token of a batch (docs/gpu.md, "Host work per pass that grows
with nothing").

Why: with graph-captured passes the host's Python per request and token is what a GPU waits on; on a CPU it
is measured as the batch's wall time less the time inside the model's body and head (what a graph replays).
The bundled SmolLM2 (30 layers), ``method="single"``, 8 concurrent GSM8K prompts x 48 greedy tokens through
``Ensemble.batch`` (the eager batched path, the slab). Prints one JSON line: wall seconds, ms per token, host
ms per token outside the passes, tokens, md5 of the texts. Compare code trees by running it once per tree,
interleaved, several times:

    for i in 1 2 3; do PYTHONPATH=OLD python docs/results/host/host_time.py before; \
                       PYTHONPATH=NEW python docs/results/host/host_time.py after; done
"""

from __future__ import annotations

import hashlib
import json
import sys
import threading
import time
from typing import Any

import torch

from ensemble_core import Ensemble, Member
from ensemble_core.bench.datasets import cot_prompt, load_dataset


def main(label: str) -> None:
    torch.set_num_threads(2)
    member = Member.load("smollm2-135m-instruct")
    inside, lock, local = [0.0], threading.Lock(), threading.local()

    def timed(forward: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(local, "depth", 0)
            local.depth, start = depth + 1, time.perf_counter()
            try:
                return forward(*args, **kwargs)
            finally:
                local.depth = depth
                if depth == 0:
                    with lock:
                        inside[0] += time.perf_counter() - start
        return run

    for module in (member.model.model, member.model.lm_head):
        module.forward = timed(module.forward)
    prompts = [cot_prompt(p.question) for p in load_dataset("gsm8k", 8)]
    ensemble = Ensemble([member], method="single", max_new_tokens=48)
    ensemble.batch(prompts[:2])  # warm-up
    inside[0] = 0.0
    start = time.perf_counter()
    results = ensemble.batch(prompts)
    wall = time.perf_counter() - start
    tokens = sum(r.stats.tokens for r in results)
    print(json.dumps({"tree": label, "wall_s": round(wall, 3), "ms_per_token": round(wall / tokens * 1e3, 3),
                      "outside_ms_per_token": round((wall - inside[0]) / tokens * 1e3, 3), "tokens": tokens,
                      "md5": hashlib.md5("".join(r.text for r in results).encode()).hexdigest()[:10]}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this tree")
