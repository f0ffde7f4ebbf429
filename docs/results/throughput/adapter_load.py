"""LangChain's ``abatch`` on the real pair: c GSM8K questions at once vs ``invoke`` one after another.

Run on a quiet machine: ``python docs/results/throughput/adapter_load.py [method] [concurrent] [tokens]
[threads]`` (defaults: ``safe 8 64 2``). A RAG pipeline's or an evaluation's batch reaches the
ensemble as ``ChatEnsemble.abatch``: LangChain runs one ``ainvoke`` per input, each a
:class:`ensemble_core.serving.runtime.Run` in a worker thread, and their rows share the members' forward
passes. Sequence (the baseline brackets the batch, as in ``ensemble bench --throughput``): one
short warm-up call and the members' token tables, half of the questions through ``invoke`` one
at a time, all of them through ``abatch``, the other half one at a time. Prints completion
tokens/s both ways and their ratio, whether each batched answer equals its one-at-a-time
answer, how many rows the batch's passes held, and the CPU share the hypervisor took; writes the
same as JSON next to this script (``adapter_load-<method>-x<c>.json``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from langchain_ensemble import ChatEnsemble

from ensemble_core import Ensemble
from ensemble_core.bench.datasets import cot_prompt, load_dataset
from ensemble_core.bench.report import cpu_ticks, steal_share


def tokens_of(message: Any) -> int:
    return int(message.usage_metadata["output_tokens"])


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "safe"
    concurrent = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    torch.set_num_threads(int(sys.argv[4]) if len(sys.argv) > 4 else 2)
    questions = [[(m["role"], m["content"]) for m in cot_prompt(p.question)] for p in load_dataset("gsm8k", concurrent)]
    ensemble = Ensemble(["smollm2-135m-instruct", "gemma3-270m"], method=method)
    llm = ChatEnsemble(ensemble=ensemble, max_tokens=tokens, temperature=0, stop=["\nQuestion:"])
    llm.invoke("What is 2 + 3?", max_tokens=4)
    ensemble.warm_up()
    batcher = ensemble.method.batcher

    def one_at_a_time(batch: list[Any]) -> list[tuple[str, int, float]]:
        out = []
        for q in batch:
            t0 = time.perf_counter()
            reply = llm.invoke(q)
            out.append((reply.content, tokens_of(reply), time.perf_counter() - t0))
        return out

    half = (concurrent + 1) // 2
    ticks = [cpu_ticks()]
    alone = one_at_a_time(questions[:half])
    ticks.append(cpu_ticks())
    before = batcher.stats.as_dict()
    t0 = time.perf_counter()
    replies = asyncio.run(llm.abatch(questions))
    wall = time.perf_counter() - t0
    after = batcher.stats.as_dict()
    ticks.append(cpu_ticks())
    alone += one_at_a_time(questions[half:])
    ticks.append(cpu_ticks())
    alone_rate = sum(t for _, t, _ in alone) / sum(s for _, _, s in alone)
    batch_rate = sum(tokens_of(r) for r in replies) / wall
    calls, rows = after["model_calls"] - before["model_calls"], after["rows"] - before["rows"]
    out = {"method": method, "concurrent": concurrent, "max_tokens": tokens, "threads": torch.get_num_threads(),
           "tokens_per_s_abatch": round(batch_rate, 2), "tokens_per_s_invoke_one_at_a_time": round(alone_rate, 2),
           "speedup": round(batch_rate / alone_rate, 2), "abatch_seconds": round(wall, 2),
           "identical_texts": sum(r.content == a[0] for r, a in zip(replies, alone)),
           "abatch_passes": {"model_calls": calls, "rows": rows, "rows_per_call": round(rows / calls, 2) if calls else None},
           "cpu_steal": {"abatch": steal_share((ticks[1], ticks[2])),
                         "one_at_a_time": steal_share((ticks[0], ticks[1]), (ticks[2], ticks[3]))},
           "texts": [r.content for r in replies]}
    (Path(__file__).resolve().parent / f"adapter_load-{method}-x{concurrent}.json").write_text(
        json.dumps(out, indent=2, ensure_ascii=False))
    print(json.dumps({k: v for k, v in out.items() if k != "texts"}, indent=2))


if __name__ == "__main__":
    main()
