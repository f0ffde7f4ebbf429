"""Host reads per output token: how often a method brings a tensor value back to Python.

Why (#38): on a GPU every such read (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``) waits
for the queued kernels to finish, so a method that reads per token cannot run ahead of the
device; graph-captured steps help only where decisions are read once per round. The count is the
same on any device (it is the code's, not the hardware's), so the CPU measures it and a test
can hold it, where timings could not; a lent GPU counts the synchronisations themselves with
``torch.cuda.set_sync_debug_mode`` (:func:`cuda_syncs`, ``tests/gpu_check.py``).

:class:`HostReads` counts, while active, every ``aten._local_scalar_dense`` (what ``.item()``,
``bool``, ``int`` and ``float`` of a tensor dispatch to), every ``Tensor.tolist`` call and every
``Tensor.cpu`` call (a copy to the host, which waits like a read; on the CPU ``tolist`` reads
memory directly and ``cpu`` returns the tensor itself, without a dispatched op, so both are
counted at the Python method). Reads of tensors that live on the CPU in a GPU run (token tables,
ids, a fused candidate set) are counted too: the count is an upper bound of the synchronisations.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default


class _ScalarReads(TorchDispatchMode):
    """Counts the dispatched scalar reads (every other op passes through unchanged)."""

    def __init__(self, counter: Counter[str]) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _SCALAR_READ:
            self.counter["item"] += 1
        return func(*args, **(kwargs or {}))


@dataclass
class HostReads:
    """Counts host reads while used as a context manager (``with HostReads() as reads: ...``).

    ``counts["item"]``: scalar reads; ``counts["tolist"]``: ``tolist`` calls; ``counts["cpu"]``: copies
    to the host. Not thread-safe
    across threads that run tensor code (a dispatch mode is per thread): use it on a method
    that runs its members in the calling thread (``parallel=False`` where a method has it).
    """

    counts: Counter[str] = field(default_factory=Counter)
    _mode: _ScalarReads | None = None
    _tolist: Callable[..., Any] | None = None
    _cpu: Callable[..., Any] | None = None

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def per_token(self, tokens: int) -> float:
        """Reads per output token (``tokens`` >= 1)."""
        return self.total / max(1, tokens)

    def __enter__(self) -> HostReads:
        counts, original, original_cpu = self.counts, torch.Tensor.tolist, torch.Tensor.cpu

        def tolist(tensor: torch.Tensor) -> Any:
            counts["tolist"] += 1
            return original(tensor)

        def cpu(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            counts["cpu"] += 1
            return original_cpu(tensor, *args, **kwargs)

        self._tolist, self._cpu = original, original_cpu
        torch.Tensor.tolist = tolist  # type: ignore[method-assign]
        torch.Tensor.cpu = cpu  # type: ignore[method-assign]
        self._mode = _ScalarReads(counts)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None and self._tolist is not None and self._cpu is not None
        self._mode.__exit__(*exc)
        torch.Tensor.tolist = self._tolist  # type: ignore[method-assign]
        torch.Tensor.cpu = self._cpu  # type: ignore[method-assign]


@contextmanager
def cuda_syncs() -> Iterator[Counter[str]]:
    """Count the CUDA synchronisations of the block (``torch.cuda.set_sync_debug_mode("warn")``: one
    warning per synchronising call); an empty count without CUDA."""
    counts: Counter[str] = Counter()
    if not torch.cuda.is_available():
        yield counts
        return
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counts
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    counts["syncs"] = sum("synchroniz" in str(w.message) for w in caught)
