"""A member's matrix products for 1-64 rows: float32 through MKL (``linear``) vs oneDNN, and bf16.

The Qwen2.5-0.5B body (24 layers of its q, k, v, o, gate, up and down products, random
weights of the real shapes, every layer its own so that weights stream from memory as in
a real pass) and the three bundled output heads, each computed as float32 ``linear``
(MKL), float32 ``torch.ops.mkldnn._linear_pointwise`` on the dense weight (oneDNN, what
:mod:`ensemble_core.models.products` uses) and bfloat16 ``linear`` (oneDNN). ms per call, median
of 5. ``python docs/results/trio/cpu-kernels/body_products.py [threads]``; the figures in
docs/benchmarks.md ("oneDNN products") and in ``products.py`` come from it, on the 2-core
AMD EPYC with avx512_bf16 (2026-12-02).
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

import torch

LAYERS = 24
BODY = [(4864, 896), (4864, 896), (896, 4864), (896, 896), (128, 896), (128, 896), (896, 896)]
HEADS = {"qwen2.5 151936 x 896": (151936, 896), "gemma-3 262144 x 640": (262144, 640),
         "smollm2 49152 x 576": (49152, 576)}
ROWS = (1, 2, 4, 8, 16, 32, 64)


def median_ms(fn: Callable[[], None], reps: int = 5) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1e3


def mkl(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def onednn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")


def body(product: Callable, weights: list, xs: dict) -> None:
    for layer in weights:
        for w in layer:
            product(xs[w.shape[1]], w)


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    print("CPU capability:", torch.backends.cpu.get_cpu_capability(), "threads:", torch.get_num_threads())
    f32 = [[torch.randn(o, i) * 0.02 for o, i in BODY] for _ in range(LAYERS)]
    bf16 = [[w.bfloat16() for w in layer] for layer in f32]
    print("| Qwen body, rows | float32 MKL | float32 oneDNN | bf16 |\n|---:|---:|---:|---:|")
    for rows in ROWS:
        x32 = {n: torch.randn(rows, n) for n in (896, 4864)}
        x16 = {n: v.bfloat16() for n, v in x32.items()}
        runs = [(mkl, f32, x32), (onednn, f32, x32), (mkl, bf16, x16)]
        cells = [median_ms(functools.partial(body, fn, w, xs)) for fn, w, xs in runs]
        print(f"| {rows} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)
    print("\n| head, rows | float32 MKL | float32 oneDNN | bf16 |\n|---|---:|---:|---:|")
    for name, (vocab, hidden) in HEADS.items():
        w = torch.randn(vocab, hidden) * 0.02
        for rows in (1, 2, 8, 20, 64):
            x = torch.randn(rows, hidden)
            cells = [median_ms(functools.partial(mkl, x, w)), median_ms(functools.partial(onednn, x, w)),
                     median_ms(functools.partial(mkl, x.bfloat16(), w.bfloat16()))]
            print(f"| {name}, {rows} | " + " | ".join(f"{c:.1f}" for c in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
