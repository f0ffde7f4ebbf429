"""Host reads per output token of every method on the bundled pair (docs/gpu.md, "What the CPU already holds").

Each read of a tensor value waits for the device on a GPU; the count is the code's, the same on any
device, so a CPU measures it. One greedy GSM8K-style reply per method, members in the calling
thread (``parallel=False``), no batcher. Prints one JSON line per method: reads per token, the
counts by kind, and an md5 of the text (the same text before and after a change is what makes two
counts comparable).

    python docs/results/reads/reads_per_token.py [method ...]
"""

from __future__ import annotations

import hashlib
import json
import sys

from ensemble_core import Ensemble, Member
from ensemble_core.bench.host_reads import HostReads

QUESTION = "A farmer has 12 cows and buys 7 more, then sells 5. How many cows does he have? Think step by step."
#: ``name -> (method, options)``; SAFE drafts with Qwen (the first member).
RUNS = {
    "single": ("single", {}),
    "safe (published drafting)": ("safe", {"drafter": 0, "published": True}),
    "safe (CPU levers)": ("safe", {"drafter": 0, "published": False}),
    "every-token": ("every-token", {}),
    "specem": ("specem", {"parallel": False}),
    "generate-then-select": ("generate-then-select", {"parallel": False}),
}


def main(names: list[str]) -> None:
    members = [Member.load("qwen2.5-coder-0.5b-instruct"), Member.load("smollm2-135m-instruct")]
    for name in names or list(RUNS):
        method, options = RUNS[name]
        ensemble = Ensemble(members[:1] if method == "single" else members, method=method, max_new_tokens=96,
                            batching=False, **options)
        ensemble.generate("Hello there", max_new_tokens=4)  # first-use work (token tables) is not per token
        with HostReads() as reads:
            result = ensemble.generate(QUESTION)
        tokens = result.stats.get("tokens", result.completion_tokens)
        print(json.dumps({"run": name, "tokens": tokens, "reads_per_token": round(reads.per_token(tokens), 2),
                          "counts": dict(reads.counts), "text_md5": hashlib.md5(result.text.encode()).hexdigest()[:10]}),
              flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
