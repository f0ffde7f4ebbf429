"""Drafting: a member continues the text on its own, token by token, through its KV cache.

Two loops, shared by the methods and by the Ray actor that runs them next to a remote
member's cache (:mod:`ensemble_core.remote.actor`), which is why they live below both:

* :func:`draft_tokens`: SAFE's drafter drafts a few tokens ahead of the committed text and
  keeps its distribution at each (the verifiers compare against them);
* :func:`draft_segment`: a SpecEM / generate-then-select candidate: a segment drafted on a
  branch of the cache (rewound afterwards), stopping at EOS, a stop string or its length,
  with the drafter's own scores of it (:class:`DraftScores`, so that it need not verify its
  own candidate).

Both feed prompt-lookup guesses (:mod:`~ensemble_core.decoding.lookup`) with each pass when
asked, keep the guesses they would choose anyway and cut the rest. A draft with nothing to decide per
token (greedy or sampled: :mod:`~ensemble_core.decoding.sampling` draws on the device) keeps its ids
on the device and reads them once per draft or chunk
(:func:`_draft_unread`, :func:`_segment_unread`). A state whose model runs
elsewhere runs the same loop there (:func:`~ensemble_core.decoding.rows.delegate`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ensemble_core.decoding.lookup import propose
from ensemble_core.decoding.pipeline import TokenPipeline
from ensemble_core.decoding.rows import TensorRows, delegate
from ensemble_core.decoding.verify_inline import (
    Mark,
    branch_feed,
    branch_feed_steps,
    branch_marks,
    cache_branch,
    rewind,
)
from ensemble_core.text.alignment import (
    DECODE_CONTEXT,
    PARTIAL_CHAR_TOKENS,
    REPLACEMENT_CHAR,
    decode_suffix,
)
from ensemble_core.transfer import read_together, to_device


def draft_tokens(state: Any, limit: int, budget: int, pipeline: TokenPipeline, confidence: float = 0.0,
                 lookup: int = 0) -> tuple[list[int], Any]:
    """The drafter's loop: ``limit`` tokens (a few more to finish a character), never past ``budget`` or EOS.

    With ``confidence`` > 0 the draft also ends after a token the drafter gave less than
    that probability (:attr:`SafeConfig.draft_confidence`). With ``lookup`` > 0 each pass
    also feeds up to that many tokens guessed by prompt lookup (:mod:`~ensemble_core.decoding.lookup`),
    whose rows serve the next choices as long as the guesses come true; the ones that do not
    are cropped (:attr:`SafeConfig.prompt_lookup`). Returns the drafted ids and their
    distributions as rows (:mod:`~ensemble_core.decoding.rows`).
    Tokens are chosen by the member's ``pipeline`` (its grammar, when constrained, advances
    with them; the caller restores it). The last drafted token is not fed (the next round
    feeds it, or it is cropped). A state whose model runs elsewhere drafts next to its cache
    in one call; a constrained draft runs here, token by token, because the grammar lives here.
    """
    own = delegate(state, "draft_tokens") if not pipeline.constrained else None
    if own is not None:
        return own(limit, budget, pipeline.config, pipeline.generator, confidence, lookup)
    if unread_drafting(state, pipeline, confidence, lookup, follow_calls=True):
        return _draft_unread(state, limit, budget, pipeline)
    member = state.member
    base = len(state.ids)
    context = state.ids[max(0, base - DECODE_CONTEXT):base]
    ids: list[int] = []
    probs: list[torch.Tensor] = []
    guesses = next_guesses(pipeline, min(limit - 1, budget - 1), lookup, state.ids)
    rows = state.score(guesses)
    row, ahead = rows[0], list(zip(guesses, rows[1:]))  # ahead: fed guesses and the rows after them
    while True:
        token, p = pipeline.next_token(row)
        assert p is not None
        ids.append(token)
        probs.append(p)
        pipeline.accept(token)
        if token in member.eos_token_ids or len(ids) >= budget:
            break
        if confidence and float(p[token]) < confidence:
            limit = min(limit, len(ids))  # an unsure token: likely an ensemble point, drafting on is likely wasted
        if len(ids) >= limit and (len(ids) >= limit + PARTIAL_CHAR_TOKENS or not decode_suffix(
                member.tokenizer, context, ids).endswith(REPLACEMENT_CHAR)):
            break
        if ahead and ahead[0][0] == token:  # the guess came true: its row is already computed
            row = ahead.pop(0)[1]
            continue
        if ahead:  # a guess missed: drop it and the guesses fed after it
            state.crop(base + len(ids) - 1)
            ahead = []
        guesses = next_guesses(pipeline, min(limit - len(ids) - 1, budget - len(ids) - 1), lookup, state.ids, [token])
        rows = state.score([token, *guesses])  # the last drafted token is fed next round (or cropped)
        row, ahead = rows[1], list(zip(guesses, rows[2:]))
    if len(state.ids) > base + len(ids) - 1:  # fed guesses past the draft's end (and its last token)
        state.crop(base + len(ids) - 1)
    return ids, TensorRows(probs).read_ahead(ids, member.eos_id_tensor, argmax=False)  # one read per draft


def next_guesses(pipeline: TokenPipeline, cap: int, lookup: int, history: Sequence[int],
                 tail: Sequence[int] = ()) -> list[int]:
    """The guesses a drafting pass feeds after its token (at most ``cap``): the tokens the grammar forces
    next (:meth:`TokenPipeline.forced`), else up to ``lookup`` prompt-lookup guesses from ``history`` then
    ``tail`` (:func:`~ensemble_core.decoding.lookup.propose`).

    Forced tokens need no ``lookup``: under a grammar the member nearly always chooses them (it may spell
    forced bytes its own way, and then the guess is cut like a missed lookup guess), so each one kept is a
    pass saved, on any device and in a batch alike (#38: a forced call's property names cost a pass and a
    read each)."""
    if cap < 1:
        return []
    forced = pipeline.forced(cap)
    if forced or not lookup:
        return forced
    return propose([*history, *tail], min(lookup, cap))


def unread_drafting(state: Any, pipeline: TokenPipeline, confidence: float = 0.0, lookup: int = 0,
                    follow_calls: bool = False) -> bool:
    """Whether the draft can keep its ids on the device until its end: an unconstrained draft, greedy or
    sampled, with no decision taken per token (no draft confidence, no prompt-lookup guesses) on a local
    state.
    ``follow_calls``: the draft can stop behind a token that starts a call (:func:`_draft_unread`), so lazy
    calls in free text (``tool_choice="auto"``, an agent's turn) need not read per token either."""
    free = pipeline.unmasked if follow_calls else not pipeline.constrained
    return hasattr(state, "score_steps") and free and not confidence and not lookup


def _draft_unread(state: Any, limit: int, budget: int, pipeline: TokenPipeline) -> tuple[list[int], TensorRows]:
    """:func:`draft_tokens` with the ids left on the device: each pass is fed the previous pass's choice
    (its argmax, or its sample) without the host reading it, and the draft's ids, probabilities and EOS
    masses are read once, at its end (:meth:`TensorRows.read_ahead`).

    Why (#38): the loop that read each drafted token before feeding it made the host wait for the
    device once per token, so it could never queue the next pass ahead (SAFE's drafter choices were
    1.3 of its 3.0 reads per output token). The same ids as that loop: the same rows and choices (a
    sample is the same draw, and the draws of ids dropped behind the draft's end are undone). What
    it cannot see until the read it repairs after: a draft that ended at EOS is cut there (the
    passes fed behind it are cropped away); under lazy calls the pipeline follows the ids after the
    read, and a draft in which a call started is cut behind the token that started it and drafts on
    under the call's grammar, token by token, as the loop does; so does one that ends inside a
    character. A greedy draft is one job of ``n`` steps (:meth:`DecodeState.score_steps`): its passes
    choose and feed the argmax of the raw logits themselves, batched with other requests' steps, and
    the host normalises the draft's rows once.
    """
    member = state.member
    base = len(state.ids)
    context = state.ids[max(0, base - DECODE_CONTEXT):base]
    n = max(1, min(limit, budget))
    draws: list[Any] = []  # where the sampling generator stood before each pick (None: greedy)
    probs: list[torch.Tensor] = []
    stacked: torch.Tensor | None = None
    if not pipeline.config.do_sample:
        # greedy from the raw logits (free text): the passes choose and feed on their own, one job of n steps
        logits, chosen = state.score_steps(n)
        stacked = pipeline.distribution(logits)
        probs = list(stacked)
        draws = [None] * n
    else:
        def draw(row: torch.Tensor) -> torch.Tensor:  # the reading loop's draw, in the pass's order
            p = pipeline.distribution(row)
            draws.append(pipeline.draws(p.device))
            probs.append(p)
            return pipeline.pick(p)

        _, chosen = state.score_steps(n, draw)
    eos = member.eos_id_tensor
    rows = TensorRows(probs if stacked is None else stacked).read_ahead(chosen, eos, argmax=False)  # the draft's one read
    ids = list(rows.targets)
    state.settle(base, ids[:n - 1])
    end = _followed(ids, member, pipeline)
    if end is not None and end < n - 1:  # the end of the text, or a call started: what was fed behind it goes
        state.crop(base + end)
        ids, rows, probs = ids[:end + 1], rows.head(end + 1), probs[:end + 1]
        pipeline.undraw(draws[end + 1])  # and so do the draws of the ids behind it
    if ids[-1] in member.eos_token_ids:
        return ids, rows
    more = False  # token by token from here, as the loop that reads each token drafts: the rest of a draft
    # cut where a call started (under the call's grammar now), or a character cut at the draft's end
    while len(ids) < budget and (len(ids) < limit or (
            len(ids) < limit + PARTIAL_CHAR_TOKENS
            and decode_suffix(member.tokenizer, context, ids).endswith(REPLACEMENT_CHAR))):
        token, p = pipeline.next_token(state.score([ids[-1]])[-1])
        assert p is not None
        ids.append(token)
        probs.append(p)
        pipeline.accept(token)
        more = True
        if token in member.eos_token_ids:
            break
    return ids, (TensorRows(probs).read_ahead(ids, eos, argmax=False) if more else rows)


def _followed(ids: Sequence[int], member: Any, pipeline: TokenPipeline) -> int | None:
    """Advance ``pipeline`` by the drafted ``ids`` in order, as the drafting loop does token by token; the
    index of the first that ends the draft's unread part: the end of the text, or one after which the
    next token is no longer chosen from the raw logits (a call started under lazy calls). None: neither."""
    for i, token in enumerate(ids):
        pipeline.accept(token)
        if token in member.eos_token_ids or not pipeline.unmasked:
            return i
    return None


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


def row_scores(row: torch.Tensor, token: int | torch.Tensor, eos_ids: Sequence[int]) -> torch.Tensor:
    """``[logprob of token, logit of token, logprob of ending, logit of ending]`` under ``row``,
    as the verify pass computes them (kept on the row's device: one transfer per draft, not per step).
    ``token`` may be an id on the row's device that the host has not read."""
    logprobs = torch.log_softmax(row, dim=-1)
    if not eos_ids:
        end = row.new_full((2,), -math.inf)
    else:
        eos = to_device(sorted(eos_ids), row.device)
        end = torch.stack([torch.logsumexp(logprobs[eos], dim=0), row[eos].max()])
    return torch.cat([torch.stack([_at(logprobs, token), _at(row, token)]), end]).float()


def _at(values: torch.Tensor, token: int | torch.Tensor) -> torch.Tensor:
    """``values[token]``; a token on the device is gathered (indexing with a tensor reads it to the host)."""
    return values.index_select(0, token.reshape(1))[0] if isinstance(token, torch.Tensor) else values[token]


def _scores_table(ids: list[int], table: list[list[float]]) -> DraftScores:
    """:class:`DraftScores` from the :func:`row_scores` values of every row, read."""
    return DraftScores(tuple(ids),
                       {"logprob": tuple(r[0] for r in table[:len(ids)]), "logit": tuple(r[1] for r in table[:len(ids)])},
                       {"logprob": tuple(r[2] for r in table), "logit": tuple(r[3] for r in table)})


# ----------------------------------------------------------------------------- draft / verify
def find_stop(text: str, stops: Sequence[str]) -> int:
    """Where the first of ``stops`` begins in ``text`` (-1: none does)."""
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else -1


@dataclass
class _Segment:
    """A segment being drafted after ``context`` (the state's ids): its ids, its text and how it ended.

    :meth:`take` is the drafting loop's decision on each token, the same whether the loop reads
    every token as it is chosen or a chunk of tokens at once.
    """

    member: Any
    context: list[int]
    length: int
    stops: Sequence[str]
    tail: str
    ids: list[int] = field(default_factory=list)
    text: str = ""
    end: str | None = None

    def take(self, token: int, pipeline: TokenPipeline) -> bool:
        """Add the next drafted token (its grammar advances); True when the segment ends with it: at EOS, at
        a stop string (cut before it), or at its length (a few more tokens to finish a character)."""
        if token in self.member.eos_token_ids:
            self.end = "eos"
            return True
        pipeline.accept(token)
        self.ids.append(token)
        if self.stops or len(self.ids) >= self.length:
            self.text = decode_suffix(self.member.tokenizer, self.context, self.ids)
        if self.stops:
            whole = self.tail + self.text
            at = find_stop(whole, self.stops)
            if at >= 0:
                # cut before the stop; one that began in the shared text is kept up to its end instead (that
                # text is not the draft's to take back): committed, the generation loop finds the whole stop
                # and cuts the answer before it (cut to "", the stop's first part stayed in the answer)
                stop = min(len(s) for s in self.stops if whole.startswith(s, at))
                keep = at + stop if at < len(self.tail) else at
                self.text, self.end = self.text[: keep - len(self.tail)], "stop"
                return True
        return len(self.ids) >= self.length and not (
            self.text.endswith(REPLACEMENT_CHAR) and len(self.ids) < self.length + PARTIAL_CHAR_TOKENS)

    def result(self, table: list[list[float]]) -> tuple[list[int], str | None, str, DraftScores]:
        """``(ids, end, text, own scores)`` from the :func:`row_scores` of every row drafted."""
        text = self.text if self.end == "stop" else decode_suffix(self.member.tokenizer, self.context, self.ids) if (
            self.ids) else ""
        return self.ids, self.end, text, _scores_table(self.ids, table)


@torch.inference_mode()
def draft_segment(state: Any, length: int, pipeline: TokenPipeline, stops: Sequence[str], tail: str,
                  lookup: int = 0) -> tuple[list[int], str | None, str, DraftScores | None]:
    """The drafting loop of :func:`draft` on a cache branch: ``(ids, end, raw text, own scores)``.

    ``tail`` is the end of the shared text (a stop string may start in it). A state whose
    model runs elsewhere runs this loop next to its cache in one call (and refuses a
    grammar, which lives here). The scores are taken from the raw rows, before any
    grammar mask or sampling transform, as the verify pass sees them. With ``lookup`` > 0
    each pass also feeds up to that many tokens guessed by prompt lookup
    (:mod:`~ensemble_core.decoding.lookup`); their rows serve the next choices while the guesses come
    true, and the branch is cut back behind the first that does not.
    """
    own = delegate(state, "draft_segment")
    if own is not None:
        return own(length, pipeline.config, pipeline.generator, stops, tail, pipeline.grammar, lookup)
    if unread_drafting(state, pipeline, 0.0, lookup, follow_calls=True):
        return _segment_unread(state, length, pipeline, stops, tail)
    return _segment_read(state, length, pipeline, stops, tail, lookup)


#: Tokens a segment drafts on the device between two reads: a SpecEM segment (10 tokens by default)
#: is read once; a whole answer (generate-then-select) in chunks, so that one that ends early has fed at
#: most this many tokens less one past its end (on a branch, rewound: only their passes are spent).
SEGMENT_CHUNK = 16


def _segment_unread(state: Any, length: int, pipeline: TokenPipeline, stops: Sequence[str],
                    tail: str) -> tuple[list[int], str | None, str, DraftScores | None]:
    """:func:`draft_segment` with the ids left on the device: a chunk of tokens is drafted, each pass fed
    the previous pass's choice unread (one job of several steps,
    :func:`~ensemble_core.decoding.verify_inline.branch_feed_steps`: batched with other requests' steps),
    then the chunk's ids and scores are read at once and the loop's decisions (:meth:`_Segment.take`)
    taken on them in order; what was drafted behind the end is dropped with the branch. Under lazy calls,
    a token that starts a call ends the unread part: the branch is cut back behind it and the segment
    goes on under the call's grammar, token by token. The same ids, end, text and scores as the
    token-by-token loop (#38: that loop read every token before feeding it, a wait for the device per
    token)."""
    row = state.score()[-1]
    segment = _Segment(state.member, state.ids, length, stops, tail)
    table: list[list[float]] = []
    with cache_branch(state):
        while True:
            n = max(1, min(SEGMENT_CHUNK, length - len(segment.ids)))  # past the length: a token for a cut character
            marks = branch_marks(state)  # the branch before this chunk's unread passes
            draws: list[Any] = []

            def pick(row: torch.Tensor, draws: list[Any] = draws) -> torch.Tensor:  # the reading loop's choice
                draws.append(pipeline.draws(row.device))  # (greedy, or the same draw)
                return pipeline.pick_next(row)

            greedy = not pipeline.config.do_sample  # the passes take the raw logits' argmax themselves
            tokens, rows = [pick(row)], [row]  # the passes choose the rest: one job of n - 1 steps
            if n > 1:
                more, chosen = branch_feed_steps(state, tokens[0], n - 1, None if greedy else pick)
                rows.extend(more)
                tokens.extend(chosen)  # the id chosen from each row: the last is the chunk's last, not fed
            if greedy:
                draws = [None] * n
            scores = [row_scores(r, t, state.member.eos_token_ids) for r, t in zip(rows, tokens)]
            chunk, values = read_together([torch.stack(tokens), torch.stack(scores)])  # the chunk's one read
            for j, token in enumerate(chunk):
                table.append(values[4 * j: 4 * j + 4])
                ends = segment.take(token, pipeline)
                if (ends or not pipeline.unmasked) and j + 1 < n:
                    pipeline.undraw(draws[j + 1])  # the ids picked behind it are dropped, and so are their draws
                if ends:
                    return segment.result(table)
                if not pipeline.unmasked:  # a call started: the tokens chosen behind it ignored its grammar
                    rewind(marks, j)  # the branch holds the chunk up to this token, which is fed next
                    return _segment_loop(state, segment, pipeline, branch_feed(state, [token])[-1], table)
            row = branch_feed(state, chunk[-1:])[-1]  # the chunk's last token, read: fed to draft on


def _segment_read(state: Any, length: int, pipeline: TokenPipeline, stops: Sequence[str], tail: str,
                  lookup: int) -> tuple[list[int], str | None, str, DraftScores | None]:
    """:func:`draft_segment`'s token-by-token loop: under a grammar or prompt lookup (each token decided
    on the host)."""
    row = state.score()[-1]
    segment = _Segment(state.member, state.ids, length, stops, tail)
    with cache_branch(state):
        return _segment_loop(state, segment, pipeline, row, [], lookup)


def _segment_loop(state: Any, segment: _Segment, pipeline: TokenPipeline, row: torch.Tensor,
                  table: list[list[float]], lookup: int = 0) -> tuple[list[int], str | None, str, DraftScores | None]:
    """Draft ``segment`` on token by token from ``row``, inside its branch, each token decided on the host;
    ``table``: the scores of the tokens drafted before (an unread chunk cut where a call started). Each
    row's scores are kept on the device and read with the others at the end."""
    ids, length = segment.ids, segment.length
    kept: list[torch.Tensor] = []  # per row: its token's and ending's scores (row_scores)
    ahead: list[tuple[int, torch.Tensor]] = []  # fed guesses and the rows after them
    marks: list[Mark] = []  # the branch before the last pass with guesses
    fed = 0  # that pass's guesses
    while True:
        token, _ = pipeline.next_token(row, keep_probs=False)
        kept.append(row_scores(row, token, state.member.eos_token_ids))
        if segment.take(token, pipeline):
            return segment.result(table + torch.stack(kept).tolist())
        if ahead and ahead[0][0] == token:  # the guess came true: its row is already computed
            row = ahead.pop(0)[1]
            continue
        if ahead:  # a guess missed: cut it and the guesses after it off the branch
            rewind(marks, 1 + fed - len(ahead))  # the token and the guesses that came true
            ahead = []
        guesses = next_guesses(pipeline, length - len(ids) - 1, lookup, state.ids, ids)
        if guesses:
            marks, fed = branch_marks(state), len(guesses)
        rows = branch_feed(state, [token, *guesses])
        row, ahead = rows[0], list(zip(guesses, rows[1:]))
