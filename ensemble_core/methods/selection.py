"""Selecting among whole candidates: drafting them, cross-scoring them, finishing the text.

Shared by SpecEM (segment by segment, :mod:`ensemble_core.methods.specem`) and the
generate-then-select baseline (whole answers, :mod:`ensemble_core.methods.single`):

* :func:`draft`: a member continues the shared text by up to ``length`` of its own tokens
  on a branch of its KV cache (rewound afterwards), stopping at EOS or a stop string; the
  segment is cleaned by :func:`postprocess_segment`;
* :func:`verify`: a verifier scores every candidate in ONE packed forward pass over its
  cached context (:mod:`ensemble_core.decoding.verify_inline`), except its own draft, whose scores
  it kept while drafting (:class:`DraftScores`);
* :func:`normalize_scores` / :func:`select_candidate`: per-verifier normalisation and the
  weighted choice;
* :func:`finish_text`: the chosen text cut to the token budget at a valid boundary;
* :func:`resolve_roles`, :func:`use_threads`, :func:`run_all`: which members draft and
  verify, and whether they run in threads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from ensemble_core.decoding.drafting import DraftScores, draft_segment, find_stop
from ensemble_core.decoding.generation import GenerationConfig
from ensemble_core.decoding.members import Member
from ensemble_core.decoding.runner import is_quiet, member_thread
from ensemble_core.decoding.scheduler import concurrent_requests, member_threads
from ensemble_core.decoding.verify_inline import (
    SCORING_KINDS,
    check_verifier,
    score_candidates_inline,
)
from ensemble_core.decoding.view import MemberView
from ensemble_core.errors import ConfigurationError, InvalidOptionError
from ensemble_core.options import PromptLookupOptions, ReliabilityOptions, check_bool, check_choice, is_int
from ensemble_core.text import alignment
from ensemble_core.text.alignment import REPLACEMENT_CHAR, Tokenized
from ensemble_core.transfer import read_together

NORMALIZATIONS = ("softmax", "minmax", "none")
#: Characters that end a word: a segment ending in anything else is cut back to a space.
_WORD_CHARS = "_'’-"


def _check_members_spec(name: str, value: Any) -> tuple[int | str, ...] | None:
    if value is None:
        return None
    items = (value,) if isinstance(value, (int, str)) else tuple(value)
    ok = all((is_int(v) and v >= 0) or (isinstance(v, str) and v) for v in items)
    if not items or not ok or len(set(items)) != len(items):
        raise InvalidOptionError(name, value, "None (all members) or a non-empty list of distinct member indices or names")
    return items


@dataclass(frozen=True)
class SelectionConfig(GenerationConfig, PromptLookupOptions, ReliabilityOptions):
    """How candidates are drafted and cross-scored (shared by SpecEM and generate-then-select).

    ``scoring``: ``"logprob"`` (mean token log-probability; comparable across verifiers
    after normalisation and never negative-sum pathological) or ``"logit"`` (mean raw
    logit, the published scorer). ``normalization``: per verifier across candidates,
    ``"softmax"`` (default; positive, sums to 1, order-preserving), ``"minmax"`` or
    ``"none"``. ``drafters`` / ``verifiers``: member indices or names (None: all members).
    ``parallel``: run members in threads (None: automatic, see :func:`use_threads`: when
    they sit on different devices, or on a multi-core CPU). Each drafter's prompt lookup
    (``prompt_lookup``, ``prompt_lookup_max_requests``) is
    :class:`~ensemble_core.options.PromptLookupOptions`: the same candidates in fewer passes.
    How much each verifier's judgement counts (``reliability``, default ``"prior"``; ``"none"``:
    uniform, as published) is :class:`~ensemble_core.options.ReliabilityOptions`
    (:mod:`~ensemble_core.methods.reliability`).
    """

    scoring: str = "logprob"
    normalization: str = "softmax"
    drafters: tuple[int | str, ...] | None = None
    verifiers: tuple[int | str, ...] | None = None
    parallel: bool | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_choice("scoring", self.scoring, SCORING_KINDS)
        check_choice("normalization", self.normalization, NORMALIZATIONS)
        object.__setattr__(self, "drafters", _check_members_spec("drafters", self.drafters))
        object.__setattr__(self, "verifiers", _check_members_spec("verifiers", self.verifiers))
        check_bool("parallel", self.parallel, "True, False or None (automatic)", optional=True)


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


def select_candidate(weights: Sequence[float], scores: Sequence[Sequence[float]]) -> tuple[int, list[float]]:
    """``argmax_c sum_v w_v * s_vc`` (ties: the first candidate); also returns the totals."""
    totals = []
    for c in range(len(scores[0])):
        col = [scores[v][c] for v in range(len(scores))]
        totals.append(-math.inf if any(s == -math.inf for s in col) else sum(w * s for w, s in zip(weights, col)))
    best = max(range(len(totals)), key=lambda c: (totals[c], -c))
    return best, totals


@dataclass
class Candidate:
    """One drafter's segment in the shared (canonical) text, and how it ended."""

    member: int
    text: str
    end: str | None = None  # None (more to come), "eos" or "stop"
    tokens: int = 0
    #: the drafter's own scores of its draft (None: verify it like any other candidate)
    scores: DraftScores | None = None

    @property
    def finished(self) -> bool:
        return self.end is not None


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
    quiet_request, alone = is_quiet(), concurrent_requests() <= 1
    with member_threads(len(items)) as done:

        def work(x: T) -> R:
            try:
                with member_thread(quiet_request, alone):  # how its passes run (decoding.runner)
                    return fn(x)
            finally:
                done()

        with ThreadPoolExecutor(max_workers=len(items), thread_name_prefix="ensemble-member") as pool:
            return list(pool.map(work, items))


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


