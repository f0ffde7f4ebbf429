"""Selecting among whole candidates: drafting them, cross-scoring them, finishing the text.

Shared by SpecEM (segment by segment, :mod:`ensemble_core.specem`) and the
generate-then-select baseline (whole answers, :mod:`ensemble_core.baselines`):

* :func:`draft`: a member continues the shared text by up to ``length`` of its own tokens
  on a branch of its KV cache (rewound afterwards), stopping at EOS or a stop string; the
  segment is cleaned by :func:`postprocess_segment`;
* :func:`verify`: a verifier scores every candidate in ONE packed forward pass over its
  cached context (:mod:`ensemble_core.verify_inline`), except its own draft, whose scores
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

from . import alignment, batching
from .alignment import PARTIAL_CHAR_TOKENS, REPLACEMENT_CHAR, Tokenized, decode_suffix
from .errors import ConfigurationError, InvalidOptionError
from .generation import GenerationConfig, choose_token
from .lookup import check_lookup_max_requests, check_prompt_lookup, propose
from .members import Member
from .rows import delegate
from .verify_inline import (
    SCORING_KINDS,
    Mark,
    branch_feed,
    branch_marks,
    cache_branch,
    check_verifier,
    rewind,
    score_candidates_inline,
)
from .view import MemberView

NORMALIZATIONS = ("softmax", "minmax", "none")
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
    they sit on different devices, or on a multi-core CPU). ``prompt_lookup``: each drafter
    also feeds up to this many tokens guessed from its own context per pass
    (:mod:`~ensemble_core.lookup`) and keeps those it chooses anyway: the same candidates in
    fewer passes (0: one token per pass). ``prompt_lookup_max_requests``: guess only while at
    most this many requests decode together (None: always; see
    :func:`~ensemble_core.lookup.guesses_now`).
    """

    scoring: str = "logprob"
    normalization: str = "softmax"
    drafters: tuple[int | str, ...] | None = None
    verifiers: tuple[int | str, ...] | None = None
    parallel: bool | None = None
    prompt_lookup: int = 0
    prompt_lookup_max_requests: int | None = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_prompt_lookup(self.prompt_lookup)
        check_lookup_max_requests(self.prompt_lookup_max_requests)
        if self.scoring not in SCORING_KINDS:
            raise InvalidOptionError("scoring", self.scoring, "one of " + ", ".join(SCORING_KINDS))
        if self.normalization not in NORMALIZATIONS:
            raise InvalidOptionError("normalization", self.normalization, "one of " + ", ".join(NORMALIZATIONS))
        object.__setattr__(self, "drafters", _check_members_spec("drafters", self.drafters))
        object.__setattr__(self, "verifiers", _check_members_spec("verifiers", self.verifiers))
        if self.parallel is not None and not isinstance(self.parallel, bool):
            raise InvalidOptionError("parallel", self.parallel, "True, False or None (automatic)")


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


# ----------------------------------------------------------------------------- candidates and roles
@dataclass(frozen=True)
class DraftScores:
    """The drafter's own scores of its draft, kept from the rows it drafted from.

    Why: every verifier scores every candidate, and for the verifier's *own* candidate
    those scores are the rows of its drafting steps (row ``j`` predicted token ``j``), so
    the packed verify pass can leave that candidate out: a member verifies K-1 candidates,
    not K (half of the positions for a pair; in generate-then-select a whole answer). The
    values equal the packed pass's up to floating-point summation order.

    ``token[kind][j]`` is the score of ``ids[j]``; ``end[kind][j]`` the score of ending
    after ``ids[:j]`` (see ``verify_inline._end_value``), for every row the draft computed.
    """

    ids: tuple[int, ...]
    token: dict[str, tuple[float, ...]]
    end: dict[str, tuple[float, ...]]

    def values(self, ids: Sequence[int], terminal: bool, kind: str) -> torch.Tensor | None:
        """The scores of ``ids`` (+ its end) if they start the draft, else None (score them in the pass)."""
        k = len(ids)
        if tuple(int(t) for t in ids) != self.ids[:k] or kind not in self.token:
            return None
        values = list(self.token[kind][:k])
        if terminal:
            if k >= len(self.end[kind]):
                return None
            values.append(self.end[kind][k])
        return torch.tensor(values, dtype=torch.float32)


def row_scores(row: torch.Tensor, token: int, eos_ids: Sequence[int]) -> torch.Tensor:
    """``[logprob of token, logit of token, logprob of ending, logit of ending]`` under ``row``,
    as the verify pass computes them (kept on the row's device: one transfer per draft, not per step)."""
    logprobs = torch.log_softmax(row, dim=-1)
    if not eos_ids:
        end = row.new_full((2,), -math.inf)
    else:
        eos = torch.tensor(sorted(eos_ids), dtype=torch.long, device=row.device)
        end = torch.stack([torch.logsumexp(logprobs[eos], dim=0), row[eos].max()])
    return torch.cat([torch.stack([logprobs[token], row[token]]), end]).float()


