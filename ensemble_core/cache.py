"""KV-cache cropping that stays exact, or says it cannot.

Ensembling rolls members back to the committed text every round. For full-attention
layers ``DynamicCache.crop(-k)`` is exact. Sliding-window layers (Gemma-3: window 512,
five of every six layers) drop old states once the window is full, so a rollback past
the window is only exact when past recording was activated *and* the tokens removed were
added since the last crop (the layer keeps ``window - 1`` older states plus everything
fed since). :func:`plan_crop` decides; the caller re-prefills when it says no.
"""

from __future__ import annotations

from typing import Any

from transformers import DynamicCache


def new_cache(model: Any) -> DynamicCache:
    """A dynamic cache laid out for ``model`` with past recording on (sliding layers)."""
    cache = DynamicCache(config=model.config)
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
