"""Where Ray members run: the cluster-wide options and one member's placement.

:class:`RayOptions` says how this process reaches Ray (a running cluster or a small local
one), how long it waits for a member, and the default resources of every member actor.
:class:`RayMemberSpec` is one member placed on an actor: what to load (an alias, a path,
a hub id or a :class:`~ensemble_core.models.loading.MemberSpec`) and the Ray resources it needs
(GPUs, CPUs, a custom resource that pins it to a node, or a node id).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from ensemble_core.errors import InvalidOptionError
from ensemble_core.models.loading import MemberSpec
from ensemble_core.options import check_bool, check_int, check_number

#: Object store of a local Ray started here: members exchange a few KiB per round, and
#: only whole rows of logits (<= 1 MiB each) ever reach the store.
DEFAULT_OBJECT_STORE_BYTES = 96 * 2**20
#: Ray refuses object stores below 75 MiB.
MIN_OBJECT_STORE_BYTES = 75 * 2**20


def resource_items(name: str, value: Any) -> tuple[tuple[str, float], ...]:
    """Custom Ray resources as sorted ``(name, amount)`` pairs (hashable, so specs can key caches)."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = tuple(sorted((str(k), float(v)) for k, v in items))
    except (TypeError, ValueError) as exc:
        raise InvalidOptionError(name, value, "a dict of resource name -> amount, e.g. {'node_a': 1}") from exc
    if any(not k or v <= 0 or not math.isfinite(v) for k, v in pairs):
        raise InvalidOptionError(name, value, "non-empty resource names with amounts > 0")
    return pairs


@dataclass(frozen=True)
class RayOptions:
    """How this process uses Ray for its members (defaults suit one machine; see docs/scaling.md).

    ``address``: ``None`` uses the Ray this process already joined, else starts a new local
    one (``object_store_memory`` bytes, no dashboard); ``"auto"`` joins the cluster started on
    this machine by ``ray start``; ``"ray://host:10001"`` goes through Ray Client.
    ``call_timeout_s`` bounds every wait for a member's answer (one draft, one
    verification), so a dead or stuck node surfaces as
    :class:`~ensemble_core.errors.MemberUnavailableError` instead of a hang;
    ``start_timeout_s`` bounds placing an actor and loading its model. ``max_restarts``:
    how often Ray restarts a dead member actor (it reloads its model); tasks are never
    retried (a half-done step cannot be replayed). ``num_cpus``, ``num_gpus``,
    ``resources``: each member's default Ray resources (a :class:`RayMemberSpec` overrides
    them). ``torch_threads``: intra-op threads in each actor (None: Ray's default, the
    actor's ``num_cpus``). ``count_bytes``: measure the pickled size of every call and
    answer (what :mod:`ensemble_core.bench.remote` reports; off by default, it costs a
    copy).
    """

    address: str | None = None
    object_store_memory: int = DEFAULT_OBJECT_STORE_BYTES
    call_timeout_s: float = 300.0
    start_timeout_s: float = 900.0
    max_restarts: int = 1
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: Any = ()
    torch_threads: int | None = None
    namespace: str | None = None
    count_bytes: bool = False

    def __post_init__(self) -> None:
        if self.address is not None and (not isinstance(self.address, str) or not self.address.strip()):
            raise InvalidOptionError("address", self.address, "None (local Ray), 'auto' or 'ray://host:port'")
        check_int("object_store_memory", self.object_store_memory, MIN_OBJECT_STORE_BYTES)
        check_number("call_timeout_s", self.call_timeout_s, 0.001, finite=True)
        check_number("start_timeout_s", self.start_timeout_s, 0.001, finite=True)
        check_int("max_restarts", self.max_restarts, 0)
        check_number("num_cpus", self.num_cpus, 0, finite=True)
        check_number("num_gpus", self.num_gpus, 0, finite=True)
        check_int("torch_threads", self.torch_threads, 1, optional=True, expected="an integer >= 1 or None")
        object.__setattr__(self, "resources", resource_items("resources", self.resources))
        check_bool("count_bytes", self.count_bytes)

    @classmethod
    def of(cls, value: RayOptions | Mapping[str, Any] | None) -> RayOptions:
        """Options from an instance, a dict of fields or None (the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, RayOptions):
            return value
        if isinstance(value, Mapping):
            return cls(**dict(value))
        raise InvalidOptionError("ray_options", value, "a RayOptions, a dict of its fields or None")


@dataclass(frozen=True)
class RayMemberSpec:
    """One member on its own Ray actor: what to load and which Ray resources it takes.

    ``member``: an alias, a local path, a GGUF file, a hub id or a :class:`MemberSpec`
    (the same as a local member; the path must exist *on the node*). ``num_cpus`` /
    ``num_gpus`` / ``resources`` (None: :class:`RayOptions`' defaults) are Ray resources;
    a custom resource declared by one node (``ray start --resources='{"node_a": 1}'``)
    pins the member there, as does ``node_id`` (a Ray node id, hard affinity). With
    ``num_gpus > 0`` and no device given the model goes to ``"cuda"`` (Ray makes the
    actor's GPU its ``cuda:0``).
    """

    member: Any
    num_cpus: float | None = None
    num_gpus: float | None = None
    resources: Any = None
    node_id: str | None = None
    max_restarts: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.member, (str, MemberSpec)) and not hasattr(self.member, "__fspath__"):
            raise InvalidOptionError("member", self.member, "an alias, a path, a hub id or a MemberSpec")
        check_number("num_cpus", self.num_cpus, 0, finite=True, optional=True, expected="a number >= 0 or None")
        check_number("num_gpus", self.num_gpus, 0, finite=True, optional=True, expected="a number >= 0 or None")
        check_int("max_restarts", self.max_restarts, 0, optional=True, expected="an integer >= 0 or None")
        if self.resources is not None:
            object.__setattr__(self, "resources", resource_items("resources", self.resources))
        if self.node_id is not None and (not isinstance(self.node_id, str) or not self.node_id):
            raise InvalidOptionError("node_id", self.node_id, "a Ray node id (hex string) or None")

    def spec(self, **member_options: Any) -> MemberSpec:
        """The :class:`MemberSpec` the actor loads (``member_options`` apply to a member given by name)."""
        spec = self.member if isinstance(self.member, MemberSpec) else MemberSpec(source=str(self.member), **member_options)
        if (self.num_gpus or 0) > 0 and spec.device is None and spec.device_map is None:
            spec = replace(spec, device="cuda")
        return spec

    def placement_key(self, defaults: RayOptions) -> tuple:
        """What makes two placements the same actor (resources, restarts, threads, cluster)."""
        return (
            self.num_cpus if self.num_cpus is not None else defaults.num_cpus,
            self.num_gpus if self.num_gpus is not None else defaults.num_gpus,
            self.resources if self.resources is not None else defaults.resources,
            self.node_id,
            self.max_restarts if self.max_restarts is not None else defaults.max_restarts,
            defaults.torch_threads,
            defaults.address,
            defaults.namespace,
        )

    def actor_options(self, defaults: RayOptions) -> dict[str, Any]:
        """Keyword arguments of ``ActorClass.options`` for this member."""
        resources = dict(defaults.resources if self.resources is None else self.resources)
        options: dict[str, Any] = {
            "num_cpus": defaults.num_cpus if self.num_cpus is None else self.num_cpus,
            "num_gpus": defaults.num_gpus if self.num_gpus is None else self.num_gpus,
            "max_restarts": defaults.max_restarts if self.max_restarts is None else self.max_restarts,
            "max_task_retries": 0,
        }
        if resources:
            options["resources"] = resources
        if self.node_id is not None:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
        return options
