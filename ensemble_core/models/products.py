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
``torch.compile`` lowers CPU linears to); it takes the dense weight as it is, so the
parameters stay as they are and tied heads stay tied.

What it changes. Values equal ``linear``'s up to summation order (about 1e-6 here), so a
greedy choice between two nearly tied tokens can flip; the recorded golden outputs stayed
unchanged with it (every method, `tests/test_golden.py`). Applied to float32 on a CPU where the op exists and agrees with
``linear`` on a probe; other dtypes (bfloat16 already goes to oneDNN), accelerators and
quantized layers keep ``linear``.

Prepacked weights. Given a dense weight, oneDNN re-lays it out into its blocked format
inside every product of two or more rows (a one-row product takes a matrix-vector path
that reads the dense weight as it is). So each :class:`CpuLinear` also keeps the weight
once in the blocked layout (:func:`prepack`, the op ``torch.compile``'s freezing uses) and
products of 2+ rows read that copy: **the same values bit for bit** as the dense call
(the same kernel, minus the re-layout), and on this project's 2-core AVX2 EPYC, two
threads, ms per product dense → prepacked (docs/benchmarks.md, "Prepacked weights and fused
projections"):

=========================  =============  =============  =============  =============
weight                     1 row          2 rows         8 rows         64 rows
=========================  =============  =============  =============  =============
Qwen MLP 4,864 x 896       0.68 (dense)   1.61 → 0.92    2.39 → 1.20    8.50 → 5.36
Qwen head 151,936 x 896    16.4 (dense)   35.1 → 24.4    45.8 → 32.4    199 → 185
SmolLM2 MLP 1,536 x 576    0.20 (dense)   0.42 → 0.22    0.54 → 0.34    1.20 → 1.40
=========================  =============  =============  =============  =============

One-row products keep the dense weight (their path is as fast and its values are what
they always were). The cost is memory: a second copy of every linear weight of a float32
CPU member (SmolLM2-135M +0.54 GB, Gemma-3-270m +1.07 GB, Qwen2.5-0.5B +1.98 GB; a tied
head is copied too). So by default (``MemberSpec(prepack=None)``) a model is prepacked only
when the copy takes at most :data:`PREPACK_MEMORY_SHARE` of the memory available when it
loads (:func:`should_prepack`): a member that barely fits is never pushed out of memory,
and since prepacking changes no value, outputs never depend on the decision, only speed
does. ``prepack=True`` / ``False`` (``--prepack on|off``) decide explicitly. A weight
changed in place after packing (fine-tuning) makes its layer fall back to the dense
product; nothing reads a stale copy.

Fused projections. A block's query/key/value projections (and its gate/up projections)
read the same input: :class:`FusedProjections` computes each such group as one product of
the stacked weights, so a narrow model pays oneDNN's per-call cost three times per block
instead of seven, with the same values (see there).
"""

from __future__ import annotations

import functools
import threading
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


@functools.cache
def prepack_available() -> bool:
    """Whether oneDNN can prepack a float32 weight here, its products equal to the dense ones on a probe."""
    if not onednn_available() or not hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        return False
    gen = torch.Generator().manual_seed(0)
    w, x = torch.randn(48, 32, generator=gen), torch.randn(3, 32, generator=gen)
    try:
        with torch.inference_mode():
            packed = torch.ops.mkldnn._reorder_linear_weight(w)
            got = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            dense = torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    except (RuntimeError, NotImplementedError):
        return False
    return bool(torch.allclose(got, dense, atol=1e-5))


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """``weight`` in oneDNN's blocked layout for products of 2+ rows; None where it does not apply.

    Float32 contiguous CPU weights only (other dtypes and devices keep ``linear``).
    """
    if not (weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2
            and weight.is_contiguous() and weight.numel() and prepack_available()):
        return None
    with torch.no_grad():  # a plain tensor (not an inference tensor): usable under no_grad and inference_mode
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


def project(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            packed: torch.Tensor | None = None) -> torch.Tensor:
    """``linear(x, weight, bias)``, through oneDNN for float32 on a CPU (see the module docstring).

    ``packed`` (:func:`prepack` of ``weight``) serves products of two or more rows.
    """
    if not (x.device.type == "cpu" and x.dtype == torch.float32 == weight.dtype and weight.is_contiguous()
            and x.shape[-1] and onednn_available()):
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    w = packed if packed is not None and flat.shape[0] > 1 else weight
    out = torch.ops.mkldnn._linear_pointwise(flat, w, bias, "none", [], "")
    return out.view(*x.shape[:-1], weight.shape[0])


class CpuLinear(torch.nn.Linear):
    """A ``Linear`` whose forward is :func:`project` (same parameters, same hooks), with its prepacked weight.

    A layer of a :class:`FusedProjections` group hands its product to the group.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        group = self.__dict__.get("_group")
        if group is not None:
            return group[0].output(group[1], x)
        return project(x, self.weight, self.bias, self.packed())

    def pack(self) -> bool:
        """Keep :func:`prepack` of the current weight (a plain attribute: not a parameter, not in the state dict)."""
        packed = prepack(self.weight)
        self.__dict__["_packed"] = None if packed is None else (packed, self.weight._version, self.weight.data_ptr())
        return packed is not None

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, ``torch.save``) leaves the packed copy and the stacking behind.

        oneDNN's packed tensors cannot be copied or pickled; the copy computes each layer's own
        dense product (the same values), and ``use_cpu_products`` on it packs and stacks again.
        """
        state = dict(self.__dict__)
        state.pop("_group", None)
        state["_packed"] = None
        return state

    def packed(self) -> torch.Tensor | None:
        """The prepacked weight, or None: never packed, or the weight has changed since (then dropped)."""
        entry = self.__dict__.get("_packed")
        if entry is None:
            return None
        packed, version, pointer = entry
        if self.weight._version != version or self.weight.data_ptr() != pointer:
            self.__dict__["_packed"] = None
            return None
        return packed


#: Sibling projections that read the same input in the blocks of Llama, Qwen2, Gemma, Mistral and kin.
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class FusedProjections:
    """Sibling layers that read the same input, computed as ONE product of their stacked weights.

    Why: a decode step of a narrow model is a long series of small products, each paying
    oneDNN's per-call cost; a block's query/key/value projections read the same hidden
    state, and so do its gate and up projections. Stacking them makes seven products per
    block three, with the same values bit for bit (each output is the same dot product;
    ``tests/test_products.py`` checks every bundled architecture). Measured on this
    project's 2-core AVX2 CPU, two threads, prepacked either way: a decode step of
    SmolLM2-135M 53 → 49 ms, Gemma-3-270m 79 → 73 ms, Qwen2.5-0.5B 118 → 111 ms, a 2-token
    pass of SmolLM2 61 → 51 ms (docs/benchmarks.md, "Prepacked weights and fused
    projections").

    How: each layer's weight (and bias) becomes a view of the stacked one, so nothing is
    stored twice. The first sibling (``q_proj``, ``gate_proj``) computes the stacked product
    of its input and keeps it (per thread); the others slice it when they are given that
    same tensor. A sibling given another tensor (an architecture whose siblings do not
    share their input) computes its own product, and the group stops stacking from then
    on; a weight replaced afterwards (``load_state_dict(assign=True)``, a move to another
    device) does the same. Every layer's output is always its own product.
    """

    def __init__(self, layers: list[CpuLinear]) -> None:
        self.layers = layers
        with torch.inference_mode(False), torch.no_grad():
            self.weight = torch.cat([layer.weight.detach() for layer in layers])
            has_bias = layers[0].bias is not None
            self.bias = torch.cat([layer.bias.detach() for layer in layers]) if has_bias else None
            self.bounds: list[tuple[int, int]] = []
            start = 0
            for layer in layers:
                end = start + layer.out_features
                layer.weight.data = self.weight[start:end]
                if self.bias is not None:
                    layer.bias.data = self.bias[start:end]
                self.bounds.append((start, end))
                start = end
        for index, layer in enumerate(layers):
            layer.__dict__["_group"] = (self, index)
            layer.__dict__["_packed"] = None  # the group's packed copy serves them
        self.packed: torch.Tensor | None = None
        self.stacking = True
        self._marks = self._fingerprint()
        self._last = threading.local()

    @classmethod
    def fits(cls, layers: list[Any]) -> bool:
        """Whether ``layers`` can be stacked: float32 CPU layers of one input size, all with or all without bias."""
        return (len(layers) > 1 and all(type(layer) is CpuLinear for layer in layers)
                and len({layer.in_features for layer in layers}) == 1
                and len({layer.bias is None for layer in layers}) == 1
                and all(layer.weight.device.type == "cpu" and layer.weight.dtype == torch.float32
                        and layer.weight.is_contiguous() for layer in layers))

    def _fingerprint(self) -> tuple[tuple[int, int], ...]:
        params = [p for layer in self.layers for p in (layer.weight, layer.bias) if p is not None]
        return tuple((p.data_ptr(), p._version) for p in params)

    def pack(self) -> bool:
        """Keep :func:`prepack` of the stacked weight (serves products of 2+ rows)."""
        self.packed = prepack(self.weight)
        self._marks = self._fingerprint()
        return self.packed is not None

    def _check(self) -> None:
        """Stop stacking if a weight was replaced; drop the packed copy if one changed in place."""
        marks = self._fingerprint()
        if marks == self._marks:
            return
        if [m[0] for m in marks] != [m[0] for m in self._marks]:
            self.stacking = False  # not views of the stacked weight any more
        self.packed = None
        self._marks = marks

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Layer ``index``'s product of ``x`` (a slice of the stacked product when it can be)."""
        layer = self.layers[index]
        if index == 0:
            self._check()  # once per product: the siblings slice what this call computes
        if not self.stacking:
            return project(x, layer.weight, layer.bias)
        if index == 0:
            product = project(x, self.weight, self.bias, self.packed)
            self._last.value = (x, product)
        else:
            last = getattr(self._last, "value", None)
            if last is None or last[0] is not x:
                self.stacking = False  # this model's siblings do not share their input
                self._last.value = None
                return project(x, layer.weight, layer.bias)
            product = last[1]
            if index == len(self.layers) - 1:
                self._last.value = None  # nothing held between passes
        start, end = self.bounds[index]
        return product[..., start:end]


def fuse_projections(model: Any) -> list[FusedProjections]:
    """Stack the :data:`SIBLINGS` of every block of ``model`` that fit (see :class:`FusedProjections`)."""
    groups = []
    for module in model.modules():
        for names in SIBLINGS:
            layers = [getattr(module, name, None) for name in names]
            if all(isinstance(layer, torch.nn.Module) for layer in layers) and FusedProjections.fits(layers):
                if not any("_group" in layer.__dict__ for layer in layers):
                    groups.append(FusedProjections(layers))  # type: ignore[arg-type]
    return groups


#: ``prepack=None`` prepacks a model when the copies take at most this share of the memory available at load.
PREPACK_MEMORY_SHARE = 0.25


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux's ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def packable_bytes(model: Any) -> int:
    """Bytes that prepacking ``model`` would add: its float32 CPU linear weights (a tied head counts: it is copied)."""
    return sum(m.weight.numel() * 4 for m in model.modules()
               if isinstance(m, torch.nn.Linear) and type(m) in (torch.nn.Linear, CpuLinear)
               and m.weight.dtype == torch.float32 and m.weight.device.type == "cpu")


def should_prepack(model: Any, available: int | None) -> bool:
    """The ``prepack=None`` decision: the copies fit in :data:`PREPACK_MEMORY_SHARE` of ``available`` (None: pack)."""
    return available is None or packable_bytes(model) <= PREPACK_MEMORY_SHARE * available


def is_prepacked(model: Any) -> bool:
    """Whether any product of ``model`` reads a prepacked copy (recorded by the benchmarks next to the dtype)."""
    return any((isinstance(g := m.__dict__.get("_group"), tuple) and g[0].packed is not None)
               or (type(m) is CpuLinear and m.packed() is not None) for m in model.modules())


def use_cpu_products(model: Any, prepacked: bool = True) -> int:
    """Make every plain ``Linear`` of ``model`` a :class:`CpuLinear` in place; the number changed.

    Only the classes change and sibling projections share one stacked weight
    (:func:`fuse_projections`); no value changes, a head tied to the input embeddings stays
    tied. Subclasses and quantized layers are left alone. ``prepacked``: each product also
    keeps its weight prepacked (float32 on a CPU; memory for speed, see the module
    docstring).
    """
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear:
            module.__class__ = CpuLinear
            changed += 1
    groups = fuse_projections(model)
    if prepacked:
        for group in groups:
            if group.packed is None:
                group.pack()
        for module in model.modules():
            if type(module) is CpuLinear and "_group" not in module.__dict__ and module.packed() is None:
                module.pack()
    return changed
