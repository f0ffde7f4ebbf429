"""One :class:`ensemble_core.Ensemble` per (members, method, options) in a process.

Model weights are already loaded once per process by the core (``Member.load`` caches
them), so an ``EnsembleLLM`` and a LangChain ``ChatEnsemble`` over the same members share
the weights whatever this module does. What this cache adds is the method object itself:
a method may precompute per-member-set tables at construction (vocabulary maps, for
instance), and LlamaIndex copies LLM objects freely (``model_copy``, settings, agents), so
identical configurations reuse one ``Ensemble`` instead of rebuilding it. An ``Ensemble``
holds no per-request state (each request owns its decoding states), so sharing it between
LLM objects is safe. Generations on one ``Ensemble`` are serialised by :func:`lock_for`:
a method object is not required to be re-entrant, and parallel requests would only
compete for the same cores (or GPU) anyway.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

from ensemble_core import Ensemble, Member, MemberSpec

_LOCK = threading.Lock()
_ENSEMBLES: dict[tuple, Ensemble] = {}
_LOCKS: weakref.WeakKeyDictionary[Ensemble, threading.Lock] = weakref.WeakKeyDictionary()


def _canonical(value: Any) -> Any:
    """A hashable stand-in for an option value (dicts and lists by content)."""
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), _canonical(v)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return tuple(_canonical(v) for v in value)
    try:
        hash(value)
    except TypeError:
        return ("id", id(value))
    return value


def member_key(item: Any) -> Any:
    """How a member description is told apart from others.

    Names and specs compare by value. Objects (a ``Member``, a ``(model, tokenizer)``
    pair) compare by identity: the cached ``Ensemble`` keeps them alive, so an id cannot
    be reused by another object while its entry exists.
    """
    if isinstance(item, (str, MemberSpec)):
        return ("spec", str(item) if isinstance(item, str) else item)
    if hasattr(item, "__fspath__"):
        return ("spec", str(item))
    if isinstance(item, Member):
        return ("member", id(item))
    if isinstance(item, tuple):
        return ("pair",) + tuple(id(x) for x in item)
    return ("other", _canonical(item))


def shared_ensemble(members: Sequence[Any], method: str, member_options: Mapping[str, Any],
                    method_config: Mapping[str, Any]) -> Ensemble:
    """The process-wide ``Ensemble`` for this configuration (built on first use)."""
    key = (tuple(member_key(m) for m in members), method, _canonical(member_options), _canonical(method_config))
    with _LOCK:
        ensemble = _ENSEMBLES.get(key)
        if ensemble is None:
            ensemble = Ensemble(list(members), method=method, member_options=dict(member_options), **dict(method_config))
            _ENSEMBLES[key] = ensemble
        return ensemble


def lock_for(ensemble: Ensemble) -> threading.Lock:
    """The lock that serialises generations on ``ensemble`` (lives as long as the ensemble)."""
    with _LOCK:
        lock = _LOCKS.get(ensemble)
        if lock is None:
            lock = _LOCKS[ensemble] = threading.Lock()
        return lock


def clear_shared() -> None:
    """Forget the cached ensembles (the core's model cache is separate: ``members.clear_loaded``)."""
    with _LOCK:
        _ENSEMBLES.clear()
