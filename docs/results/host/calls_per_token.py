"""Python function calls per output token over preset passes, alone and 16 concurrent (docs/gpu.md, "Bursts as
jobs of several steps", "Host work per token"): ``single`` one step per read and bursts of 16, and SAFE with the
published drafting (CUDA's defaults: drafts of ``lookahead`` tokens, no prompt lookup) on two SmolLM2 members
whose preset rows agree (every draft accepted: the verify pass and the points' scan, no fusion).

Why calls, not time: with the passes' logits preset (``host_per_token.preset_passes``: what a replayed graph
leaves the host) a CPU's time per token is dominated by the vocabulary-wide ops (an argmax over 49152 logits
takes ~80 us here; a kernel on a GPU), and this 2-core VM's noise is larger than what the Python around them
costs. The calls are what a GPU's host still runs per token, counted in every thread (``threading.setprofile``)
and independent of the machine. Prints one JSON line per configuration x level. Compare trees:

    PYTHONPATH=OLD python docs/results/host/calls_per_token.py before
    PYTHONPATH=NEW python docs/results/host/calls_per_token.py after
"""

from __future__ import annotations

import collections
import json
import sys
import threading
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
from host_per_token import preset_passes  # noqa: E402

from ensemble_core import Ensemble, Member  # noqa: E402
from ensemble_core.bench.datasets import cot_prompt, load_dataset  # noqa: E402


def main(label: str) -> None:
    torch.set_num_threads(2)
    member = Member.load("smollm2-135m-instruct", passes="static")
    verifier = Member.load("smollm2-135m-instruct", passes="static")  # a second model: its own slots and passes
    preset_passes(member)
    preset_passes(verifier)
    prompts = [cot_prompt(p.question) for p in load_dataset("gsm8k", 16)]
    configs: list[tuple[list[Member], dict[str, Any]]] = [
        ([member], {"method": "single", "steps_per_read": 1}),
        ([member], {"method": "single", "steps_per_read": 16}),
        ([member, verifier], {"method": "safe", "draft_confidence": 0.0, "prompt_lookup": 0}),
    ]
    for members, options in configs:
        for n in (1, 16):
            ensemble = Ensemble(members, max_new_tokens=64, **options)
            ensemble.batch(prompts[:2])  # warm-up
            counts: collections.Counter[str] = collections.Counter()

            def count(frame: Any, event: str, arg: Any, counts: collections.Counter[str] = counts) -> None:
                counts[event] += 1

            threading.setprofile(count)
            sys.setprofile(count)
            try:
                results = ensemble.batch(prompts[:n])
            finally:
                sys.setprofile(None)
                threading.setprofile(None)  # type: ignore[arg-type]
            tokens = sum(r.stats.tokens for r in results)
            print(json.dumps({"tree": label, "method": options["method"],
                              "steps_per_read": options.get("steps_per_read"), "requests": n,
                              "python_calls_per_token": round(counts["call"] / tokens, 1),
                              "c_calls_per_token": round(counts["c_call"] / tokens, 1)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "this tree")
