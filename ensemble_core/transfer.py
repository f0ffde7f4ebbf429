"""Host values onto the model's device without waiting for it.

Why. Every pass needs a few small inputs the host decides (token ids, positions, which
rows to keep, a mask, a grammar's allowed tokens). ``torch.tensor(values, device="cuda")``
and ``.to("cuda")`` copy them *blocking*: torch synchronises the stream after the copy, so
the host waits for every kernel queued before it and cannot prepare the next pass while the
GPU works (one stall per call, several per output token). A copy from page-locked memory
with ``non_blocking=True`` is queued on the stream and returns at once; torch's caching host
allocator (``Tensor.pin_memory``) keeps the pinned source alive until the copy's stream
event has fired, so the host may drop its tensor right away (vLLM stages its inputs in
pinned buffers the same way). A copy from pageable memory may block on some drivers: the
values are staged in pinned memory first. On a CPU it is the ordinary copy.

So the layouts a pass is built from (:class:`~ensemble_core.decoding.forward.Job`'s
positions and visibility) live on the host, the passes build their inputs there in a few
ops whatever the number of rows, and hand them over with :func:`to_device` or :func:`fill`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: Where layouts and other host-built pass inputs live.
HOST = torch.device("cpu")


def _staged(values: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, bool]:
    """``values`` ready for a copy to ``device``, and whether that copy may skip the wait (a host
    source going to CUDA, staged in pinned memory; anything else copies the ordinary way: a
    non-blocking copy *to* the host could be read before it lands)."""
    if values.device.type != "cpu" or device.type != "cuda":
        return values, False
    return values.pin_memory(), True  # a copy unless already pinned (then do not change it before the copy runs)


def to_device(values: torch.Tensor | Sequence[Any], device: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a host tensor or a nested list of numbers; ``dtype`` defaults to int64 for lists) on
    ``device``, copied without a stream synchronisation. A tensor already there is returned as it is."""
    if not isinstance(values, torch.Tensor):
        values = torch.tensor(values, dtype=dtype if dtype is not None else torch.long)
    elif dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    device = torch.device(device)
    source, quiet = _staged(values, device)
    return source.to(device, non_blocking=quiet)


def fill(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """Copy host ``values`` into ``buffer`` (a captured pass's input, say) without a stream synchronisation."""
    source, quiet = _staged(values, buffer.device)
    buffer.copy_(source, non_blocking=quiet)


def read_together(tensors: Sequence[torch.Tensor]) -> list[list[Any]]:
    """Each tensor's values as a flat Python list, brought to the host in one read per device.

    Why (#38): every read of a device tensor waits for the kernels queued before it, so a
    method that needs several small results of one step (each member's top-k ids, the
    probabilities of a round's drafted tokens, the argmax of a verifier's window) reads them
    together instead of one by one. Tensors of one device are flattened into one buffer: of
    their common dtype, or float64 when dtypes mix (exact for token ids
    and for float32 values; float32 on Apple's MPS, which has no float64: exact for ids below
    2^24, which every vocabulary is). Integer tensors come back as ints, boolean ones as bools.
    """
    out: list[list[Any]] = [[] for _ in tensors]
    groups: dict[str, list[int]] = {}
    for i, tensor in enumerate(tensors):
        groups.setdefault(str(tensor.device), []).append(i)
    for members in groups.values():
        parts = [tensors[i].reshape(-1) for i in members]
        dtypes = {p.dtype for p in parts}
        if len(dtypes) > 1:
            wide = torch.float32 if parts[0].device.type == "mps" else torch.float64
            parts = [p.to(wide) for p in parts]
        values = torch.cat(parts).tolist() if len(parts) > 1 else parts[0].tolist()
        at = 0
        for i, part in zip(members, parts):
            chunk = values[at:at + part.numel()]
            at += part.numel()
            dtype = tensors[i].dtype
            out[i] = chunk if dtype.is_floating_point else [bool(v) for v in chunk] if dtype == torch.bool else [
                int(v) for v in chunk]
    return out
