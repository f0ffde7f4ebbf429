"""SpecEM / SpecFuse: segment-level ensembling with verify-in-line and online (Hedge) weights.

Lv et al., "SpecEM: Training-Free LLM Ensembling via Iterative Drafting, Verification,
and Online Feedback" (NeurIPS 2025; first published as SpecFuse). Every round:

1. **Draft**: every drafter continues the shared response by up to ``segment_length``
   of its own tokens, from its own context (its chat template + prompt + accepted text).
   A segment ending mid-word is trimmed back to the last space (the next round redrafts
   the word whole), trailing whitespace is left to the next segment, lone U+FFFD is
   dropped. Drafts run on a *branch* of the member's KV cache that is rewound afterwards.
2. **Verify in line**: every verifier scores all candidates in one forward pass over its
   cached context (:mod:`ensemble_core.verify_inline`); a candidate's score is the mean
   per-token log-probability (``scoring="logprob"``, default) or raw logit
   (``"logit"``, the published choice), plus "end here" for a candidate that finished.
   Each verifier's scores are normalised across the candidates (softmax by default:
   the published divide-by-the-sum flips rankings when raw logit means are negative).
3. **Hedge**: per-request weights over the verifiers, starting uniform. Member ``i``
   earns ``gamma_i = max(count, 1) / (K-1)^2``, ``count`` = how often another verifier
   ``j`` scores ``i``'s candidate at least as high as a competitor ``k != i``;
   ``w_i *= exp(eta_t * gamma_i)``, renormalised, ``eta_t = (eta/10) * sqrt(1/K) / t``.
   As in the published code the weights are updated first and then used to select
   ``argmax_c sum_i w_i * s_ic``.
4. **Broadcast**: the chosen text is appended to every member's context; each re-encodes
   only the tail (:func:`~ensemble_core.alignment.encode_continuation`) and crops /
   extends its :class:`~ensemble_core.members.DecodeState`, so caches stay consistent.

Differences from the published code, on purpose: greedy drafting is the default
(published: T 0.6, top-p 0.9, available with ``do_sample=True``); Hedge is on (published:
off by a sentinel); drafters and verifiers are explicit member subsets, and every member
keeps its context whatever its role (published: a verifier that does not draft loses its
state); an empty draft abstains (scored lowest by everyone) instead of becoming the
placeholder " ."; a finished candidate is scored with the verifier's own EOS probability.

Note on K = 2: with the published reward the floor ``max(count, 1)`` makes ``gamma`` equal
to 1 for both members every round, so Hedge cannot move the weights of a pair;
``reward="win-rate"`` (no floor) gives pairs a working signal.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from . import alignment
from .alignment import REPLACEMENT_CHAR, Tokenized, decode_suffix, encode_continuation
from .chat import Prompt
from .errors import ConfigurationError, InvalidOptionError
from .generation import Chunk, EnsembleMethod, GenerationConfig, choose_token, make_generator
from .members import DecodeState, Member
from .verify_inline import SCORING_KINDS, branch_step, cache_branch, check_verifier, score_candidates_inline

NORMALIZATIONS = ("softmax", "minmax", "none")
ETA_DECAYS = ("inverse", "constant")
REWARDS = ("published", "win-rate")
#: Extra tokens a draft may take beyond its length to finish a multi-byte character.
PARTIAL_CHAR_TOKENS = 4
#: Characters that end a word: a segment ending in anything else is cut back to a space.
_WORD_CHARS = "_'’-"


def _check_members_spec(name: str, value: Any) -> tuple[int | str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, (int, str)) else tuple(value)
    ok = all((isinstance(v, int) and not isinstance(v, bool) and v >= 0) or (isinstance(v, str) and v) for v in items)
    if not items or not ok or len(set(items)) != len(items):
        raise InvalidOptionError(name, value, "None (all members) or a non-empty list of distinct member indices or names")
    return items


@dataclass(frozen=True)
class SelectionConfig(GenerationConfig):
    """How candidates are drafted and cross-scored (shared by SpecEM and generate-then-select).

    ``scoring``: ``"logprob"`` (mean token log-probability; comparable across verifiers
    after normalisation and never negative-sum pathological) or ``"logit"`` (mean raw
    logit, the published scorer). ``normalization``: per verifier across candidates,
    ``"softmax"`` (default; positive, sums to 1, order-preserving), ``"minmax"`` or
    ``"none"``. ``drafters`` / ``verifiers``: member indices or names (None: all members).
    ``parallel``: run members in threads (None: automatic, see :func:`use_threads`: when
    they sit on different devices, or on a multi-core CPU).
    """

    scoring: str = "logprob"
    normalization: str = "softmax"
    drafters: tuple[int | str, ...] | None = None
    verifiers: tuple[int | str, ...] | None = None
    parallel: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.scoring not in SCORING_KINDS:
            raise InvalidOptionError("scoring", self.scoring, "one of " + ", ".join(SCORING_KINDS))
        if self.normalization not in NORMALIZATIONS:
            raise InvalidOptionError("normalization", self.normalization, "one of " + ", ".join(NORMALIZATIONS))
        object.__setattr__(self, "drafters", _check_members_spec("drafters", self.drafters))
        object.__setattr__(self, "verifiers", _check_members_spec("verifiers", self.verifiers))
        if self.parallel is not None and not isinstance(self.parallel, bool):
            raise InvalidOptionError("parallel", self.parallel, "True, False or None (automatic)")


@dataclass(frozen=True)
class SpecEMConfig(SelectionConfig):
    """SpecEM options. Defaults: L = 10 (published), log-prob scoring, Hedge on.

    ``eta``: Hedge learning rate; the step is ``eta_t = (eta / 10) * sqrt(1 / K) / t``
    (``eta_decay="inverse"``, published) or without the ``1 / t`` (``"constant"``). The
    published code takes ``eta`` as an integer flag without a recommended value; 10 moves
    a clearly losing member's weight by a few tens of percent over a typical answer.
    ``reward``: ``"published"`` (``max(count, 1) / (K-1)^2``) or ``"win-rate"``
    (``count / (K-1)^2``, informative for K = 2, see the module docstring).
    """

    segment_length: int = 10
    hedge: bool = True
    eta: float = 10.0
    eta_decay: str = "inverse"
    reward: str = "published"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.segment_length, int) or isinstance(self.segment_length, bool) or self.segment_length < 1:
            raise InvalidOptionError("segment_length", self.segment_length, "an integer >= 1 (published default 10)")
        if not isinstance(self.hedge, bool):
            raise InvalidOptionError("hedge", self.hedge, "True or False")
        if isinstance(self.eta, bool) or not isinstance(self.eta, (int, float)) or not 0 < self.eta < math.inf:
            raise InvalidOptionError("eta", self.eta, "a finite number > 0")
        if self.eta_decay not in ETA_DECAYS:
            raise InvalidOptionError("eta_decay", self.eta_decay, "one of " + ", ".join(ETA_DECAYS))
        if self.reward not in REWARDS:
            raise InvalidOptionError("reward", self.reward, "one of " + ", ".join(REWARDS))


# ----------------------------------------------------------------------------- pure pieces
def postprocess_segment(text: str, finished: bool) -> str:
    """Clean one drafted segment (published post-processing, minus its pitfalls).

    Lone U+FFFD (a character cut in half by the token budget) is dropped. A finished
    segment is kept whole. Otherwise trailing whitespace is left to the next round, and a
    segment ending inside a word (a letter, digit, ``_``, ``-`` or apostrophe, with no
    whitespace after it) is cut back to its last whitespace, so that the next
    round redrafts the word whole instead of continuing a fragment; a segment with no
    whitespace to cut at is kept (the published code then drops its last character).
    """
    text = text.replace(REPLACEMENT_CHAR, "")
    if finished:
        return text.rstrip()
    stripped = text.rstrip()
    if not stripped:
        return text  # whitespace only: keep it rather than make no progress
    last = stripped[-1]
    if stripped != text or not (last.isalnum() or last in _WORD_CHARS):
        return stripped  # the last word is complete (whitespace or punctuation follows it)
    cut = max(stripped.rfind(c) for c in (" ", "\n", "\t"))
    head = stripped[:cut].rstrip() if cut > 0 else ""
    return head or stripped


def normalize_scores(scores: Sequence[float], how: str) -> list[float]:
    """One verifier's candidate scores made comparable across verifiers (``-inf``: abstained)."""
    finite = [s for s in scores if s != -math.inf]
    if how == "none" or not finite:
        return [float(s) for s in scores]
    if how == "softmax":
        top = max(finite)
        exps = [math.exp(s - top) if s != -math.inf else 0.0 for s in scores]
        total = sum(exps)
        return [e / total for e in exps]
    lo, hi = min(finite), max(finite)
    return [0.0 if s == -math.inf else (1.0 if hi == lo else (s - lo) / (hi - lo)) for s in scores]


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
    """Multiplicative-weights update, renormalised (computed in log space: no overflow)."""
    logs = [math.log(w) + eta_t * r for w, r in zip(weights, rewards)]
    top = max(logs)
    exps = [math.exp(v - top) for v in logs]
    total = sum(exps)
    return [e / total for e in exps]


