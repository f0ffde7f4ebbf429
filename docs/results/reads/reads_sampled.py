"""Host reads per output token of a sampled request on the bundled pair (seed 3, temperature 0.7, top_p 0.95).

Sampled drafts draw on the device and keep their ids there (#38, ``ensemble_core.decoding.sampling``); on a
CPU the draws are ``torch.multinomial``'s, so the text is the one the code before wrote (the md5 per run:
the same before and after). docs/gpu.md, "What the CPU already holds"; record: ``reads_sampled.jsonl``
(the "before" numbers in docs/gpu.md: this script on 791ebc7, without the ``steps_per_read`` run).

    python docs/results/reads/reads_sampled.py
"""

from __future__ import annotations

import hashlib
import json

from ensemble_core import Ensemble, Member
from ensemble_core.bench.host_reads import HostReads

QUESTION = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
            "How many clips did she sell altogether? Think step by step.")
#: ``(method, options, members)``: SAFE drafts with Qwen as published (a GPU's default drafting).
RUNS = [("single", {}, 1), ("single", {"steps_per_read": 16}, 1), ("safe", {"drafter": 0, "published": True}, 2),
        ("specem", {"parallel": False}, 2), ("generate-then-select", {"parallel": False}, 2)]
SAMPLING = {"do_sample": True, "temperature": 0.7, "top_p": 0.95, "seed": 3}


def main() -> None:
    members = [Member.load("qwen2.5-coder-0.5b-instruct"), Member.load("smollm2-135m-instruct")]
    for method, options, count in RUNS:
        ensemble = Ensemble(members[:count], method=method, max_new_tokens=96, batching=False, **SAMPLING, **options)
        ensemble.generate("Hello", max_new_tokens=4)  # first-use work is not per token
        with HostReads() as reads:
            result = ensemble.generate(QUESTION)
        tokens = result.stats.get("tokens", result.completion_tokens)
        print(json.dumps({"method": method, "options": options, "tokens": tokens,
                          "reads_per_token": round(reads.per_token(tokens), 2),
                          "md5": hashlib.md5(result.text.encode()).hexdigest()[:10]}), flush=True)


if __name__ == "__main__":
    main()
