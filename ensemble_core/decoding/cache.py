"""KV caches: appending in place, and cropping that stays exact, or says it cannot.

Ensembling rolls members back to the committed text every round. For full-attention
layers ``DynamicCache.crop(-k)`` is exact. Sliding-window layers (Gemma-3: window 512,
five of every six layers) drop old states once the window is full, so a rollback past
the window is only exact when past recording was activated *and* the tokens removed were
added since the last crop (the layer keeps ``window - 1`` older states plus everything
fed since). :func:`can_crop_exactly` decides; the caller re-prefills when it says no.

Layers append into spare room instead of concatenating (:class:`RoomyLayer` for full
attention, :class:`RoomySlidingLayer` for sliding windows; see there why).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer


class InPlaceAppend:
    """Appending into spare room kept behind a cache layer's states (mixed into DynamicLayer kinds).

    ``keys`` and ``values`` are prefix views of larger buffers ``_k`` / ``_v``, so an
    append copies only the new states, and ``crop`` / ``cache_branch``'s restore (slices)
    keep working unchanged. The buffers grow by a quarter (at least ``room`` states) when
    full, or when ``keys`` was replaced from outside (a slice from the front): the states
    are then copied into new buffers. Positions past the current length are scratch: a
    tensor taken from ``keys`` before a crop must not be read after the next update.
    """

    keys: Any
    values: Any
    is_initialized: bool

    def _init_room(self, room: int) -> None:
        self.room = room
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Use ``keys`` / ``values`` (``[B, H, capacity, D]``) as the buffers, the first ``length`` states filled."""
        self.lazy_initialization(keys, values)  # type: ignore[attr-defined]
        self._k, self._v = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def _in_buffer(self) -> bool:
        """Whether ``keys`` / ``values`` are still prefix views of the buffers (not replaced from outside)."""
        k, v = self._k, self._v
        return (k is not None and v is not None and self.keys.dim() == 4
                and self.keys.data_ptr() == k.data_ptr() and self.keys.stride() == k.stride()
                and self.values.data_ptr() == v.data_ptr() and self.values.stride() == v.stride())

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)  # type: ignore[attr-defined]
        length, n = self.keys.shape[-2] if self.keys.dim() == 4 else 0, key_states.shape[-2]
        if not self._in_buffer() or self._k is None or length + n > self._k.shape[-2] \
                or self._k.shape[0] != key_states.shape[0]:
            self._grow(length, length + n, key_states, value_states)
        assert self._k is not None and self._v is not None
        self._k[:, :, length:length + n].copy_(key_states)
        self._v[:, :, length:length + n].copy_(value_states)
        self.keys, self.values = self._k[:, :, :length + n], self._v[:, :, :length + n]
        return self.keys, self.values

    def _grow(self, length: int, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        capacity = max(need + self.room, need + need // 4)
        b, h, _, _ = key_states.shape
        k = key_states.new_empty((b, h, capacity, key_states.shape[-1]))
        v = value_states.new_empty((b, h, capacity, value_states.shape[-1]))
        if length:
            k[:, :, :length].copy_(self.keys)
            v[:, :, :length].copy_(self.values)
        self._k, self._v = k, v


class RoomyLayer(InPlaceAppend, DynamicLayer):
    """A full-attention cache layer that appends in place (:class:`InPlaceAppend`).

    Why: ``DynamicLayer.update`` concatenates, which copies the layer's whole cache on
    every forward pass. A batched pass paid that twice (the gathered batch cache inside the
    model, then every row's own cache when its new states were appended back): on this
    project's 2-core CPU, ~25 % of an 8-row SmolLM2 decode step. Its buffers can also be a
    row of a batch :class:`~ensemble_core.decoding.slab.Slab`.
    """

    def __init__(self, room: int = 64) -> None:
        super().__init__()
        self._init_room(room)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self._append(key_states, value_states)

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()


class RoomySlidingLayer(InPlaceAppend, DynamicSlidingWindowLayer):
    """A sliding-window layer with past recording that appends in place (:class:`InPlaceAppend`).

    With past recording (every :func:`new_cache` has it) a sliding layer keeps every state
    fed since the last crop, exactly like a full-attention layer, and returns the last
    ``window - 1 + n`` of them to the model; the crop past the window slices from the front,
    which takes the states out of the buffer (the next append copies them into a new one).
    Until a row's history reaches the window, its states can therefore live in a batch
    :class:`~ensemble_core.decoding.slab.Slab` too (Gemma-3: 15 of its 18 layers).
    """

    def __init__(self, sliding_window: int, room: int = 64) -> None:
        super().__init__(sliding_window)
        self._init_room(room)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.record_past:
            return super().update(key_states, value_states, *args, **kwargs)
        self.cumulative_length += key_states.shape[-2]
        keys, values = self._append(key_states, value_states)
        visible = self.sliding_window - 1 + key_states.shape[-2]
        return keys[:, :, -visible:], values[:, :, -visible:]

    def reset(self) -> None:
        self._k = self._v = None
        super().reset()


def new_cache(model: Any) -> DynamicCache:
    """A dynamic cache laid out for ``model``: layers that append in place, past recording on (sliding)."""
    cache = DynamicCache(config=model.config)
    cache.layers = [RoomyLayer() if type(layer) is DynamicLayer
                    else RoomySlidingLayer(layer.sliding_window) if type(layer) is DynamicSlidingWindowLayer
                    else layer for layer in cache.layers]
    if hasattr(cache, "activate_past_recording"):
        cache.activate_past_recording()
    return cache


def _sliding_layers(cache: Any) -> list[Any]:
    return [layer for layer in getattr(cache, "layers", []) if getattr(layer, "is_sliding", False)]


def can_crop_exactly(cache: Any, remove: int, fed_since_crop: int) -> bool:
    """Whether removing the last ``remove`` tokens leaves a cache equal to a fresh prefill."""
    if remove == 0:
        return True
    for layer in _sliding_layers(cache):
        window = getattr(layer, "sliding_window", None)
        if window is None or layer.get_seq_length() < window:
            continue
        if not getattr(layer, "record_past", False) or remove > fed_since_crop:
            return False
    return True


def crop(cache: Any, remove: int) -> None:
    """Drop the last ``remove`` tokens (``remove >= 0``); also trims sliding layers."""
    cache.crop(-remove)