def select_candidate(weights: Sequence[float], scores: Sequence[Sequence[float]]) -> tuple[int, list[float]]:
    """``argmax_c sum_v w_v * s_vc`` (ties: the first candidate); also returns the totals."""
    totals = []
    for c in range(len(scores[0])):
        col = [scores[v][c] for v in range(len(scores))]
        totals.append(-math.inf if any(s == -math.inf for s in col) else sum(w * s for w, s in zip(weights, col)))
    best = max(range(len(totals)), key=lambda c: (totals[c], -c))
    return best, totals


# ----------------------------------------------------------------------------- request state
@dataclass
class Track:
    """One member's side of a request: its decoding state and its view of the shared text.

    ``view`` tokenizes ``lead + shared text`` and its ids are exactly
    ``state.response_ids``; ``lead`` is the whitespace this member's transcript puts
    before a response (" " after a plain "Assistant:", nothing after a chat template's
    generation prompt), applied once the shared text is non-empty.
    """

    member: Member
    state: DecodeState
    lead: str
    view: Tokenized
    generator: torch.Generator | None

    def piece(self, shared: str, new: str) -> str:
        """The text this member appends for ``new`` after the shared text ``shared``."""
        return (self.lead if not shared else "") + new

    def continuation(self, shared: str, new: str) -> tuple[int, Tokenized]:
        return encode_continuation(self.member.tokenizer, self.view.text + self.piece(shared, new), self.view)

    def commit(self, keep: int, view: Tokenized) -> None:
        """Crop / extend the decoding state to ``view`` (``keep`` leading ids unchanged)."""
        if keep < len(self.view):
            self.state.crop(self.state.prompt_len + keep)
        self.state.extend(view.ids[keep:])
        self.view = view


