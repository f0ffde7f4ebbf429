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


def prefix_length(tensor: Any, buffer: torch.Tensor | None) -> int | None:
    """``n`` when ``tensor`` is ``buffer[:, :, :n]`` (the same start and strides), else None."""
    if buffer is None or not isinstance(tensor, torch.Tensor) or tensor.dim() != 4 or tensor.stride() != buffer.stride() \
            or tensor.shape[:2] != buffer.shape[:2] or tensor.shape[3] != buffer.shape[3] or tensor.shape[2] > buffer.shape[2]:
        return None
    if tensor.shape[2] == 0:  # an empty view has no data pointer to compare: any empty one of its kind is the prefix
        return 0 if (tensor.dtype, tensor.device) == (buffer.dtype, buffer.device) else None
    return tensor.shape[2] if tensor.data_ptr() == buffer.data_ptr() else None


class PrefixView:
    """A layer's ``keys`` or ``values``: while the tensor set is its buffer's prefix, only its length is kept
    and the view is made when read; any other tensor (or None) is kept as it is (see :class:`InPlaceAppend`)."""

    def __init__(self, part: str) -> None:
        self.buffer, self.length, self.held = f"_{part}", f"_{part}n", f"_held_{part}"

    def __get__(self, layer: Any, owner: Any = None) -> Any:
        if layer is None:
            return self
        n = getattr(layer, self.length)
        return getattr(layer, self.held) if n is None else getattr(layer, self.buffer)[:, :, :n]

    def __set__(self, layer: Any, tensor: Any) -> None:
        n = prefix_length(tensor, layer.__dict__.get(self.buffer))
        setattr(layer, self.length, n)
        setattr(layer, self.held, None if n is not None else tensor)


class InPlaceAppend:
    """Appending into spare room kept behind a cache layer's states (mixed into DynamicLayer kinds).

    ``keys`` and ``values`` are prefix views of larger buffers ``_k`` / ``_v``, so an
    append copies only the new states, and ``crop`` / ``cache_branch``'s restore (slices)
    keep working unchanged. The buffers grow by a quarter (at least ``room`` states) when
    full, or when ``keys`` was replaced from outside (a slice from the front): the states
    are then copied into new buffers. Positions past the current length are scratch: a
    tensor taken from ``keys`` before a crop must not be read after the next update.

    While they are prefixes of the buffers the layer holds their lengths, not the views: a view is
    made when ``keys`` / ``values`` are read (the model's forward, a crop's slice), and the batched
    passes move the lengths (:meth:`expose`, :meth:`keep_first`). Why (#38): the host's work per pass
    must not grow with the model's depth; slicing two views per layer and request, and comparing them
    with their buffers, cost ~5 us per layer on a CPU (a 28-layer member: ~140 us per request and pass,
    paid by every request of a batch).
    """

    is_initialized: bool
    _kn: int | None = None  # keys = _k[:, :, :_kn] while not None
    _vn: int | None = None
    _held_k: torch.Tensor | None = None  # keys otherwise (not a prefix of the buffer, or no buffer)
    _held_v: torch.Tensor | None = None

    keys = PrefixView("k")
    values = PrefixView("v")

    def _init_room(self, room: int) -> None:
        self.room = room
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def adopt(self, keys: torch.Tensor, values: torch.Tensor, length: int) -> None:
        """Use ``keys`` / ``values`` (``[B, H, capacity, D]``) as the buffers, the first ``length`` states filled."""
        self.lazy_initialization(keys, values)  # type: ignore[attr-defined]
        self._k, self._v = keys, values
        self._kn = self._vn = length
        self._held_k = self._held_v = None

    def held(self) -> int | None:
        """How many states the layer holds while they are a prefix of its buffers (None: tensors of their own)."""
        return self._kn if self._kn is not None and self._vn is not None else None

    def expose(self, n: int) -> None:
        """``keys`` / ``values`` are now the buffers' first ``n`` states (a batched pass wrote them there)."""
        assert self._k is not None and self._v is not None and n <= self._k.shape[-2]
        self._kn = self._vn = n
        self._held_k = self._held_v = None

    def keep_first(self, n: int) -> bool:
        """``keys[..., :n, :]`` (and the values) by moving the lengths; False when not a prefix (slice instead)."""
        if self._kn is None or self._vn is None:
            return False
        self._kn, self._vn = min(self._kn, max(n, 0)), min(self._vn, max(n, 0))
        return True

    def _in_buffer(self) -> bool:
        """Whether ``keys`` / ``values`` are still prefix views of the buffers (not replaced from outside)."""
        return self.held() is not None  # a length is only ever held with its buffer

    def _append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)  # type: ignore[attr-defined]
        held, n = self.held(), key_states.shape[-2]
        length = held if held is not None else self.keys.shape[-2] if self.keys.dim() == 4 else 0
        if held is None or self._k is None or length + n > self._k.shape[-2] or self._k.shape[0] != key_states.shape[0]:
            self._grow(length, length + n, key_states, value_states)
        assert self._k is not None and self._v is not None
        self._k[:, :, length:length + n].copy_(key_states)
        self._v[:, :, length:length + n].copy_(value_states)
        self.expose(length + n)
        return self._k[:, :, :length + n], self._v[:, :, :length + n]

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

    def get_seq_length(self) -> int:
        return self._kn if self._kn is not None else super().get_seq_length()

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop (``tokens_to_remove`` < 0: drop that many states), a prefix's by its lengths."""
        if not (tokens_to_remove < 0 and self.keep_first(self.get_seq_length() + tokens_to_remove)):
            super().crop(tokens_to_remove)

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
