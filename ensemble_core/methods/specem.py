"""SpecEM / SpecFuse: segment-level ensembling with verify-in-line and online (Hedge) weights.

Lv et al., "SpecEM: Training-Free LLM Ensembling via Iterative Drafting, Verification,
and Online Feedback" (NeurIPS 2025; first published as SpecFuse). Every round:

1. **Draft**: every drafter continues the shared response by up to ``segment_length``
   of its own tokens, from its own context (its chat template + prompt + accepted text).
   A segment ending mid-word is trimmed back to the last space (the next round redrafts
   the word whole), trailing whitespace is left to the next segment, lone U+FFFD is
   dropped. Drafts run on a *branch* of the member's KV cache that is rewound afterwards.
2. **Verify in line**: every verifier scores all candidates in one forward pass over its
   cached context (:mod:`ensemble_core.decoding.verify_inline`); a candidate's score is the mean
   per-token log-probability (``scoring="logprob"``, default) or raw logit
   (``"logit"``, the published choice), plus "end here" for a candidate that finished.
   Each verifier's scores are normalised across the candidates (softmax by default:
   the published divide-by-the-sum flips rankings when raw logit means are negative).
3. **Hedge**: per-request weights over the verifiers, starting uniform. Member ``i``
   earns ``gamma_i = count / (K-1)^2`` (``reward="win-rate"``, the default; published:
   ``max(count, 1) / (K-1)^2``), ``count`` = how often another verifier ``j`` scores
   ``i``'s candidate at least as high as a competitor ``k != i``;
   ``w_i *= exp(eta_t * gamma_i)``, renormalised, ``eta_t = (eta/10) * sqrt(1/K) / t``.
   As in the published code the weights are updated first and then used to select
   ``argmax_c sum_i w_i * s_ic``.
4. **Broadcast**: the chosen text is appended to every member's context; each re-encodes
   only the tail (:func:`~ensemble_core.text.alignment.encode_continuation`) and crops /
   extends its :class:`~ensemble_core.decoding.members.DecodeState`, so caches stay consistent.

Differences from the published code, on purpose: greedy drafting is the default
(published: T 0.6, top-p 0.9, available with ``do_sample=True``); Hedge is on (published:
off by a sentinel); drafters and verifiers are explicit member subsets, and every member
keeps its context whatever its role (published: a verifier that does not draft loses its
state); an empty draft abstains (scored lowest by everyone) instead of becoming the
placeholder " ."; a finished candidate is scored with the verifier's own EOS probability.

Why win-rate is the default: with K = 2 the published floor ``max(count, 1)`` makes
``gamma`` equal to 1 for both members every round (``count`` is 0 or 1 and ``(K-1)^2 = 1``),
so Hedge cannot move the weights of a pair, the most common configuration, while its stats
say ``hedge: true``. Without the floor the reward is the share of (judge, rival) pairs the
member wins, for every K; for K >= 3 the two differ only in the rounds where a member wins
nothing. ``reward="published"`` keeps the paper's formula (measured comparison:
docs/benchmarks.md, "Hedge reward").
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from ensemble_core.decoding.generation import Chunk, EnsembleMethod
from ensemble_core.decoding.lookup import guesses_now
from ensemble_core.decoding.stats import MemberStats, SpecEMStats, roles
from ensemble_core.decoding.view import MemberView, start_views
from ensemble_core.methods.reliability import Votes, check_weights, member_weights
from ensemble_core.methods.selection import (
    Candidate,
    SelectionConfig,
    commit_segment,
    draft,
    finish_text,
    normalize_scores,
    resolve_roles,
    run_all,
    select_candidate,
    use_threads,
    verify,
)
from ensemble_core.options import check_bool, check_choice, check_int, check_number
from ensemble_core.text.chat import Prompt

ETA_DECAYS = ("inverse", "constant")
REWARDS = ("published", "win-rate")


@dataclass(frozen=True)
class SpecEMConfig(SelectionConfig):
    """SpecEM options. Defaults: L = 10 (published), log-prob scoring, Hedge on.

    ``eta``: Hedge learning rate; the step is ``eta_t = (eta / 10) * sqrt(1 / K) / t``
    (``eta_decay="inverse"``, published) or without the ``1 / t`` (``"constant"``). The
    published code takes ``eta`` as an integer flag without a recommended value; 10 moves
    a clearly losing member's weight by a few tens of percent over a typical answer.
    ``reward``: ``"win-rate"`` (``count / (K-1)^2``, default: it learns for every K) or
    ``"published"`` (``max(count, 1) / (K-1)^2``: constant for a pair, see the module docstring).
    Hedge's starting weights: ``reliability`` (:class:`~ensemble_core.options.ReliabilityOptions`;
    default ``"prior"``: by body size, a member without a chat template a quarter of that;
    ``"none"``: uniform, as published; or ``reliability_weights`` from a calibration).
    """

    segment_length: int = 10
    hedge: bool = True
    eta: float = 10.0
    eta_decay: str = "inverse"
    reward: str = "win-rate"

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("segment_length", self.segment_length, 1, expected="an integer >= 1 (published default 10)")
        check_bool("hedge", self.hedge)
        check_number("eta", self.eta, 0, above=True, finite=True, expected="a finite number > 0")
        check_choice("eta_decay", self.eta_decay, ETA_DECAYS)
        check_choice("reward", self.reward, REWARDS)


# ----------------------------------------------------------------------------- Hedge
def hedge_rewards(scores: Sequence[Sequence[float]], verifiers: Sequence[int], drafters: Sequence[int],
                  floor: bool = True) -> list[float]:
    """Hedge reward of every verifier (``scores[v][c]``: verifier ``v``'s score of drafter ``c``).

    Member ``i`` counts the pairs (verifier ``j != i``, competitor ``k != i``) where ``j``
    scores ``i``'s candidate at least as high as ``k``'s, divided by the number of pairs
    (``(K-1)^2`` when everyone drafts and verifies), floored at one pair when ``floor``.
    A verifier that drafts nothing (or has nobody to judge it) gets the mean reward of
    the others, which keeps its share of the weight where it is.
    """
    rewards: list[float | None] = []
    for i in verifiers:
        judges = [b for b, j in enumerate(verifiers) if j != i]
        rivals = [c for c, k in enumerate(drafters) if k != i]
        if i not in drafters or not judges or not rivals:
            rewards.append(None)
            continue
        own = drafters.index(i)
        count = sum(scores[b][own] >= scores[b][c] for b in judges for c in rivals)
        rewards.append((max(count, 1) if floor else count) / (len(judges) * len(rivals)))
    known = [r for r in rewards if r is not None]
    neutral = sum(known) / len(known) if known else 0.0
    return [neutral if r is None else r for r in rewards]


def hedge_step(eta: float, verifiers: int, t: int, decay: str = "inverse") -> float:
    """``eta_t = (eta / 10) * sqrt(1 / K) / t`` (published), or without ``1 / t``."""
    base = (eta / 10.0) * math.sqrt(1.0 / verifiers)
    return base / t if decay == "inverse" else base


def hedge_update(weights: Sequence[float], rewards: Sequence[float], eta_t: float) -> list[float]:
    """Multiplicative-weights update, renormalised (computed in log space: no overflow).

    A weight of 0 (a member a calibration took the vote from) stays 0."""
    logs = [math.log(w) + eta_t * r if w > 0 else -math.inf for w, r in zip(weights, rewards)]
    top = max(logs)
    exps = [math.exp(v - top) for v in logs]
    total = sum(exps)
    return [e / total for e in exps]


# ----------------------------------------------------------------------------- the method
@dataclass
class SpecEMRequest:
    views: list[MemberView]
    config: SpecEMConfig
    drafters: list[int]
    verifiers: list[int]
    weights: list[float]
    stops: tuple[str, ...]
    parallel: bool
    text: str = ""
    last: str = ""
    rounds: int = 0
    wins: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    trajectory: list[list[float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "verify": 0.0, "update": 0.0})
    fallbacks: int = 0
    abstentions: int = 0
    segment_chars: list[int] = field(default_factory=list)
    votes: Votes | None = None  # the members' starting weights (their source) for the stats


class SpecEMEnsemble(EnsembleMethod[SpecEMConfig]):
    """SpecEM: all members draft a segment, all verify it in line, Hedge weights select."""

    name = "specem"
    config_class = SpecEMConfig
    min_members = 2

    def check(self, config: SpecEMConfig) -> None:
        resolve_roles(self.members, config)
        check_weights(self.members, config)

    def begin(self, prompt: Prompt, config: SpecEMConfig) -> SpecEMRequest:
        drafters, verifiers = resolve_roles(self.members, config)
        views = start_views(self.members, prompt, config, seeded=True)
        weights = member_weights(self.members, config, prompt)  # Hedge starts from the prior (uniform: reliability="none")
        return SpecEMRequest(views, config, drafters, verifiers, weights.of(verifiers), self.stop_strings(config),
                             use_threads(self.members, config), wins=[0] * len(self.members), votes=Votes.start(weights))


    def step(self, request: SpecEMRequest) -> Chunk:
        cfg, views, shared = request.config, request.views, request.text
        request.rounds += 1
        t0 = time.perf_counter()
        budget = cfg.max_new_tokens - len(views[0].tokens)
        length = max(1, min(cfg.segment_length, budget))
        for view in views:
            view.pipeline.set_budget(budget)  # closing pressure near the end, under a grammar
        # asked in the request's thread: the drafting pool's threads have no binding
        lookup = guesses_now(cfg.prompt_lookup or 0, cfg.prompt_lookup_max_requests)  # None: 0, nothing measured faster
        candidates = run_all(lambda i: draft(views[i], i, length, request.stops, shared, lookup=lookup),
                             request.drafters, request.parallel)
        t1 = time.perf_counter()
        request.seconds["draft"] += t1 - t0
        if all(not c.text and not c.finished for c in candidates):  # everyone abstained: nothing left to say
            request.seconds["update"] += time.perf_counter() - t1
            return Chunk("", done=True, finish_reason="eos")
        request.abstentions += sum(not c.text and not c.finished for c in candidates)
        verified = run_all(lambda v: verify(views[v], shared, candidates, cfg.scoring, v), request.verifiers,
                           request.parallel)
        scores = [normalize_scores(raw, cfg.normalization) for raw, _ in verified]
        request.fallbacks += sum(n for _, n in verified)
        t2 = time.perf_counter()
        request.seconds["verify"] += t2 - t1
        if cfg.hedge:
            rewards = hedge_rewards(scores, request.verifiers, request.drafters, floor=cfg.reward == "published")
            eta_t = hedge_step(cfg.eta, len(request.verifiers), request.rounds, cfg.eta_decay)
            request.weights = hedge_update(request.weights, rewards, eta_t)
        request.trajectory.append([round(w, 6) for w in request.weights])
        best, _ = select_candidate(request.weights, scores)
        chosen = candidates[best]
        request.wins[chosen.member] += 1
        request.chosen.append(chosen.member)
        chunk = self._commit(request, chosen)
        request.seconds["update"] += time.perf_counter() - t2
        return chunk

    def _commit(self, request: SpecEMRequest, chosen: Candidate) -> Chunk:
        """Append the chosen segment everywhere, or finish (EOS, stop string, token budget)."""
        views, shared = request.views, request.text
        text, cut, keep, tokens = finish_text(views[0], shared, chosen.text, request.config.max_new_tokens)
        request.segment_chars.append(len(text))
        if cut or chosen.finished or len(tokens) >= request.config.max_new_tokens:
            request.last = text  # the final segment is returned, not committed to the members' states
        if cut or (len(tokens) >= request.config.max_new_tokens and not chosen.finished):
            return Chunk(text, done=True, finish_reason="length")
        if chosen.finished:
            return Chunk(text, done=True, finish_reason=chosen.end)
        commit_segment(views, shared, text, keep, tokens)
        request.text = shared + text
        return Chunk(text)

    def stats(self, request: SpecEMRequest) -> SpecEMStats:
        names = [m.name for m in self.members]
        cfg = request.config
        return SpecEMStats(
            method=self.name, tokens=self.primary.count_tokens(request.text + request.last) if request.text + request.last else 0,
            rounds=request.rounds,
            members=self._members_stats(request), reliability=request.votes.source if request.votes else None,
            drafters=[names[i] for i in request.drafters], verifiers=[names[i] for i in request.verifiers],
            seconds={k: round(v, 4) for k, v in request.seconds.items()},
            segment_length=cfg.segment_length, scoring=cfg.scoring, normalization=cfg.normalization, hedge=cfg.hedge,
            wins=list(request.wins), chosen=list(request.chosen),
            final_weights=[round(w, 6) for w in request.weights],
            weight_trajectory=[list(w) for w in request.trajectory],
            segment_chars=list(request.segment_chars), boundary_fallbacks=request.fallbacks,
            abstentions=request.abstentions,
        )

    @staticmethod
    def _members_stats(request: SpecEMRequest) -> list[MemberStats]:
        """Each member's work, its final Hedge weight (0 for a member that only drafts) and its chosen segments."""
        members = [MemberStats.of(v.state, roles(i, request.drafters, request.verifiers))
                   for i, v in enumerate(request.views)]
        final = [0.0] * len(members)
        for i, w in zip(request.verifiers, request.weights):
            final[i] = w
        for stats, weight, wins in zip(members, final, request.wins):
            stats.weight, stats.wins = round(weight, 6), wins
        return members