@dataclass
class Candidate:
    """One drafter's segment in the shared (canonical) text, and how it ended."""

    member: int
    text: str
    end: str | None = None  # None (more to come), "eos" or "stop"
    tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.end is not None


def start_tracks(members: Sequence[Member], prompt: Prompt, config: GenerationConfig) -> list[Track]:
    """A fresh track per member (raises PromptTooLongError like ``Member.start``)."""
    tracks = []
    for i, m in enumerate(members):
        seeded = config.replace(seed=config.seed + i) if config.do_sample and config.seed is not None else config
        tracks.append(Track(m, m.start(prompt, config.max_new_tokens), m.response_lead(prompt),
                            alignment.tokenize(m.tokenizer, ""), make_generator(seeded)))
    return tracks


def resolve_roles(members: Sequence[Member], config: SelectionConfig) -> tuple[list[int], list[int]]:
    """Drafter and verifier indices (member order); every member must have a role."""

    def resolve(spec: tuple[int | str, ...] | None, what: str) -> list[int]:
        if spec is None:
            return list(range(len(members)))
        out = set()
        names = [m.name for m in members]
        for item in spec:
            if isinstance(item, int):
                if item >= len(members):
                    raise InvalidOptionError(what, spec, f"member indices below {len(members)} or names among {names}")
                out.add(item)
            else:
                hits = [i for i, n in enumerate(names) if n == item]
                if len(hits) != 1:
                    problem = "no member" if not hits else "several members"
                    raise ConfigurationError(f"{what}: {problem} named {item!r} (members: {names}); use indices instead.")
                out.add(hits[0])
        return sorted(out)

    drafters, verifiers = resolve(config.drafters, "drafters"), resolve(config.verifiers, "verifiers")
    idle = [members[i].name for i in range(len(members)) if i not in drafters and i not in verifiers]
    if idle:
        raise ConfigurationError(f"Member(s) {idle} neither draft nor verify; drop them or add them to drafters/verifiers.")
    for i in verifiers:
        check_verifier(members[i])
    return drafters, verifiers


T = TypeVar("T")
R = TypeVar("R")


def run_all(fn: Callable[[T], R], items: Sequence[T], parallel: bool) -> list[R]:
    """``[fn(x) for x in items]``, in threads when ``parallel`` (see :func:`use_threads`)."""
    if not parallel or len(items) < 2:
        return [fn(x) for x in items]
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


