"""Requests from a worker thread vs the main thread, after the members loaded (docs/configuration.md, "Threads").

Loads the default ensemble (SAFE, Qwen2.5-Coder-0.5B + SmolLM2-135M) in the main thread, then answers the
first GSM8K questions through LangChain's ``ainvoke`` (the generation runs in a worker thread:
``runtime.Run.astream``) and then ``invoke`` (the main thread), and prints one JSON line: seconds per
question each way and whether the texts agree. Run it against two trees side by side to compare them:

    PYTHONPATH=TREE:TREE/integrations python docs/results/threads/worker_thread.py LABEL [--questions 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from langchain_ensemble import ChatEnsemble

from ensemble_core import Ensemble
from ensemble_core.bench.datasets import load_dataset


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("label")
    parser.add_argument("--questions", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    chat = ChatEnsemble(ensemble=Ensemble(member_options={"prefix_cache": 0}), max_tokens=args.max_tokens)
    questions = [p.question for p in load_dataset("gsm8k", args.questions)]

    async def in_worker() -> list[tuple[float, str]]:
        out = []
        for q in questions:
            t0 = time.perf_counter()
            reply = await chat.ainvoke(q)
            out.append((time.perf_counter() - t0, str(reply.content)))
        return out

    worker = asyncio.run(in_worker())
    main_thread = []
    for q in questions:
        t0 = time.perf_counter()
        reply = chat.invoke(q)
        main_thread.append((time.perf_counter() - t0, str(reply.content)))
    print(json.dumps({"label": args.label, "worker_s": [round(s, 2) for s, _ in worker],
                      "main_s": [round(s, 2) for s, _ in main_thread],
                      "worker_total": round(sum(s for s, _ in worker), 2),
                      "main_total": round(sum(s for s, _ in main_thread), 2),
                      "same_texts": [a == b for (_, a), (_, b) in zip(worker, main_thread)]}), flush=True)


if __name__ == "__main__":
    main()
