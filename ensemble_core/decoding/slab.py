"""A batch KV cache that stays put between passes: the rows' own caches live inside it.

Why: a batched pass (:func:`~ensemble_core.decoding.forward.batched_forward`) used to gather every
row's cached keys and values into a padded batch tensor and to copy each row's new states
back into its own cache afterwards: 480 small copies per pass for eight SmolLM2 rows, about
a fifth of an 8-row decode step on a 2-core CPU, repeated every pass although the rows
barely change (one new state each). Here the layers of the rows that batch together
(full-attention layers, and sliding-window layers while they hold a row's whole history)
share one ``[rows, heads, capacity, dim]`` tensor per layer and part (a :class:`Slab`),
and each row's layer (:class:`~ensemble_core.decoding.cache.InPlaceAppend`) keeps its states *in
its slot* of that tensor (its buffer is a view of the slot). A pass over the same rows
then reads the slab directly and the model's update writes each row's new states at the
row's own length, so nothing is gathered or scattered.

Layout: left-aligned, column = position. Row ``s`` holds its ``c`` cached states in
columns ``[0, c)``; a pass feeding ``N`` (padded) tokens writes them at ``[c, c + N)`` and
the row's layer then exposes ``[0, c + n)`` (its real ``n`` tokens). Cropping stays a
slice, unbatched updates (a request running alone) append into the slot in place, and
columns past a row's length are scratch that the mask hides. The slab is zero-filled when
made so that scratch never holds NaN (a masked key still enters ``q @ k``).

Who may move what: a slab is rebuilt (rows copied in) only for the rows of the pass being
run, whose threads all wait for it; a row that is not in the pass is never touched, it
keeps its views of an older slab (kept alive by them) and is copied in when it next joins
a pass. A sliding-window layer is kept here only while it holds its row's whole history
(shorter than the window, or not cropped since): then column = position holds as well, and
the mask applies the window. Past that, the batcher gathers those layers (they drop old states).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

from ensemble_core.decoding.cache import InPlaceAppend
from ensemble_core.transfer import to_device


def room_for(need: int) -> int:
    """Columns for a slab whose longest row needs ``need``: a quarter more and at least 64 (few rebuilds)."""
    return need + max(need // 4, 64)


@dataclass
class SlabStats:
    """Passes that used the slab as it stood (``in_place``), that copied rows into a new one
    (``rebuilt``) or that gathered the rows around a live row sitting out (``gathered``)."""

    in_place: int = 0
    rebuilt: int = 0
    gathered: int = 0


class Slab:
    """One model's batch KV storage for its full-attention layers (see the module docstring)."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._rows: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}  # per layer: each slot's row views
        self.owners: list[weakref.ref[Any]] = []
        self.capacity = 0
        self.stats = SlabStats()

    # ---------------------------------------------------------------- where rows are
    def _slot_of(self, cache: Any, layers: Sequence[int]) -> int | None:
        """The slot holding ``cache``'s states, intact (its layers still views of the slot); else None."""
        slot = next((s for s, ref in enumerate(self.owners) if ref() is cache), None)
        if slot is None:
            return None
        for idx in layers:
            layer = cache.layers[idx]
            if (not isinstance(layer, InPlaceAppend) or not layer._in_buffer()
                    or layer._k is not self._rows[idx][0][slot] or layer._v is not self._rows[idx][1][slot]):
                return None
        return slot

    def place(self, caches: Sequence[Any], layers: Sequence[int], lengths: Sequence[int],
              width_new: int) -> int | None:
        """First slot of the contiguous run that holds ``caches`` in this order; None: gather this pass.

        ``lengths``: each cache's current length; ``width_new``: the pass's (padded) new tokens.
        The caller has sorted ``caches`` by :meth:`order`. Rows are copied into a new slab when
        one of them is not in this one, when the longest needs more room, or when the run has
        holes left by finished requests only; a run broken by a live row that sits this pass
        out is gathered as before (its rows' own updates still land in their slots), so rows
        that alternate between passes do not copy the batch back and forth.
        """
        need = max(lengths) + width_new
        same_layers = set(layers) == set(self.keys)
        slots = [self._slot_of(c, layers) for c in caches] if same_layers else [None]
        if need <= self.capacity and None not in slots:
            first, last = slots[0], slots[-1]
            assert first is not None and last is not None
            if slots == list(range(first, first + len(slots))):
                self.stats.in_place += 1
                return first
            if any(self.owners[s]() is not None for s in range(first, last + 1) if s not in slots):
                self.stats.gathered += 1
                return None
        self._rebuild(caches, layers, lengths, need)
        return 0

    def order(self, caches: Sequence[Any]) -> list[int]:
        """Indices of ``caches`` sorted by their slot (rows not in the slab last, in their order)."""
        slot = {id(ref()): s for s, ref in enumerate(self.owners) if ref() is not None}
        return sorted(range(len(caches)), key=lambda i: (slot.get(id(caches[i]), len(self.owners)), i))

    def _rebuild(self, caches: Sequence[Any], layers: Sequence[int], lengths: Sequence[int], need: int) -> None:
        capacity = room_for(need)
        n_rows = len(caches)
        keys, values = {}, {}
        rows: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for idx in layers:
            like = caches[0].layers[idx]
            _, heads, _, dim = like.keys.shape
            k = like.keys.new_zeros((n_rows, heads, capacity, dim))
            v = like.values.new_zeros((n_rows, heads, capacity, like.values.shape[-1]))
            rows_k, rows_v = [], []
            for s, (cache, n) in enumerate(zip(caches, lengths)):
                layer = cache.layers[idx]
                k[s, :, :n] = layer.keys[0]
                v[s, :, :n] = layer.values[0]
                rows_k.append(k[s:s + 1])
                rows_v.append(v[s:s + 1])
                layer.adopt(rows_k[-1], rows_v[-1], n)
            keys[idx], values[idx], rows[idx] = k, v, (rows_k, rows_v)
        self.keys, self.values, self.capacity, self._rows = keys, values, capacity, rows
        self.owners = [weakref.ref(c) for c in caches]
        self.stats.rebuilt += 1

    # ---------------------------------------------------------------- a pass
    def pass_layer(self, idx: int, first: int, lengths: Sequence[int], width_new: int) -> SlabPassLayer:
        """The cache layer the model sees for layer ``idx`` in a pass over slots ``first ..``."""
        rows = len(lengths)
        return SlabPassLayer(self.keys[idx][first:first + rows], self.values[idx][first:first + rows], lengths,
                             width_new)

    @staticmethod
    def commit(caches: Sequence[Any], layers: Sequence[int], lengths: Sequence[int], fed: Sequence[int]) -> None:
        """After a pass: each row's layers expose their ``fed`` new states (already written into the slot)."""
        for cache, n, f in zip(caches, lengths, fed):
            for idx in layers:
                layer = cache.layers[idx]
                layer.expose(n + f)  # lengths move: no view is made (#38: the host's work per pass and layer)
                if isinstance(layer, DynamicSlidingWindowLayer):
                    layer.cumulative_length = n + f