def _draft_scores(ids: list[int], rows: list[torch.Tensor]) -> DraftScores:
    """:class:`DraftScores` from :func:`row_scores` of every row the draft computed."""
    table = torch.stack(rows).tolist() if rows else []
    return DraftScores(tuple(ids),
                       {"logprob": tuple(r[0] for r in table[:len(ids)]), "logit": tuple(r[1] for r in table[:len(ids)])},
                       {"logprob": tuple(r[2] for r in table), "logit": tuple(r[3] for r in table)})


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
    with batching.member_threads(len(items)) as done:

        def work(x: T) -> R:
            try:
                return fn(x)
            finally:
                done()

        with ThreadPoolExecutor(max_workers=len(items)) as pool:
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


# ----------------------------------------------------------------------------- draft / verify
def _find_stop(text: str, stops: Sequence[str]) -> int:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@torch.inference_mode()
def draft(view: MemberView, index: int, length: int, config: GenerationConfig, stops: Sequence[str], shared: str,
          trim: bool = True, lookup: int = 0) -> Candidate:
    """Up to ``length`` tokens from ``view``'s context, as a cleaned segment of shared text.

    The draft runs on a cache branch (rewound afterwards): the state keeps its context
    and the row after it, which verification reuses. A draft stops at EOS, at a stop
    string (cut before it) or at ``length`` tokens (a few more if the last character is
    unfinished). ``lookup``: prompt-lookup guesses per pass (``SelectionConfig.prompt_lookup``).
    """
    tail = shared[-max((len(s) for s in stops), default=1):] if stops else ""
    grammar = view.constraint  # a constrained request: draft under this member's own token mask
    mark = grammar.checkpoint() if grammar is not None else None
    ids, end, text, scores = draft_segment(view.state, length, config, view.generator, stops, tail, grammar, lookup)
    if grammar is not None:
        grammar.restore(mark)  # the grammar follows the committed text, not this draft
    if not shared:
        text = text.lstrip()
    if trim:
        text = postprocess_segment(text, end is not None)
    else:
        text = text.replace(REPLACEMENT_CHAR, "")
    return Candidate(index, text, end, len(ids), scores)


@torch.inference_mode()
def draft_segment(state: Any, length: int, config: GenerationConfig, generator: torch.Generator | None,
                  stops: Sequence[str], tail: str, grammar: Any = None,
                  lookup: int = 0) -> tuple[list[int], str | None, str, DraftScores | None]:
    """The drafting loop of :func:`draft` on a cache branch: ``(ids, end, raw text, own scores)``.

    ``tail`` is the end of the shared text (a stop string may start in it). A state whose
    model runs elsewhere runs this loop next to its cache in one call (and refuses a
    grammar, which lives here). The scores are taken from the raw rows, before any
    grammar mask or sampling transform, as the verify pass sees them. With ``lookup`` > 0
    each pass also feeds up to that many tokens guessed by prompt lookup
    (:mod:`~ensemble_core.lookup`); their rows serve the next choices while the guesses come
    true, and the branch is cut back behind the first that does not.
    """
    own = delegate(state, "draft_segment")
    if own is not None:
        return own(length, config, generator, stops, tail, grammar, lookup)
    member = state.member
    row = state.score()[-1]
    ids: list[int] = []
    end: str | None = None
    text = ""
    kept: list[torch.Tensor] = []  # per row: its token's and ending's scores (row_scores)
    ahead: list[tuple[int, torch.Tensor]] = []  # fed guesses and the rows after them
    marks: list[Mark] = []  # the branch before the last pass with guesses
    fed = 0  # that pass's guesses
    with cache_branch(state):
        while True:
            raw = row
            if grammar is not None:
                row = grammar.mask_logits(row)
            probs = torch.softmax(row, dim=-1) if config.do_sample else row
            token = choose_token(probs, config, generator)
            kept.append(row_scores(raw, token, member.eos_token_ids))
            if token in member.eos_token_ids:
                end = "eos"
                break
            if grammar is not None:
                grammar.accept_token(token)
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
            if ahead and ahead[0][0] == token:  # the guess came true: its row is already computed
                row = ahead.pop(0)[1]
                continue
            if ahead:  # a guess missed: cut it and the guesses after it off the branch
                rewind(marks, 1 + fed - len(ahead))  # the token and the guesses that came true
                ahead = []
            guesses = propose([*state.ids, *ids], min(lookup, length - len(ids) - 1)) if lookup else []
            if guesses:
                marks, fed = branch_marks(state), len(guesses)
            rows = branch_feed(state, [token, *guesses])
            row, ahead = rows[0], list(zip(guesses, rows[1:]))
    if end != "stop":
        text = decode_suffix(member.tokenizer, state.ids, ids) if ids else ""
    return ids, end, text, _draft_scores(ids, kept)


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
    raw = [float(v.mean()) if v is not None and len(v) else -math.inf for v in values]
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
