"""Why one model runner: a decode step beside other threads' idle OpenMP teams (docs/configuration.md, "Threads").

Builds a SmolLM2-135M-shaped model with random weights (speed only), then times 4-row decode steps
(one token per row on a 128-token cache) in a worker thread, interleaved: with no other thread's team,
and after ``--teams`` other threads each ran one parallel region and then wait (idle, as the threads of
concurrent requests wait between passes). Prints one JSON line: ms per step each way, per round.

    OMP_NUM_THREADS=2 python docs/results/runner/idle_teams.py [--teams 3] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM


def model() -> LlamaForCausalLM:
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@torch.inference_mode()
def steps(m: LlamaForCausalLM, n: int) -> float:
    """Median ms of ``n`` 4-row one-token steps after a 128-token prefill."""
    cache = DynamicCache()
    m(input_ids=torch.randint(200, 5000, (4, 128)), past_key_values=cache, use_cache=True, logits_to_keep=1)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        m(input_ids=torch.randint(200, 5000, (4, 1)), past_key_values=cache, use_cache=True, logits_to_keep=1)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def in_worker(fn):
    box = {}
    t = threading.Thread(target=lambda: box.setdefault("v", fn()))
    t.start()
    t.join()
    return box["v"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--teams", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    m = in_worker(model)
    in_worker(lambda: steps(m, 2))  # warm up
    alone, beside = [], []
    for r in range(args.rounds):
        order = ["alone", "beside"] if r % 2 == 0 else ["beside", "alone"]
        for how in order:
            if how == "alone":
                alone.append(round(in_worker(lambda: steps(m, args.steps)), 1))
                continue
            ready, leave = threading.Barrier(args.teams + 1), threading.Event()

            def idle(ready: threading.Barrier, leave: threading.Event) -> None:
                torch.randn(2_000_000).exp_()  # one parallel region: this thread now keeps a team
                ready.wait()
                leave.wait()

            others = [threading.Thread(target=idle, args=(ready, leave)) for _ in range(args.teams)]
            for t in others:
                t.start()
            ready.wait()
            beside.append(round(in_worker(lambda: steps(m, args.steps)), 1))
            leave.set()
            for t in others:
                t.join()
    print(json.dumps({"threads": torch.get_num_threads(), "teams_beside": args.teams,
                      "alone_ms": alone, "beside_ms": beside}), flush=True)


if __name__ == "__main__":
    main()