def slab_columns(lengths: Sequence[int], width_new: int, device: Any) -> torch.Tensor:
    """``[rows, width_new]`` column of each new token in its row: right after the row's cached states."""
    start = to_device(list(lengths), device)
    return start[:, None] + torch.arange(width_new, device=device)[None, :]


class SlabPassLayer(DynamicLayer):
    """The batch view of one slab layer during a pass: writes each row's new states at its length.

    ``keys`` / ``values`` are the slab rows' first ``max(lengths)`` columns (what the model
    reads as the cache); :meth:`update` scatters the new states to columns
    ``lengths[r] + i`` with one op per part and returns the first ``max(lengths) + N``
    columns, which the pass's mask reads row by row.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, lengths: Sequence[int], width_new: int) -> None:
        super().__init__()
        self.lazy_initialization(keys, values)
        self._k, self._v = keys, values
        self._lengths = list(lengths)
        self._width = max(self._lengths) + width_new
        self.keys, self.values = keys[:, :, :max(self._lengths)], values[:, :, :max(self._lengths)]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        rows, heads, n, dim = key_states.shape
        columns = slab_columns(self._lengths, n, key_states.device)
        index = columns[:, None, :, None].expand(rows, heads, n, dim)
        self._k.scatter_(2, index, key_states)
        self._v.scatter_(2, index if value_states.shape[-1] == dim else
                         columns[:, None, :, None].expand(rows, heads, n, value_states.shape[-1]), value_states)
        self.keys, self.values = self._k[:, :, :self._width], self._v[:, :, :self._width]
        return self.keys, self.values