def use_threads(members: Sequence[Member], config: SelectionConfig) -> bool:
    """Whether members draft and verify in threads (``config.parallel``; None: automatic).

    Automatic: yes when the members sit on different devices, or when they all sit on the
    CPU of a machine with several cores (measured on 2 cores with the bundled pair: time to
    first segment 1.7-1.8 s instead of 2.2-2.4 s, a 64-token answer 21 % faster), but only
    when no two members share a model or tokenizer object (a fast tokenizer used from two
    threads at once raises "Already borrowed"). Several members on one GPU stay sequential:
    their kernels share the device anyway.
    """
    if config.parallel is not None:
        return config.parallel
    devices = {str(m.device) for m in members}
    if len(devices) > 1:
        return True
    distinct = len({id(m.model) for m in members}) == len({id(m.tokenizer) for m in members}) == len(members)
    return distinct and devices == {"cpu"} and (os.cpu_count() or 1) > 1


# ----------------------------------------------------------------------------- draft / verify
def _find_stop(text: str, stops: Sequence[str]) -> int:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@torch.inference_mode()
def draft(track: Track, index: int, length: int, config: GenerationConfig, stops: Sequence[str], shared: str,
          trim: bool = True) -> Candidate:
    """Up to ``length`` tokens from ``track``'s context, as a cleaned segment of shared text.

    The draft runs on a cache branch (rewound afterwards): the state keeps its context
    and the row after it, which verification reuses. A draft stops at EOS, at a stop
    string (cut before it) or at ``length`` tokens (a few more if the last character is
    unfinished).
    """
    state, member = track.state, track.member
    row = state.score()[-1]
    tail = shared[-max((len(s) for s in stops), default=1):] if stops else ""
    ids: list[int] = []
    end: str | None = None
    text = ""
    with cache_branch(state):
        while True:
            probs = torch.softmax(row, dim=-1) if config.do_sample else row
            token = choose_token(probs, config, track.generator)
            if token in member.eos_token_ids:
                end = "eos"
                break
            ids.append(token)
            if stops or len(ids) >= length:
                text = decode_suffix(member.tokenizer, state.ids, ids)
            if stops:
                at = _find_stop(tail + text, stops)
                if at >= 0:
                    text, end = text[: max(at - len(tail), 0)], "stop"
                    break
            if len(ids) >= length and not (text.endswith(REPLACEMENT_CHAR) and len(ids) < length + PARTIAL_CHAR_TOKENS):
                break
            row = branch_step(state, token)
    if end != "stop":
        text = decode_suffix(member.tokenizer, state.ids, ids) if ids else ""
    if not shared:
        text = text.lstrip()
    if trim:
        text = postprocess_segment(text, end is not None)
    else:
        text = text.replace(REPLACEMENT_CHAR, "")
    return Candidate(index, text, end, len(ids))


def candidate_ids(track: Track, shared: str, candidate: Candidate) -> tuple[list[int], bool]:
    """This member's token ids for ``candidate``, and whether they continue its context exactly.

    The candidate is encoded as a continuation of the member's own text; if that would
    re-tokenize already-accepted tokens (a merge across the boundary), the candidate is
    encoded on its own instead (returned flag False) so that it can still be scored
    behind the cached context.
    """
    if not candidate.text:
        return [], True
    keep, view = track.continuation(shared, candidate.text)
    if keep == len(track.view):
        return list(view.ids[keep:]), True
    return list(alignment.tokenize(track.member.tokenizer, track.piece(shared, candidate.text)).ids), False


def verify(track: Track, shared: str, candidates: Sequence[Candidate], scoring: str) -> tuple[list[float], int]:
    """Raw scores (mean per-token value; ``-inf`` for an abstention) and the boundary fallbacks.

    Identical candidates (members that agree) are scored once, so they tie exactly.
    """
    unique: dict[tuple[str, bool], int] = {}
    for c in candidates:
        unique.setdefault((c.text, c.finished), len(unique))
    firsts = [next(c for c in candidates if (c.text, c.finished) == key) for key in unique]
    encoded = [candidate_ids(track, shared, c) for c in firsts]
    values = score_candidates_inline(track.state, [ids for ids, _ in encoded], scoring, [c.finished for c in firsts])
    raw = [float(v.mean()) if len(v) else -math.inf for v in values]
    return [raw[unique[(c.text, c.finished)]] for c in candidates], sum(not exact for _, exact in encoded)


# ----------------------------------------------------------------------------- the method
@dataclass
class SpecEMRequest:
    tracks: list[Track]
    config: SpecEMConfig
    drafters: list[int]
    verifiers: list[int]
    weights: list[float]
    stops: tuple[str, ...]
    parallel: bool
    text: str = ""
    rounds: int = 0
    wins: list[int] = field(default_factory=list)
    chosen: list[int] = field(default_factory=list)
    trajectory: list[list[float]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "verify": 0.0, "update": 0.0})
    fallbacks: int = 0
    abstentions: int = 0
    segment_chars: list[int] = field(default_factory=list)


