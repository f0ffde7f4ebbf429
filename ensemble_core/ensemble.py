"""The user-facing entry point: members in, an ensemble method out.

``Ensemble(["smollm2-135m-instruct", "gemma3-270m"], method="safe")`` resolves each
member (alias, path, hub id, :class:`MemberSpec`, :class:`Member` or a ``(model,
tokenizer)`` pair; weights are loaded once per process) and builds the method from the
registry. The LangChain and LlamaIndex adapters are thin wrappers around this class.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import Any

from .chat import Prompt
from .errors import ConfigurationError, InvalidOptionError, NoMembersError
from .generation import EnsembleMethod, GenerationResult, GenerationStream
from .members import Member, MemberSpec

#: method name → "module:Class". Imported lazily so a method's module loads only when used.
METHODS: dict[str, str] = {
    "single": "ensemble_core.baselines:SingleModel",
    "safe": "ensemble_core.safe:SafeEnsemble",
    "every-token": "ensemble_core.baselines:EveryTokenEnsemble",
    "specem": "ensemble_core.specem:SpecEMEnsemble",
    "generate-then-select": "ensemble_core.baselines:GenerateThenSelect",
}
DEFAULT_MEMBERS = ("smollm2-135m-instruct", "gemma3-270m")

MemberLike = Any  # str | PathLike | MemberSpec | Member | tuple[model, tokenizer]


def method_class(name: str) -> type[EnsembleMethod]:
    """The class registered for ``name`` (see :data:`METHODS`)."""
    if name not in METHODS:
        raise InvalidOptionError("method", name, "one of " + ", ".join(sorted(METHODS)))
    module, _, attr = METHODS[name].partition(":")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigurationError(f"The method {name!r} is not available in this installation: {exc}") from exc


def resolve_member(item: MemberLike, **options: Any) -> Member:
    """Turn any accepted member description into a :class:`Member`."""
    if isinstance(item, Member):
        return item
    if isinstance(item, MemberSpec):
        return Member.load(item)
    if isinstance(item, tuple) and len(item) == 2:
        model, tokenizer = item
        return Member(model, tokenizer)
    if isinstance(item, dict):
        return Member.load(MemberSpec(**{**options, **item}))
    if isinstance(item, str) or hasattr(item, "__fspath__"):
        return Member.load(str(item), **options)
    raise ConfigurationError(
        f"Cannot build a member from {type(item).__name__}: pass an alias, a path, a model id, a MemberSpec, "
        "a Member, a dict of MemberSpec fields or a (model, tokenizer) pair."
    )


def resolve_members(items: Sequence[MemberLike] | None, need: int = 1, **options: Any) -> list[Member]:
    """Every member of ``items`` (None: the bundled pair); fewer than ``need`` raises :class:`NoMembersError`."""
    if items is None:
        items = DEFAULT_MEMBERS
    if isinstance(items, (str, Member, MemberSpec)):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise ConfigurationError(f"members must be a list, got {type(items).__name__}: pass members=[...].")
    items = list(items)
    if len(items) < need:
        raise NoMembersError(len(items), need)
    return [resolve_member(item, **options) for item in items]


class Ensemble:
    """Members plus a method; ``generate``, ``stream`` and ``batch`` delegate to the method.

    Extra keyword arguments are the method's config fields (``max_new_tokens``,
    ``lookahead``, ``segment_length``, ...); ``member_options`` (dtype, device,
    device_map, ...) apply to members given by name.
    """

    def __init__(self, members: Sequence[MemberLike] | None = None, method: str = "safe",
                 member_options: dict[str, Any] | None = None, **config: Any) -> None:
        cls = method_class(method)
        self.members = resolve_members(members, need=cls.min_members, **(member_options or {}))
        if len(self.members) < cls.min_members:
            raise NoMembersError(len(self.members), cls.min_members)
        self.method_name = method
        self.method: EnsembleMethod = cls(self.members, **config)
        #: Serialises rounds of concurrent requests (see ``runtime.Run``): one method step at a time.
        self.lock = threading.Lock()

    @property
    def config(self) -> Any:
        return self.method.config

    @property
    def context_window(self) -> int:
        return min(m.context_window for m in self.members)

    @property
    def name(self) -> str:
        return f"{self.method_name}(" + "+".join(m.name for m in self.members) + ")"

    def generate(self, prompt: Prompt, cancel: threading.Event | None = None, **overrides: Any) -> GenerationResult:
        return self.method.generate(prompt, cancel=cancel, **overrides)

    def stream(self, prompt: Prompt, cancel: threading.Event | None = None, **overrides: Any) -> GenerationStream:
        return self.method.stream(prompt, cancel=cancel, **overrides)

    def batch(self, prompts: Sequence[Prompt], **overrides: Any) -> list[GenerationResult]:
        return self.method.batch(prompts, **overrides)

    def __repr__(self) -> str:
        return f"Ensemble({self.name})"