@torch.inference_mode()
def draft(view: MemberView, index: int, length: int, stops: Sequence[str], shared: str, trim: bool = True,
          lookup: int = 0) -> Candidate:
    """Up to ``length`` tokens from ``view``'s context, as a cleaned segment of shared text.

    The draft runs on a cache branch (rewound afterwards): the state keeps its context
    and the row after it, which verification reuses. A draft stops at EOS, at a stop
    string (cut before it; one that began in ``shared`` is kept to its end, so that the generation
    loop, which sees the whole answer, cuts before it) or at ``length`` tokens (a few more if the last character is
    unfinished). ``lookup``: prompt-lookup guesses per pass (``SelectionConfig.prompt_lookup``).
    """
    tail = shared[-max((len(s) for s in stops), default=1):] if stops else ""
    mark = view.pipeline.checkpoint()  # a constrained request: draft under this member's own grammar
    ids, end, text, scores = draft_segment(view.state, length, view.pipeline, stops, tail, lookup)
    view.pipeline.restore(mark)  # the grammar follows the committed text, not this draft
    if not shared:
        text = text.lstrip()
    if end == "stop" and find_stop(tail + text, stops) >= 0:
        pass  # the rest of a stop string that began in the shared text, kept whole for the loop to cut at
    elif trim:
        text = postprocess_segment(text, end is not None)
    else:
        text = text.replace(REPLACEMENT_CHAR, "")
    return Candidate(index, text, end, len(ids), scores)


def candidate_ids(view: MemberView, shared: str, candidate: Candidate) -> tuple[list[int], bool]:
    """This member's token ids for ``candidate``, and whether they continue its context exactly.

    The candidate is encoded as a continuation of the member's own text; if that would
    re-tokenize already-accepted tokens (a merge across the boundary), the candidate is
    encoded on its own instead (returned flag False) so that it can still be scored
    behind the cached context.
    """
    if not candidate.text:
        return [], True
    keep, tokens = view.appended(shared, candidate.text)
    if keep == len(view.tokens):
        return list(tokens.ids[keep:]), True
    return list(alignment.tokenize(view.member.tokenizer, view.piece(shared, candidate.text)).ids), False


def verify(view: MemberView, shared: str, candidates: Sequence[Candidate], scoring: str,
           index: int | None = None) -> tuple[list[float], int]:
    """Raw scores (mean per-token value; ``-inf`` for an abstention) and the boundary fallbacks.

    Identical candidates (members that agree) are scored once, so they tie exactly. The
    verifier's own candidate (``index``: its member index) is scored from the
    :class:`DraftScores` it kept while drafting when they cover its encoding; only the
    others go into the packed pass.
    """
    unique: dict[tuple[str, bool], int] = {}
    for c in candidates:
        unique.setdefault((c.text, c.finished), len(unique))
    firsts = [next(c for c in candidates if (c.text, c.finished) == key) for key in unique]
    encoded = [candidate_ids(view, shared, c) for c in firsts]
    values: list[torch.Tensor | None] = [None] * len(firsts)
    for u, key in enumerate(unique):
        own = next((c.scores for c in candidates if c.member == index and (c.text, c.finished) == key), None)
        if own is not None:
            values[u] = own.values(encoded[u][0], key[1], scoring)
    todo = [u for u, v in enumerate(values) if v is None]
    if todo:
        scored = score_candidates_inline(view.state, [encoded[u][0] for u in todo], scoring,
                                         [firsts[u].finished for u in todo])
        for u, v in zip(todo, scored):
            values[u] = v
    nonempty = [(u, v) for u, v in enumerate(values) if v is not None and len(v)]
    means = read_together([v.mean().reshape(1) for _, v in nonempty])  # one read for all candidates (#38)
    raw = [-math.inf] * len(values)
    for (u, _), (mean,) in zip(nonempty, means):
        raw[u] = mean
    return [raw[unique[(c.text, c.finished)]] for c in candidates], sum(not exact for _, exact in encoded)


def finish_text(view: MemberView, shared: str, text: str, limit: int) -> tuple[str, bool, int, Tokenized]:
    """Cut ``text`` so that the primary member's response stays within ``limit`` tokens.

    Returns ``(text, cut, keep, tokens)`` with the primary's new tokenization.
    """
    keep, tokens = view.appended(shared, text)
    if len(tokens) <= limit:
        return text, False, keep, tokens
    end = tokens.end(tokens.last_boundary(limit))
    lead = len(view.piece(shared, text)) - len(text)
    room = max(end - len(view.tokens.text) - lead, 0)
    return text[:room], True, keep, tokens


def commit_segment(views: Sequence[MemberView], shared: str, text: str, keep: int, tokens: Tokenized) -> None:
    """Append ``text`` after the shared text ``shared`` in every member, and advance their grammars.

    ``keep`` / ``tokens`` are the primary member's (``views[0]``) new tokenization, as
    :func:`finish_text` returned it; every other member re-encodes only its tail.
    """
    views[0].commit(keep, tokens)
    for view in views[1:]:
        view.commit(*view.appended(shared, text))
    for view in views:
        view.pipeline.commit(text)
