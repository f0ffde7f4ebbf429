"""Typed statistics of one finished request, with the same names for the same things in every method.

Every method returns a :class:`RequestStats` (or a subclass with its own extras) from
:meth:`EnsembleMethod.stats`, and :class:`~ensemble_core.GenerationResult` carries it as it
is: typed (``result.stats.e_t``), and also a read-only mapping with fixed keys
(``result.stats["e_t"]``, ``dict(result.stats)``), the same keys in every method. Only where
the stats leave the library (the adapters' metadata, the server's JSON, the benchmark's
records) are they turned into a plain, JSON-serialisable dict (:meth:`~RequestStats.as_dict`):

=================  ====================================================================
key                meaning (every method)
=================  ====================================================================
``method``         the method's registry name
``tokens``         response tokens in the primary member's tokenizer (SAFE: the drafter)
``rounds``         ``step`` calls (SAFE: draft/verify rounds, SpecEM: segments, ...)
``members``        one :class:`MemberStats` per member, in member order
``reliability``    where the members' weights come from (ensembles: ``"prior"``,
                   ``"reliability_weights"``, ``"fusion_weights"`` or ``"none"``; None
                   for a single model); each member's ``weight`` and ``wins`` are in
                   ``members`` (:mod:`ensemble_core.methods.reliability`)
=================  ====================================================================

Token-level methods (SAFE, every-token) add ``ensembled`` (tokens committed by an
ensemble decision) and ``e_t`` (``ensembled / tokens``, the E/T ratio of the SAFE paper).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ensemble_core.decoding.members import DecodeState


@dataclass
class MemberStats:
    """Work one member did for one request (from its :class:`~ensemble_core.decoding.members.DecodeStats`),
    and what its vote counted for: ``weight`` (its final weight in the ensemble, the weights sum to 1)
    and ``wins`` (decisions where its own first choice was committed: SAFE's ensemble points,
    every-token's steps, SpecEM's segments, generate-then-select's answer). None for a single model."""

    name: str
    role: str
    forward_passes: int = 0
    tokens_fed: int = 0
    seconds: float = 0.0
    reprefills: int = 0
    weight: float | None = None
    wins: int | None = None
    static_passes: int = 0  # passes run on a static slot (``passes="static"``/``"graphs"``)
    graph_replays: int = 0  # of those, replayed CUDA graphs
    prefix_reused: int = 0  # prompt tokens restored from the member's prefix cache instead of fed

    @classmethod
    def of(cls, state: DecodeState, role: str) -> MemberStats:
        s = state.stats
        return cls(state.member.name, role, s.forward_passes, s.tokens_fed, round(s.seconds, 4), s.reprefills,
                   static_passes=s.static_passes, graph_replays=s.graph_replays, prefix_reused=s.prefix_reused)


@dataclass(eq=False)
class RequestStats(Mapping[str, Any]):
    """What every method reports (see the module docstring).

    A mapping over :meth:`as_dict` (equal to a dict with the same items), so that code that
    reads stats as a dict keeps working.
    """

    method: str
    tokens: int = 0
    rounds: int = 0
    members: list[MemberStats] = field(default_factory=list)
    reliability: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """A plain dict (nested dataclasses become dicts): what leaves the library (JSON, metadata)."""
        return dataclasses.asdict(self)

    def __getitem__(self, key: str) -> Any:
        return self.as_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.as_dict())

    def __len__(self) -> int:
        return len(dataclasses.fields(self))


@dataclass(eq=False)
class TokenLevelStats(RequestStats):
    """Token-level ensembles: how many committed tokens an ensemble decision produced; the fusion rule
    (``sub_tokens``: UniTE's scoring of a string that is not one of a member's tokens, "" for GaC)."""

    distribution: str = "unite"
    sub_tokens: str = ""
    ensembled: int = 0
    e_t: float = 0.0

    def __post_init__(self) -> None:
        self.e_t = self.ensembled / self.tokens if self.tokens else 0.0


@dataclass(eq=False)
class SafeStats(TokenLevelStats):
    """SAFE's counters: every drafted token is either ``accepted`` or ``replaced``; every
    candidate point is ``ensembled``, skipped as unstable (``skipped_oov``) or skipped by
    consensus (``skipped_consensus``). ``prompt_lookup`` and ``draft_confidence`` are the drafting
    levers the request ran with (given, or the drafter's device's default)."""

    drafter: str = ""
    sharpening: str = "heuristic"
    prompt_lookup: int = 0
    draft_confidence: float = 0.0
    skipped_oov: int = 0
    skipped_consensus: int = 0
    drafted: int = 0
    accepted: int = 0
    replaced: int = 0


@dataclass(eq=False)
class SelectionStats(RequestStats):
    """Candidate selection (SpecEM and generate-then-select): who drafted, who judged, phase times."""

    drafters: list[str] = field(default_factory=list)
    verifiers: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class SpecEMStats(SelectionStats):
    """SpecEM: the chosen drafter per round, Hedge weights and their trajectory."""

    segment_length: int = 0
    scoring: str = "logprob"
    normalization: str = "softmax"
    hedge: bool = True
    wins: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    final_weights: list[float] = field(default_factory=list)
    weight_trajectory: list[list[float]] = field(default_factory=list)
    segment_chars: list[int] = field(default_factory=list)
    boundary_fallbacks: int = 0
    abstentions: int = 0


@dataclass(eq=False)
class GenerateThenSelectStats(SelectionStats):
    """Generate-then-select: every member's answer, the verifiers' scores, the chosen member."""

    chosen: int | None = None
    answers: list[dict[str, Any]] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)


def roles(index: int, drafters: list[int], verifiers: list[int]) -> str:
    """``"drafter"``, ``"verifier"`` or ``"drafter+verifier"`` for member ``index``."""
    parts = [name for name, group in (("drafter", drafters), ("verifier", verifiers)) if index in group]
    return "+".join(parts) or "idle"
