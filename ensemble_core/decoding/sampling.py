"""Choosing a token: greedy, or a temperature / nucleus sample, where the probabilities are.

Every decoding path chooses through here (a member's :class:`~ensemble_core.decoding.pipeline.TokenPipeline`).
Why a module of its own (#38): a choice the host must read before the next pass can be queued
serialises a GPU, and sampling read twice per token: the distribution was copied to the host
(``torch.multinomial`` over a CPU generator), and ``torch.multinomial`` itself checks its input
with two host reads. :func:`sample_ids` draws the same way without reading anything: its
one-sample path (an exponential race, ``argmax(p / q)`` with ``q ~ Exp(1)``, exact for a
categorical distribution) run without the checks, on the probabilities' device. A draft can
then keep sampled ids on the device, as it keeps greedy ones
(:func:`~ensemble_core.decoding.drafting.unread_drafting`).

Reproducibility. On a CPU the draws are ``torch.multinomial``'s own, bit for bit (the same
noise from the same generator, the same operations), so a seeded request writes what it
wrote before. On another device the noise comes from a generator on that device, seeded once
per request from the request's CPU generator (:func:`device_generator`): a seeded request is
reproducible on that device, and writes other text than on a CPU (different random streams). A
remote member (a Ray actor) gets the request's CPU generator with each call and, on a GPU, seeds
its device generator from it per call: reproducible too, and other draws than a local member's.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch

#: Per request generator (the CPU one every member's pipeline shares): its generators on other devices.
_ON_DEVICE: weakref.WeakKeyDictionary[torch.Generator, dict[torch.device, torch.Generator]] = weakref.WeakKeyDictionary()
_LOCK = threading.Lock()


def make_generator(config: Any, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A seeded generator for sampling (``config.seed``, or a fresh seed), or None for greedy decoding."""
    if not config.do_sample:
        return None
    gen = torch.Generator(device=device)
    gen.manual_seed(config.seed if config.seed is not None else int(torch.seed() % 2**63))
    return gen


def device_generator(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """The generator that draws on ``device`` for the request whose generator is ``generator``: itself
    when it lives there, else one made on ``device`` the first time, seeded from ``generator``'s stream
    (so a seeded request stays reproducible) and kept for the request's life. None: the device's default."""
    if generator is None or generator.device == device:
        return generator
    with _LOCK:
        own = _ON_DEVICE.setdefault(generator, {})
        if device not in own:
            seed = int(torch.randint(0, 2**62, (1,), generator=generator))
            own[device] = torch.Generator(device=device).manual_seed(seed)
        return own[device]


def transformed(probs: torch.Tensor, config: Any) -> torch.Tensor:
    """``probs`` under the request's temperature and nucleus (``top_p``), renormalised; device ops only."""
    p = probs.float()
    if config.temperature != 1.0:
        # p ** (1/T) in log space: a small T (1e-3) underflowed every p < 1 to 0, 0/0 gave NaN and the
        # sample was token 0 at every step; a zero (a token a grammar masked) stays zero at any T.
        logp = torch.where(p > 0, torch.log(p), torch.full_like(p, float("-inf")))
        p = torch.softmax(logp / config.temperature, dim=-1)
    p = p / p.sum()
    if config.top_p < 1.0:
        sorted_p, order = torch.sort(p, descending=True)
        cut = torch.cumsum(sorted_p, 0) - sorted_p > config.top_p
        p = torch.zeros_like(p).scatter_(0, order, sorted_p.masked_fill(cut, 0.0))
        p = p / p.sum()
    return p


def sample_ids(probs: torch.Tensor, config: Any, generator: torch.Generator | None) -> torch.Tensor:
    """The chosen id as a 0-d tensor on ``probs``' device, not read: the argmax (greedy; ``probs`` may be
    logits), or a sample under the request's temperature / top-p drawn as ``torch.multinomial(p, 1)``
    draws it (see the module docstring)."""
    if not config.do_sample:
        return torch.argmax(probs)
    p = transformed(probs, config)
    noise = torch.empty_like(p).exponential_(1, generator=device_generator(generator, p.device))
    return torch.argmax(p / noise)


def choose_token(probs: torch.Tensor, config: Any, generator: torch.Generator | None) -> int:
    """:func:`sample_ids`, read: greedy argmax, or a temperature / nucleus sample from a probability vector."""
    return int(sample_ids(probs, config, generator))
