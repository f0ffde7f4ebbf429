"""The server under load with the real pair: c concurrent GSM8K requests vs the same one at a time.

Run on a quiet machine: ``python docs/results/throughput/server_load.py [method] [concurrent] [tokens]
[threads] [whole]`` (defaults: ``safe 8 64 2``, streamed; ``whole``: not streamed). It starts
``python -m ensemble_core.server`` on 127.0.0.1 (a free port) with the bundled pair and ``method``,
talks to it with the real ``openai`` client (chat completions, greedy, ``stop="\\nQuestion:"``),
and stops that process by its handle at the end.

Sequence (every request bounded by a client timeout, the whole burst by ``asyncio.wait_for``):
one short warm-up request, half of the prompts one at a time, all ``concurrent`` prompts at
once, the other half one at a time (the baseline brackets the burst, as in ``ensemble bench
--throughput``, because this machine's speed drifts over minutes). Prints total completion
tokens/s both ways, their ratio, latency and time to first text (p50/p95) both ways, whether
each concurrent text equals its one-at-a-time text, how many rows the burst's passes held
(``/health``'s batching counters before and after it) and the server's request counters; writes
the same as JSON next to this script (``server_load-<method>-x<c>.json``).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import openai

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from server_utils import ServerProcess, percentile  # noqa: E402 - the suite's own server harness

from ensemble_core.bench.datasets import cot_prompt, load_dataset  # noqa: E402
from ensemble_core.bench.report import cpu_ticks, steal_share  # noqa: E402

TIMEOUT_S = 900.0  # one request's client timeout; the burst gets the same bound


async def one(client: openai.AsyncOpenAI, model: str, messages: list[dict[str, str]], tokens: int,
              stream: bool = True) -> dict[str, Any]:
    """One request (streamed or whole): text, completion tokens, seconds, seconds to the first text."""
    t0 = time.perf_counter()
    first, text, usage = None, "", None
    if not stream:
        reply = await client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                                     stop=["\nQuestion:"])
        return {"text": reply.choices[0].message.content, "tokens": reply.usage.completion_tokens,
                "seconds": time.perf_counter() - t0, "first": None}
    chunks = await client.chat.completions.create(model=model, messages=messages, max_tokens=tokens, temperature=0,
                                                  stop=["\nQuestion:"], stream=True,
                                                  stream_options={"include_usage": True})
    async for chunk in chunks:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first if first is not None else time.perf_counter() - t0
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return {"text": text, "tokens": usage, "seconds": time.perf_counter() - t0, "first": first}


async def measure(server: ServerProcess, prompts: list[list[dict[str, str]]], tokens: int, stream: bool) -> dict[str, Any]:
    async with openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0,
                                  timeout=TIMEOUT_S) as client:
        model = (await client.models.list()).data[0].id
        await one(client, model, [{"role": "user", "content": "What is 2 + 3?"}], 4)  # warm-up
        half = (len(prompts) + 1) // 2
        ticks = [cpu_ticks()]
        alone = [await one(client, model, p, tokens, stream) for p in prompts[:half]]
        ticks.append(cpu_ticks())
        before = server.health()["batching"]
        t0 = time.perf_counter()
        together = await asyncio.wait_for(asyncio.gather(*(one(client, model, p, tokens, stream) for p in prompts)),
                                          timeout=TIMEOUT_S)
        wall = time.perf_counter() - t0
        ticks.append(cpu_ticks())
        after = server.health()["batching"]
        alone += [await one(client, model, p, tokens, stream) for p in prompts[half:]]
        ticks.append(cpu_ticks())
    steal = {"concurrent": steal_share((ticks[1], ticks[2])),
             "one_at_a_time": steal_share((ticks[0], ticks[1]), (ticks[2], ticks[3]))}
    calls, rows = after["model_calls"] - before["model_calls"], after["rows"] - before["rows"]
    return {"model": model, "alone": alone, "together": list(together), "wall": wall, "cpu_steal": steal,
            "burst_passes": {"model_calls": calls, "rows": rows, "rows_per_call": round(rows / calls, 2) if calls else None}}


def summary(run: dict[str, Any]) -> dict[str, Any]:
    alone, together, wall = run["alone"], run["together"], run["wall"]
    alone_rate = sum(r["tokens"] for r in alone) / sum(r["seconds"] for r in alone)
    together_rate = sum(r["tokens"] for r in together) / wall

    def spread(rows: list[dict[str, Any]], key: str) -> list[float] | None:
        values = [r[key] for r in rows if r[key] is not None]  # no first text for whole answers
        return [round(percentile(values, 50), 2), round(percentile(values, 95), 2)] if values else None

    return {"tokens_per_s_concurrent": round(together_rate, 2), "tokens_per_s_one_at_a_time": round(alone_rate, 2),
            "speedup": round(together_rate / alone_rate, 2), "burst_seconds": round(wall, 2),
            "latency_p50_p95_concurrent": spread(together, "seconds"),
            "latency_p50_p95_one_at_a_time": spread(alone, "seconds"),
            "first_text_p50_p95_concurrent": spread(together, "first"),
            "first_text_p50_p95_one_at_a_time": spread(alone, "first"),
            "identical_texts": sum(a["text"] == b["text"] for a, b in zip(alone, together)),
            "requests": len(together), "cpu_steal": run["cpu_steal"], "burst_passes": run["burst_passes"]}


def main() -> None:
    method = sys.argv[1] if len(sys.argv) > 1 else "safe"
    concurrent = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    threads = int(sys.argv[4]) if len(sys.argv) > 4 else 2
    stream = "whole" not in sys.argv[5:]
    prompts = [cot_prompt(p.question) for p in load_dataset("gsm8k", concurrent)]
    here = Path(__file__).resolve().parent
    log = Path(tempfile.gettempdir()) / f"server_load-{method}.log"
    server = ServerProcess(["--method", method, "--no-access-log"], log, threads=threads)
    server.start(timeout=600)
    try:
        run = asyncio.run(measure(server, prompts, tokens, stream))
        health = server.health()
    finally:
        server.stop()
    out = {"method": method, "concurrent": concurrent, "max_tokens": tokens, "threads": threads, "stream": stream,
           "server_startup_s": round(server.startup_seconds, 1), **summary(run), "health": health, "runs": run}
    name = f"server_load-{method}-x{concurrent}{'' if stream else '-whole'}.json"
    (here / name).write_text(json.dumps(out, indent=2, ensure_ascii=False))
    print(json.dumps({k: v for k, v in out.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
