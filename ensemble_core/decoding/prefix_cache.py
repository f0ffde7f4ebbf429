"""Prefix caching: a member keeps its recent prompts' KV states, and a request that starts the same way
prefills only what is new.

Why: agents and chats send the same conversation again with a few messages more (the tool call and
its result, the next user turn), and RAG pipelines put the same instructions before every question.
In this project's agent runs the passes that start a request's cache took 55-70 % of the members'
model time (docs/agents.md, "Where an agent's time goes"). vLLM's automatic prefix caching keeps
such states per 16-token block in its paged KV memory; a member here keeps whole prompts, in its
own token ids, most recently used first within a token budget, and a new request copies the longest
prefix it shares with one of them into its fresh cache.

Exact up to floating-point summation order: the states copied are the ones a prefill of the same ids
at the same positions computed, and the new tail's pass reads them as a round after a crop-back
reads the ids it re-feeds. Sliding-window layers (Gemma-3) are stored only while they still hold
every state of the prompt (they do until the first crop: past recording keeps them), so a restored
cache equals a fresh prefill's.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ensemble_core.decoding.cache import RoomyLayer, RoomySlidingLayer, new_cache

#: The shortest prefix worth a copy (vLLM's block size: a shared chat-template header of a few
#: tokens is not worth the bookkeeping).
MIN_REUSE = 16


@dataclass(frozen=True)
class PrefixEntry:
    """One stored prompt: its ids and, per layer, its keys and values (``[1, heads, len(ids), dim]``)."""

    ids: tuple[int, ...]
    keys: tuple[torch.Tensor, ...]
    values: tuple[torch.Tensor, ...]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prompt_states(cache: Any, n: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None:
    """Copies of the first ``n`` states of every layer of ``cache`` (None when a layer does not hold them all:
    a sliding layer trimmed to its window, a layer kind other than this package's, a batch of rows)."""
    keys, values = [], []
    for layer in getattr(cache, "layers", ()):
        if not isinstance(layer, (RoomyLayer, RoomySlidingLayer)) or not layer.is_initialized:
            return None
        k, v = layer.keys, layer.values  # a full layer, or a static slot's (its window is in the masks), holds them all
        held_from_start = not isinstance(layer, RoomySlidingLayer) or k.shape[-2] == layer.cumulative_length
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[-2] < n or v.shape[-2] < n or not held_from_start:
            return None
        keys.append(k[:, :, :n].clone(memory_format=torch.contiguous_format))
        values.append(v[:, :, :n].clone(memory_format=torch.contiguous_format))
    return (tuple(keys), tuple(values)) if keys else None


def placement(model: Any) -> tuple[torch.device, torch.dtype]:
    """Where and in which dtype ``model``'s head weight lives: a change means the model was moved or cast after
    its prompts were stored (``model.to(...)``), and states kept from before would meet the new weights in a
    pass (a device or dtype error deep inside torch)."""
    weight = model.get_output_embeddings().weight
    return weight.device, weight.dtype


class PrefixCache:
    """A member's most recently used prompts' KV states, within ``capacity`` tokens in all (thread-safe).

    :meth:`restore` gives a new request a cache holding the longest stored prefix of its ids (at least
    :data:`MIN_REUSE`); :meth:`store` keeps a prompt once its pass has run. A prompt that extends a stored
    one replaces it (an agent's next turn supersedes the last), one that a stored prompt extends is not
    kept twice. ``hits`` counts the requests it served (each request's ``prefix_reused`` says how much).
    """

    def __init__(self, capacity: int, min_reuse: int = MIN_REUSE) -> None:
        self.capacity, self.min_reuse = capacity, min_reuse
        self._entries: OrderedDict[tuple[int, ...], PrefixEntry] = OrderedDict()
        self._lock = threading.Lock()
        self.tokens = 0
        self.hits = 0
        self._placement: tuple[torch.device, torch.dtype] | None = None  # the model's when its prompts were stored

    def __len__(self) -> int:
        return len(self._entries)

    def longest(self, ids: Sequence[int], limit: int) -> tuple[int, PrefixEntry | None]:
        """The longest prefix of ``ids[:limit]`` a stored prompt holds, and that prompt (marked as used)."""
        best, found = 0, None
        with self._lock:
            for entry in self._entries.values():
                n = common_prefix(entry.ids, ids[:limit])
                if n > best:
                    best, found = n, entry
            if found is not None:
                self._entries.move_to_end(found.ids)
        return best, found

    def find(self, ids: Sequence[int], limit: int, where: tuple[torch.device, torch.dtype] | None = None
             ) -> tuple[int, PrefixEntry] | None:
        """The longest stored prefix of ``ids[:limit]`` (its length and the prompt holding it, counted as a hit),
        or None when no stored prompt shares :attr:`min_reuse` ids with it. ``where``: the model's
        :func:`placement` now; when it moved since its prompts were stored, they are forgotten (None)."""
        if where is not None and self._placement is not None and where != self._placement:
            self.clear()
            return None
        n, entry = self.longest(ids, limit)
        if entry is None or n < self.min_reuse:
            return None
        with self._lock:
            self.hits += 1
        return n, entry

    def restore(self, model: Any, ids: Sequence[int], limit: int) -> tuple[Any, int] | None:
        """A new eager cache for ``model`` holding the states of the longest stored prefix of ``ids[:limit]`` and
        its length (None: :meth:`find` found none). A static slot loads them itself
        (:meth:`~ensemble_core.decoding.static.StaticCache.load`)."""
        found = self.find(ids, limit, placement(model))
        if found is None:
            return None
        n, entry = found
        cache = new_cache(model)
        for i, (k, v) in enumerate(zip(entry.keys, entry.values)):
            cache.update(k[:, :, :n], v[:, :, :n], i)
        return cache, n

    def store(self, ids: Sequence[int], cache: Any, where: tuple[torch.device, torch.dtype] | None = None) -> bool:
        """Keep the states of ``ids`` (the first ``len(ids)`` states of ``cache``); False when they are not
        kept (shorter than :attr:`min_reuse`, longer than the capacity, states not all held). ``where``: the
        model's :func:`placement` (prompts stored before it changes are forgotten)."""
        key = tuple(map(int, ids))
        if not self.min_reuse <= len(key) <= self.capacity:
            return False
        with self._lock:
            if where is not None and where != self._placement:
                self._entries.clear()
                self.tokens, self._placement = 0, where
            if any(stored[:len(key)] == key for stored in self._entries):  # held already (itself or a longer one)
                return True
        states = prompt_states(cache, len(key))
        if states is None:
            return False
        with self._lock:
            for stored in [s for s in self._entries if key[:len(s)] == s]:  # prompts the new one extends
                self.tokens -= len(self._entries.pop(stored).ids)
            self._entries[key] = PrefixEntry(key, *states)
            self.tokens += len(key)
            while self.tokens > self.capacity:
                _, evicted = self._entries.popitem(last=False)
                self.tokens -= len(evicted.ids)
        return True

    def clear(self) -> None:
        """Forget every stored prompt (their memory is freed)."""
        with self._lock:
            self._entries.clear()
            self.tokens = 0