def finish_text(track: Track, shared: str, text: str, limit: int) -> tuple[str, bool, int, Tokenized]:
    """Cut ``text`` so that the primary member's response stays within ``limit`` tokens.

    Returns ``(text, cut, keep, view)`` with the primary's new tokenization.
    """
    keep, view = track.continuation(shared, text)
    if len(view) <= limit:
        return text, False, keep, view
    n = limit
    while n > 0 and not view.valid[n - 1]:
        n -= 1
    end = view.ends[n - 1] if n else 0
    lead = len(track.piece(shared, text)) - len(text)
    room = max(end - len(track.view.text) - lead, 0)
    return text[:room], True, keep, view


class SpecEMEnsemble(EnsembleMethod[SpecEMConfig]):
    """SpecEM: all members draft a segment, all verify it in line, Hedge weights select."""

    name = "specem"
    config_class = SpecEMConfig
    min_members = 2

    def __init__(self, members: Sequence[Member], config: SpecEMConfig | None = None, **options: Any) -> None:
        super().__init__(members, config, **options)
        resolve_roles(self.members, self.config)  # fail at construction, not at the first request

    def begin(self, prompt: Prompt, config: SpecEMConfig) -> SpecEMRequest:
        drafters, verifiers = resolve_roles(self.members, config)
        tracks = start_tracks(self.members, prompt, config)
        k = len(verifiers)
        return SpecEMRequest(tracks, config, drafters, verifiers, [1.0 / k] * k, self.stop_strings(config),
                             use_threads(self.members, config), wins=[0] * len(self.members))

    def prompt_tokens(self, request: SpecEMRequest) -> int:
        return request.tracks[0].state.prompt_len

    def step(self, request: SpecEMRequest) -> Chunk:
        cfg, tracks, shared = request.config, request.tracks, request.text
        request.rounds += 1
        t0 = time.perf_counter()
        budget = cfg.max_new_tokens - len(tracks[0].view)
        length = max(1, min(cfg.segment_length, budget))
        candidates = run_all(lambda i: draft(tracks[i], i, length, cfg, request.stops, shared),
                             request.drafters, request.parallel)
        t1 = time.perf_counter()
        request.seconds["draft"] += t1 - t0
        if all(not c.text and not c.finished for c in candidates):  # everyone abstained: nothing left to say
            request.seconds["update"] += time.perf_counter() - t1
            return Chunk("", done=True, finish_reason="eos")
        request.abstentions += sum(not c.text and not c.finished for c in candidates)
        verified = run_all(lambda v: verify(tracks[v], shared, candidates, cfg.scoring), request.verifiers,
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
        tracks, shared = request.tracks, request.text
        text, cut, keep, view = finish_text(tracks[0], shared, chosen.text, request.config.max_new_tokens)
        request.segment_chars.append(len(text))
        if cut or (len(view) >= request.config.max_new_tokens and not chosen.finished):
            return Chunk(text, done=True, finish_reason="length")
        if chosen.finished:
            return Chunk(text, done=True, finish_reason=chosen.end)
        tracks[0].commit(keep, view)
        for track in tracks[1:]:
            track.commit(*track.continuation(shared, text))
        request.text = shared + text
        return Chunk(text)

    def stats(self, request: SpecEMRequest) -> dict[str, Any]:
        names = [m.name for m in self.members]
        cfg = request.config
        return {
            "method": self.name,
            "members": names,
            "drafters": [names[i] for i in request.drafters],
            "verifiers": [names[i] for i in request.verifiers],
            "segment_length": cfg.segment_length,
            "scoring": cfg.scoring,
            "normalization": cfg.normalization,
            "hedge": cfg.hedge,
            "rounds": request.rounds,
            "wins": list(request.wins),
            "chosen": list(request.chosen),
            "final_weights": [round(w, 6) for w in request.weights],
            "weight_trajectory": [list(w) for w in request.trajectory],
            "seconds": {k: round(v, 4) for k, v in request.seconds.items()},
            "segment_chars": list(request.segment_chars),
            "boundary_fallbacks": request.fallbacks,
            "abstentions": request.abstentions,
            "per_member": [{"name": t.member.name, "forward_passes": t.state.stats.forward_passes,
                            "tokens_fed": t.state.stats.tokens_fed, "seconds": round(t.state.stats.seconds, 4),
                            "reprefills": t.state.stats.reprefills} for t in request.tracks],
        }
