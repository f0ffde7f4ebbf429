"""Interleaved lookahead sweep: SAFE (SmolLM2 drafting) on the Qwen pair, ms per output token.

Usage: ``python run.py THREADS LOOKAHEADS QUESTIONS TOKENS``, e.g. ``python run.py 2 2,3,4,5,6,8 3 128``.
Every lookahead and Qwen alone run on each question; the order is reversed on every other
question. One JSON record per run is printed (``records.jsonl`` holds this session's).
"""

import json
import sys
import time
import warnings

import torch

from ensemble_core import Ensemble
from ensemble_core.bench.datasets import cot_prompt, load_dataset
from ensemble_core.ensemble import resolve_members


def main(threads: int, values: list[int], n: int, tokens: int) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    pair = resolve_members(["smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct"])
    ens = {k: Ensemble(pair, method="safe", lookahead=k, max_new_tokens=tokens) for k in values}
    single = Ensemble([pair[1]], method="single", max_new_tokens=tokens)
    single.generate("Warm up.", max_new_tokens=4)
    ens[values[0]].generate("Warm up.", max_new_tokens=4)
    rows: list[dict] = []
    for p in load_dataset("gsm8k", n, 0, None):
        prompt = cot_prompt(p.question)
        order = values + ["qwen"] if len(rows) % 2 == 0 else ["qwen"] + values[::-1]
        for k in order:
            e = single if k == "qwen" else ens[k]
            t = time.perf_counter()
            r = e.generate(prompt)
            dt = time.perf_counter() - t
            st = r.stats
            rows.append({"q": p.id, "lookahead": k, "seconds": dt, "chars": len(r.text),
                         "tokens": r.completion_tokens, "e_t": st.get("e_t"), "drafted": st.get("drafted"),
                         "accepted": st.get("accepted"), "rounds": st.get("rounds")})
            print(json.dumps(rows[-1]), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), [int(v) for v in sys.argv[2].split(",")], int(sys.argv[3]), int(sys.argv[4]))
