"""One :class:`ensemble_core.Ensemble` per (members, method, config), shared by every adapter instance.

LangChain code builds model objects freely: a chain per request, ``with_config`` copies,
and langchain-tests builds a fresh ``ChatEnsemble`` for every single test. The core
already loads each model's weights once per process; this registry also keeps the
*ensemble* (resolved members plus the method object) so that a second ``ChatEnsemble``
with the same description costs a dictionary lookup, not a rebuild.

Per-call settings (``temperature``, ``max_tokens``, ``stop``) are not part of the key:
they are passed to the core as per-call overrides, so instances that differ only in them
share one ensemble. Every ensemble also gets a lock (:func:`lock_for`): one round of
generation runs at a time per ensemble, because parallel forward passes would only
compete for the same cores (or GPU), and the method's lazily built tables are then never
built twice. Requests interleave round by round (see :class:`~.runner.CoreRun`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

from ensemble_core import Ensemble, Member, MemberSpec

#: How many distinct ensembles stay cached. Entries hold only references (the weights
#: themselves are cached by ``ensemble_core.members``), so the bound mainly limits how
#: long prebuilt Member objects handed to the adapter are kept alive.
MAX_ENTRIES = 16

_ENSEMBLES: OrderedDict[Hashable, Ensemble] = OrderedDict()
_LOCKS: weakref.WeakKeyDictionary[Ensemble, threading.Lock] = weakref.WeakKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def freeze(value: Any) -> Hashable:
    """A hashable stand-in for a config value (dicts and lists by content, objects by identity)."""
    if isinstance(value, Mapping):
        return ("dict", tuple(sorted((str(k), freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(freeze(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(freeze(v) for v in value))
    if isinstance(value, os.PathLike):
        return ("path", os.fspath(value))
    if isinstance(value, (str, int, float, bool, type(None), MemberSpec)):
        return value
    return ("id", id(value))  # Member objects, (model, tokenizer) pairs, torch dtypes...


def member_key(item: Any) -> Hashable:
    """Cache key of one member description; prebuilt objects are keyed by identity."""
    if isinstance(item, Member):
        return ("member", id(item))
    if isinstance(item, tuple) and len(item) == 2:
        return ("pair", id(item[0]), id(item[1]))
    return freeze(item)


def ensemble_key(members: Sequence[Any] | None, method: str, method_config: Mapping[str, Any] | None,
                 member_options: Mapping[str, Any] | None) -> Hashable:
    return (
        None if members is None else tuple(member_key(m) for m in members),
        method,
        freeze(dict(method_config or {})),
        freeze(dict(member_options or {})),
    )


def get_ensemble(members: Sequence[Any] | None, method: str, method_config: Mapping[str, Any] | None = None,
                 member_options: Mapping[str, Any] | None = None) -> Ensemble:
    """The cached ensemble for this description, built on first use.

    Building happens under the registry lock, so two threads asking for the same new
    ensemble build it once. Errors (unknown alias, bad option) propagate and nothing is
    cached. The cache holds prebuilt Member objects by identity, so the same objects
    give the same ensemble.
    """
    key = ensemble_key(members, method, method_config, member_options)
    with _REGISTRY_LOCK:
        ensemble = _ENSEMBLES.get(key)
        if ensemble is None:
            ensemble = Ensemble(None if members is None else list(members), method=method,
                                member_options=dict(member_options) if member_options else None,
                                **dict(method_config or {}))
            _ENSEMBLES[key] = ensemble
            while len(_ENSEMBLES) > MAX_ENTRIES:
                _ENSEMBLES.popitem(last=False)
        else:
            _ENSEMBLES.move_to_end(key)
        return ensemble


def lock_for(ensemble: Ensemble) -> threading.Lock:
    """The lock that serialises rounds on ``ensemble`` (lives as long as the ensemble)."""
    with _REGISTRY_LOCK:
        lock = _LOCKS.get(ensemble)
        if lock is None:
            lock = _LOCKS[ensemble] = threading.Lock()
        return lock


def clear() -> None:
    """Forget every cached ensemble (the core keeps the loaded weights; see ``clear_loaded``)."""
    with _REGISTRY_LOCK:
        _ENSEMBLES.clear()
