"""Host values onto the model's device without waiting for it.

Why. Every pass needs a few small inputs the host decides (token ids, positions, which
rows to keep, a mask). ``torch.tensor(values, device="cuda")`` and ``.to("cuda")`` copy
them *blocking*: torch synchronises the stream after the copy, so the host waits for every
kernel queued before it, and the next pass cannot be prepared while the GPU works (one
stall per call, several per output token). A copy from pageable memory with
``non_blocking=True`` is staged by the driver at once and ordered on the stream, with no
synchronisation (CUDA's documented behaviour for pageable host-to-device copies), and the
host tensor may be freed right away. On a CPU both are the same copy.

So the layouts a pass is built from (:class:`~ensemble_core.decoding.forward.Job`'s
positions and visibility) live on the host, the passes build their inputs there in a few
ops whatever the number of rows, and hand them over with :func:`to_device`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

#: Where layouts and other host-built pass inputs live.
HOST = torch.device("cpu")


def to_device(values: torch.Tensor | Sequence[Any], device: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``values`` (a host tensor or a nested list of numbers) on ``device``, copied without a stream synchronisation.

    A tensor already on ``device`` is returned as it is (cast to ``dtype`` if given); one on
    another accelerator moves the ordinary way (only a host source may skip the wait: a
    non-blocking copy *to* the host could be read before it lands).
    """
    if not isinstance(values, torch.Tensor):
        values = torch.tensor(values, dtype=dtype if dtype is not None else torch.long)
    elif dtype is not None and values.dtype != dtype:
        values = values.to(dtype)
    return values.to(device, non_blocking=values.device.type == "cpu")


def fill(buffer: torch.Tensor, values: torch.Tensor) -> None:
    """Copy host ``values`` into a device ``buffer`` (a captured pass's input) without a stream synchronisation."""
    buffer.copy_(values, non_blocking=values.device.type == "cpu")
