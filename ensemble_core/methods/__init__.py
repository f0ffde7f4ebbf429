"""The ensemble methods, one module each, and their registry.

A method is one :class:`~ensemble_core.decoding.generation.EnsembleMethod` subclass (``begin``
and ``step`` over the members' views, see docs/concepts.md) plus one line in :data:`METHODS`;
the ``Ensemble`` facade, the adapters, the CLI, the server and the benchmark all read their
method lists from here. Modules are imported only when their method is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import TYPE_CHECKING

from ensemble_core.errors import ConfigurationError, InvalidOptionError

if TYPE_CHECKING:
    from ensemble_core.decoding.generation import EnsembleMethod

#: method name → "module:Class". Imported lazily so a method's module loads only when used.
METHODS: dict[str, str] = {
    "single": "ensemble_core.methods.single:SingleModel",
    "every-token": "ensemble_core.methods.every_token:EveryTokenEnsemble",
    "safe": "ensemble_core.methods.safe:SafeEnsemble",
    "specem": "ensemble_core.methods.specem:SpecEMEnsemble",
    "generate-then-select": "ensemble_core.methods.generate_then_select:GenerateThenSelect",
}


def method_class(name: str) -> type[EnsembleMethod]:
    """The class registered for ``name`` (see :data:`METHODS`)."""
    if name not in METHODS:
        raise InvalidOptionError("method", name, "one of " + ", ".join(sorted(METHODS)))
    module, _, attr = METHODS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"The method {name!r} is not available in this installation: {exc}") from exc


def config_fields(name: str) -> frozenset[str]:
    """The option names of method ``name``'s config (its dataclass fields; raises for unknown methods)."""
    return frozenset(f.name for f in dataclasses.fields(method_class(name).config_class))
