"""The vocabulary projection of a few rows on a CPU: ``W @ x.T`` instead of ``x @ W.T``.

Why this exists. The output head is the largest matrix of a small model (Gemma-3-270m:
262,144 x 640, 670 MB in float32; Qwen2.5-0.5B: 151,936 x 896) and the ensemble asks it
for a few rows at a time all the time: SAFE's verify windows (n + 1 positions), SpecEM's
packed verify-in-line pass (~20), a batched decode step (one row per request). On this
machine's MKL (torch 2.13 CPU wheel, AVX2), ``torch.nn.functional.linear`` with 2-64 rows
takes 2-3x as long as with one row, while the same product written as ``weight @ x.T``
stays near the one-row cost, since it reads the weight once, as a matrix-vector product
would (measured, 2 threads, ms per call for 1 / 2 / 8 / 20 rows; ``linear`` vs this):

=====================  ===========  ===========  ===========  ===========
head                   1 row        2 rows       8 rows       20 rows
=====================  ===========  ===========  ===========  ===========
Gemma-3 262k x 640     77 / 86      194 / 56     254 / 102    310 / 196
Qwen2.5 152k x 896     70 / 67      151 / 48     228 / 76     254 / 154
SmolLM2 49k x 576      19 / 19      39 / 10      43 / 18      58 / 32
=====================  ===========  ===========  ===========  ===========

From ~128 rows on (a prefill asking for every position) the two are even or ``linear``
wins, so the rewrite applies to 2..:data:`FEW_ROWS` rows of float32 on a CPU only; one
row, other dtypes and accelerators keep ``linear``. The body's linear layers were
measured too and are not rewritten: there the faster form depends on the shape and the
thread count (Qwen's MLP: up-projection 1.7x faster, down-projection 2.3x slower at 5
rows on one thread). The result equals ``linear`` up to floating-point summation order.
"""

from __future__ import annotations

from typing import Any

import torch

#: Most rows computed as ``weight @ x.T``; from ~128 rows on ``linear`` is as fast or faster.
FEW_ROWS = 64


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, weight, bias)``, computed as ``weight @ x.T`` for a few float32 rows on a CPU."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not (2 <= rows <= FEW_ROWS and x.device.type == "cpu" and x.dtype == torch.float32 == weight.dtype):
        return torch.nn.functional.linear(x, weight, bias)
    out = torch.mm(weight, x.reshape(rows, x.shape[-1]).t()).t().contiguous()  # callers may .view() logits
    if bias is not None:
        out += bias
    return out.view(*x.shape[:-1], weight.shape[0])


class FewRowHead(torch.nn.Linear):
    """An output head whose forward is :func:`project` (same parameters, same hooks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)


def use_few_row_head(model: Any) -> bool:
    """Make ``model``'s output head a :class:`FewRowHead` in place; False when it is not a plain ``Linear``.

    The module keeps its parameters (a head tied to the input embeddings stays tied): only
    its class changes, so nothing is copied and nothing is allocated.
    """
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if type(head) is FewRowHead:
        return True
    if type(head) is not torch.nn.Linear:
        return False
    head.__class__ = FewRowHead
    return True
