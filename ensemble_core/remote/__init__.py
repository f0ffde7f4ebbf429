"""Ensemble members on Ray actors: one model per actor, anywhere in a cluster.

``Ensemble(members, method="safe", backend="ray", ray_options=RayOptions(...))`` runs every
member in its own Ray actor; ``RayMemberSpec(source, num_gpus=1, resources={...})`` places
one member (and may be mixed with local members). The methods do not know the difference:
a :class:`RemoteMember` is a :class:`~ensemble_core.decoding.members.Member` with its tokenizer here
and its model in a :class:`MemberActor`, and its decoding states run the methods' own
operations next to their KV caches (:mod:`ensemble_core.decoding.rows`). See docs/scaling.md.

Modules: :mod:`.options` (what the user configures), :mod:`.actor` (the model side),
:mod:`.cluster` (connecting, placing, bounded waits, releasing), :mod:`.member` (the client
side). Ray itself is imported only when a Ray member is built.
"""

from ensemble_core.remote.actor import MemberActor
from ensemble_core.remote.cluster import WireCounter, connect, release
from ensemble_core.remote.member import RemoteDecodeState, RemoteMember, RemoteRows
from ensemble_core.remote.options import RayMemberSpec, RayOptions

__all__ = [
    "MemberActor",
    "RayMemberSpec",
    "RayOptions",
    "RemoteDecodeState",
    "RemoteMember",
    "RemoteRows",
    "WireCounter",
    "connect",
    "release",
]
