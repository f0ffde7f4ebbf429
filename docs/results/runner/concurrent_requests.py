"""Concurrent requests on a CPU, with and without the model runner (docs/configuration.md, "Threads on a CPU").

For one configuration (``single``: SmolLM2-135M alone; ``safe``: the default pair; ``specem``: the default
pair under SpecEM), answers the first GSM8K questions three ways in one process, after a warm-up:
``Ensemble.batch`` (worker threads), LangChain's sync ``batch`` (LangChain's own threads, ``Run.run`` in each),
``asyncio.gather`` of LangChain ``ainvoke`` calls (one generation thread each: ``runtime.Run.astream``) and
``ainvoke`` one question after another (a lone request in a worker thread),
and prints one JSON line: seconds each way and a digest of the texts (the same texts on every tree).
Run it against two trees, interleaved, to compare them:

    PYTHONPATH=TREE:TREE/integrations python docs/results/runner/concurrent_requests.py LABEL CONFIG
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import time

from langchain_ensemble import ChatEnsemble

from ensemble_core import Ensemble
from ensemble_core.bench.datasets import load_dataset

CONFIGS = {
    "single": {"members": ["smollm2-135m-instruct"], "method": "single"},
    "safe": {},
    "specem": {"method": "specem"},
}


def digest(texts: list[str]) -> str:
    return hashlib.sha1("\x00".join(texts).encode()).hexdigest()[:10]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("label")
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("--questions", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    ens = Ensemble(**CONFIGS[args.config], member_options={"prefix_cache": 0}, max_new_tokens=args.max_tokens)
    chat = ChatEnsemble(ensemble=ens, max_tokens=args.max_tokens)
    questions = [p.question for p in load_dataset("gsm8k", args.questions)]
    ens.generate("Warm up: what is 1 + 1?", max_new_tokens=4)

    t0 = time.perf_counter()
    batch = [r.text for r in ens.batch(questions)]
    batch_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    lc_batch = [str(m.content) for m in chat.batch(questions)]
    lc_batch_s = time.perf_counter() - t0

    async def together() -> list[str]:
        return [str(m.content) for m in await asyncio.gather(*(chat.ainvoke(q) for q in questions))]

    async def one_by_one() -> list[str]:
        return [str((await chat.ainvoke(q)).content) for q in questions]

    t0 = time.perf_counter()
    gathered = asyncio.run(together())
    gather_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    alone = asyncio.run(one_by_one())
    alone_s = time.perf_counter() - t0
    print(json.dumps({"label": args.label, "config": args.config, "batch_s": round(batch_s, 2),
                      "lc_batch_s": round(lc_batch_s, 2), "gather_s": round(gather_s, 2),
                      "alone_s": round(alone_s, 2), "batch": digest(batch), "lc_batch": digest(lc_batch),
                      "gather": digest(gathered), "alone": digest(alone)}), flush=True)


if __name__ == "__main__":
    main()
