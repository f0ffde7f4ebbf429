"""Host reads per output token: how often a method brings a tensor value back to Python.

Why (#38): on a GPU every such read (``.item()``, ``bool(t)``, ``float(t)``, ``.tolist()``) waits
for the queued kernels to finish, so a method that reads per token cannot run ahead of the
device; graph-captured steps help only where decisions are read once per round. The count is the
same on any device (it is the code's, not the hardware's), so the CPU measures it and a test
can hold it, where timings could not; a lent GPU counts the synchronisations themselves with
``torch.cuda.set_sync_debug_mode`` (:func:`cuda_syncs`, ``tests/gpu_check.py``).

:class:`HostReads` counts, while active, every read of a tensor's value through its Python methods
(``.item()``, ``int``, ``float``, ``bool``, ``tolist``) and every ``Tensor.cpu`` call (a copy to the
host, which waits like a read), and the scalar reads ops make inside (``aten._local_scalar_dense``).
Reads of tensors that live on the CPU in a GPU run (token tables, ids, a fused candidate set) are
counted too: the count is an upper bound of the synchronisations.
"""

from __future__ import annotations

import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_SCALAR_READ = torch.ops.aten._local_scalar_dense.default
#: The Python methods that read a tensor's value, by what they count as.
_READS = {"item": "item", "__int__": "item", "__float__": "item", "__bool__": "item", "__index__": "item",
          "tolist": "tolist", "cpu": "cpu"}
_inside = threading.local()  # set while a counted Python read runs: its dispatched scalar read is the same read


class _ScalarReads(TorchDispatchMode):
    """Counts the dispatched scalar reads that no counted Python method made (a read inside an op)."""

    def __init__(self, counter: Counter[str]) -> None:
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _SCALAR_READ and not getattr(_inside, "read", False):
            self.counter["item"] += 1
        return func(*args, **(kwargs or {}))


def _counting(method: Callable[..., Any], counts: Counter[str], kind: str) -> Callable[..., Any]:
    def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        counts[kind] += 1
        outer = getattr(_inside, "read", False)
        _inside.read = True
        try:
            return method(tensor, *args, **kwargs)
        finally:
            _inside.read = outer

    return read


@dataclass
class HostReads:
    """Counts host reads while used as a context manager (``with HostReads() as reads: ...``).

    ``counts["item"]``: scalar reads (``item``, ``int``, ``float``, ``bool``, ``index`` of a tensor);
    ``counts["tolist"]``: ``tolist`` calls; ``counts["cpu"]``: copies to the host. They are counted at
    the Python methods, in every thread, and under ``torch.inference_mode`` too (where a dispatch
    mode sees nothing: counting only dispatched reads missed every read of the decoding loops that
    run in inference mode); a scalar read inside an op is counted by a dispatch mode, in the
    calling thread only.
    """

    counts: Counter[str] = field(default_factory=Counter)
    _mode: _ScalarReads | None = None
    _originals: dict[str, Callable[..., Any] | None] = field(default_factory=dict)  # None: inherited

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def per_token(self, tokens: int) -> float:
        """Reads per output token (``tokens`` >= 1)."""
        return self.total / max(1, tokens)

    def __enter__(self) -> HostReads:
        for name, kind in _READS.items():
            self._originals[name] = torch.Tensor.__dict__.get(name)
            setattr(torch.Tensor, name, _counting(getattr(torch.Tensor, name), self.counts, kind))
        self._mode = _ScalarReads(self.counts)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        for name, original in self._originals.items():
            if original is None:  # inherited from the C base: the class gets its own slot back, as before
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
        self._originals.clear()


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
