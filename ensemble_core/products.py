"""A member's float32 matrix products on a CPU: oneDNN's kernels instead of MKL's.

Why this exists. Every linear layer of a member (the body's projections and the output
head) computes ``x @ W.T`` for 1 row (a decode step), a few rows (SAFE's verify windows,
SpecEM's packed pass, a batched step: 2-64) or many (a prefill). PyTorch's CPU wheel sends
float32 ``linear`` to MKL, which on the AMD EPYC machines this project runs on computes
2-64 rows at a fraction of the CPU's peak: a Qwen2.5-0.5B body (24 layers of its seven
products, weights streaming from memory) took, in ms for 1 / 2 / 8 / 16 / 64 rows,

=====================  =======  =======  =======  =======  =======
kernel                 1 row    2        8        16       64
=====================  =======  =======  =======  =======  =======
MKL, 1 thread          83       169      205      251      686
oneDNN, 1 thread       62       84       127      125      306
MKL, 2 threads         108      235      118      153      355
oneDNN, 2 threads      58       70       61       84       143
=====================  =======  =======  =======  =======  =======

and the output heads the same way (Qwen's 151,936 x 896 at 8 rows: 77 ms MKL, 93 ms as
``weight @ x.T``, the rewrite this module replaces, 41 ms oneDNN, one thread;
``docs/results/trio/cpu-kernels/body_products.py`` and docs/benchmarks.md, "oneDNN products").
oneDNN is PyTorch's own CPU library (``torch.ops.mkldnn._linear_pointwise``, the op that
``torch.compile`` lowers CPU linears to); it takes the dense weight as it is, so nothing is
copied or re-laid out, and tied heads stay tied.

What it changes. Values equal ``linear``'s up to summation order (about 1e-6 here), so a
greedy choice between two nearly tied tokens can flip; the recorded golden outputs stayed
unchanged with it (every method, `tests/test_golden.py`). Applied to float32 on a CPU where the op exists and agrees with
``linear`` on a probe; other dtypes (bfloat16 already goes to oneDNN), accelerators and
quantized layers keep ``linear``.
"""

from __future__ import annotations

import functools
from typing import Any

import torch


@functools.cache
def onednn_available() -> bool:
    """Whether ``torch.ops.mkldnn._linear_pointwise`` exists here and matches ``linear`` on a probe."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    gen = torch.Generator().manual_seed(0)
    w, b, x = torch.randn(48, 32, generator=gen), torch.randn(48, generator=gen), torch.randn(3, 32, generator=gen)
    try:
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, torch.nn.functional.linear(x, w, b), atol=1e-4))


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, weight, bias)``, through oneDNN for float32 on a CPU (see the module docstring)."""
    if not (x.device.type == "cpu" and x.dtype == torch.float32 == weight.dtype and weight.is_contiguous()
            and x.shape[-1] and onednn_available()):
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.mkldnn._linear_pointwise(flat, weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


class CpuLinear(torch.nn.Linear):
    """A ``Linear`` whose forward is :func:`project` (same parameters, same hooks)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(x, self.weight, self.bias)


def use_cpu_products(model: Any) -> int:
    """Make every plain ``Linear`` of ``model`` a :class:`CpuLinear` in place; the number changed.

    Only the class changes: parameters (and a head tied to the input embeddings) stay as
    they are, nothing is copied. Subclasses and quantized layers are left alone.
    """
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = CpuLinear
            changed += 1
    return changed
