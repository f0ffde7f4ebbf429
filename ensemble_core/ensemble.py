"""The user-facing entry point: members in, an ensemble method out.

``Ensemble(["smollm2-135m-instruct", "gemma3-270m"], method="safe")`` resolves each
member (alias, path, hub id, :class:`MemberSpec`, :class:`Member` or a ``(model,
tokenizer)`` pair; weights are loaded once per process) and builds the method from the
registry. The LangChain and LlamaIndex adapters are thin wrappers around this class.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

from ensemble_core.decoding.generation import EnsembleMethod, GenerationResult, GenerationStream
from ensemble_core.decoding.members import Member
from ensemble_core.decoding.scheduler import batching_config
from ensemble_core.errors import ConfigurationError, InvalidOptionError, NoMembersError
from ensemble_core.methods import method_class
from ensemble_core.models.loading import MemberSpec, member_spec, spec_of_dict
from ensemble_core.remote import RayMemberSpec, RayOptions, RemoteMember
from ensemble_core.text.chat import Prompt

#: The members of ``Ensemble()`` / ``ChatEnsemble()`` / ``EnsembleLLM()`` / ``ensemble serve`` when none are
#: named: Qwen2.5-Coder-0.5B-Instruct and SmolLM2-135M-Instruct, the bundled pair measured best (SAFE with
#: its defaults, Qwen drafting: GSM8K-50 8/50 = Qwen alone, docs/benchmarks.md; the agent suite 23/24 in
#: LangGraph and 24/24 in LlamaIndex, docs/agents.md). SmolLM2 + Gemma-3-270m, the default before, never
#: called a tool there (0 of 48 runs: it answers in prose) and its members answer 1/50 GSM8K questions each.
DEFAULT_MEMBERS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct")

MemberLike = Any  # str | PathLike | MemberSpec | RayMemberSpec | Member | tuple[model, tokenizer]
BACKENDS = ("local", "ray")


def resolve_member(item: MemberLike, ray_options: RayOptions | dict | None = None, **options: Any) -> Member:
    """Turn any accepted member description into a :class:`Member` (a :class:`RayMemberSpec` into a Ray member)."""
    if isinstance(item, Member):
        return item
    if isinstance(item, RayMemberSpec):
        return RemoteMember.load(item, ray_options, **options)  # Ray is imported only now
    if isinstance(item, MemberSpec):
        return Member.load(item)
    if isinstance(item, tuple) and len(item) == 2:
        model, tokenizer = item
        return Member(model, tokenizer)
    if isinstance(item, dict):
        return Member.load(spec_of_dict(item, options))
    if isinstance(item, str) or hasattr(item, "__fspath__"):
        return Member.load(member_spec(str(item), options))
    raise ConfigurationError(
        f"Cannot build a member from {type(item).__name__}: pass an alias, a path, a model id, a MemberSpec, "
        "a Member, a dict of MemberSpec fields or a (model, tokenizer) pair."
    )


def on_ray(item: MemberLike, **options: Any) -> RayMemberSpec | RemoteMember:
    """The :class:`RayMemberSpec` for a member description under ``backend="ray"`` (default placement)."""
    if isinstance(item, (RayMemberSpec, RemoteMember)):
        return item
    if isinstance(item, dict):
        return RayMemberSpec(spec_of_dict(item, options))
    if isinstance(item, (str, MemberSpec)) or hasattr(item, "__fspath__"):
        return RayMemberSpec(item if isinstance(item, MemberSpec) else member_spec(str(item), options))
    raise ConfigurationError(
        f"backend='ray' cannot place a prebuilt {type(item).__name__}: its weights live in this process. Pass its "
        "alias, path, hub id or MemberSpec (the actor loads it on its node), or a RayMemberSpec."
    )


def resolve_members(items: Sequence[MemberLike] | None, need: int = 1, backend: str = "local",
                    ray_options: RayOptions | dict | None = None, **options: Any) -> list[Member]:
    """Every member of ``items`` (None: :data:`DEFAULT_MEMBERS`); fewer than ``need`` raises :class:`NoMembersError`.

    ``backend="ray"`` places every member on its own Ray actor (:mod:`ensemble_core.remote`);
    with the default ``"local"`` only :class:`RayMemberSpec` items are. If one member fails
    to load, the Ray members already placed are released again.
    """
    if items is None:
        items = DEFAULT_MEMBERS
    if isinstance(items, (str, Member, MemberSpec, RayMemberSpec)):
        items = [items]
    if not isinstance(items, (list, tuple)):
        raise ConfigurationError(f"members must be a list, got {type(items).__name__}: pass members=[...].")
    items = list(items)
    if len(items) < need:
        raise NoMembersError(len(items), need)
    if backend not in BACKENDS:
        raise InvalidOptionError("backend", backend, "one of " + ", ".join(BACKENDS))
    if backend == "ray":
        items = [on_ray(item, **options) for item in items]
        options = {}
    elif ray_options is not None and not any(isinstance(item, (RayMemberSpec, RemoteMember)) for item in items):
        raise ConfigurationError("ray_options was given but no member runs on Ray: pass backend='ray' or RayMemberSpec members.")
    members: list[Member] = []
    try:
        for item in items:
            members.append(resolve_member(item, ray_options, **options))
    except BaseException:
        release_members(members)
        raise
    return members


def release_members(members: Sequence[Member]) -> None:
    """Give back the Ray actors of ``members`` (local members keep their cached weights)."""
    for m in members:
        release = getattr(m, "release", None)
        if release is not None:
            release()


class Ensemble:
    """Members plus a method; ``generate``, ``stream`` and ``batch`` delegate to the method.

    Extra keyword arguments are the method's config fields (``max_new_tokens``,
    ``lookahead``, ``segment_length``, ...); ``member_options`` (dtype, device,
    device_map, ...) apply to members given by name. ``batching`` (on by default; ``False``,
    a dict or a :class:`~ensemble_core.decoding.scheduler.BatchingConfig`) lets concurrent requests
    share forward passes (:mod:`ensemble_core.decoding.scheduler`). ``backend="ray"`` runs every
    member in its own Ray actor; ``ray_options`` (:class:`RayOptions` or a dict of its
    fields) says how to reach Ray and what each member takes; :class:`RayMemberSpec`
    members place single members (docs/scaling.md). :meth:`close` gives the actors back.
    """

    def __init__(self, members: Sequence[MemberLike] | None = None, method: str = "safe",
                 member_options: dict[str, Any] | None = None, batching: Any = None, backend: str = "local",
                 ray_options: RayOptions | dict | None = None, **config: Any) -> None:
        cls = method_class(method)
        self.members = resolve_members(members, need=cls.min_members, backend=backend, ray_options=ray_options,
                                       **(member_options or {}))
        given = list(members) if isinstance(members, (list, tuple)) else [members]
        #: Members this ensemble built (Ray actors it holds a share of); prebuilt ones stay their owner's.
        self._owned = [m for m in self.members if not any(m is item for item in given)]
        try:
            if len(self.members) < cls.min_members:
                raise NoMembersError(len(self.members), cls.min_members)
            self.method: EnsembleMethod = cls(self.members, **config)
            self.method.set_batching(batching_config(batching))
        except BaseException:
            release_members(self._owned)
            raise
        self.method_name = method
        self.backend = backend
        #: Serialises rounds of concurrent requests when batching is off (see ``runtime.Run``).
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

    def warm_up(self) -> None:
        """Build now what the first requests would build mid-answer (:meth:`EnsembleMethod.warm_up`:
        the members' token tables); ``ensemble serve`` and ``ensemble bench`` call it after loading."""
        self.method.warm_up()

    def close(self) -> None:
        """Give back the Ray actors of the members this ensemble built (idempotent; local weights stay cached).

        Members passed in as objects (``Ensemble(other.members, ...)``) belong to whoever built them.
        """
        release_members(self._owned)

    def __enter__(self) -> Ensemble:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ensemble({self.name})"
