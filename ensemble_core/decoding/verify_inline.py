"""Verify in line: score many candidate continuations of one context in ONE forward pass.

SpecEM asks every verifier to score K candidate segments after the same context. Run
naively that is K forward passes (or K re-runs of the whole context). Packing the
candidates behind the context and hiding them from each other with a 4-D additive mask
costs one pass over ``sum(len(c_i))`` new tokens, reusing the member's KV cache for the
context:

* the packed tokens of candidate ``i`` see the cached context and the earlier tokens of
  candidate ``i`` only (causal inside the candidate, blind to the others);
* their position ids restart at the context length ``P`` for every candidate, so each
  candidate is encoded exactly as if it were alone;
* the first token of every candidate is predicted by the context's last row, which the
  :class:`~ensemble_core.decoding.members.DecodeState` already holds (the row just before a
  candidate in the packed sequence belongs to the previous candidate);
* afterwards the packed tokens are removed from the cache so that the state is exactly
  what it was (:func:`cache_branch`).

Sliding-window layers (Gemma-3: window 512, five of every six layers). transformers
returns a custom 4-D mask unchanged for *every* layer type, so the window is no longer
applied by the model. We therefore build one mask per layer type, sized with
``cache.get_mask_sizes`` for a layer of that type (a sliding layer only exposes the last
``window - 1`` cached states plus the new ones), add the window constraint
``q_pos - k_pos < window`` ourselves, and hand models with several layer types the
``{layer_type: mask}`` mapping their forward accepts. This keeps scores exact for
contexts longer than the window (tested).

Only attention implementations that add the mask to the attention scores honour it
(``sdpa`` and ``eager``); FlashAttention ignores a custom float mask and would silently
let candidates see each other, so it is refused with :class:`UnsupportedAttentionError`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from ensemble_core.decoding.cache import RoomyLayer
from ensemble_core.decoding.forward import Job, causal_job, single_pass
from ensemble_core.decoding.masks import MASK_HONOURING_ATTENTION, layer_types, packed_layout, packed_masks
from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.decoding.rows import delegate
from ensemble_core.decoding.scheduler import run_job
from ensemble_core.decoding.static import route
from ensemble_core.errors import InputError, UnsupportedAttentionError, UnsupportedModelError
from ensemble_core.transfer import HOST, to_device

#: Layer types whose masks we know how to build (full causal, causal + sliding window).
SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")
#: Upper bound on the logits materialised by one packed pass (float32 bytes); longer
#: candidate lists are split over several passes (generate-then-select scores whole answers).
MAX_LOGIT_BYTES = 2**28

SCORING_KINDS = ("logprob", "logit")


def check_verifier(member: Member) -> None:
    """Raise unless ``member``'s model honours custom 4-D masks and has a layout we can mask."""
    impl = getattr(member.model.config, "_attn_implementation", None) or "eager"
    if impl not in MASK_HONOURING_ATTENTION:
        raise UnsupportedAttentionError(member.name, impl)
    unknown = sorted(set(layer_types(member.model)) - set(SUPPORTED_LAYER_TYPES))
    if unknown:
        raise UnsupportedModelError(
            f"Member {member.name!r} has attention layers of type {', '.join(unknown)}; verify-in-line can mask "
            f"only {', '.join(SUPPORTED_LAYER_TYPES)}. Use it as a drafter only (verifiers=[...])."
        )


# ----------------------------------------------------------------------------- cache branches
def _layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise UnsupportedModelError(f"Cannot branch a {type(cache).__name__}: only layered DynamicCache is supported.")
    return list(layers)


#: A layer, its cached length and its ``cumulative_length`` (sliding layers) at a mark.
Mark = tuple[Any, int, int | None]


def branch_marks(state: DecodeState) -> list[Mark]:
    """Where every cache layer of ``state`` stands now: what :func:`rewind` slices back to."""
    marks = []
    for layer in _layers(state.cache):
        held = layer.held() if isinstance(layer, RoomyLayer) else None  # a buffer's prefix: its length, no view made
        if held is not None:
            marks.append((layer, held, None))
            continue
        if getattr(layer, "is_sliding", False) and not getattr(layer, "record_past", True):
            raise UnsupportedModelError("A sliding-window cache layer without past recording cannot be branched exactly.")
        keys = getattr(layer, "keys", None)
        filled = getattr(layer, "is_initialized", False) and keys is not None and keys.dim() >= 2
        length = keys.shape[-2] if filled else 0
        marks.append((layer, length, getattr(layer, "cumulative_length", None)))
    return marks


def rewind(marks: Sequence[Mark], keep: int = 0) -> None:
    """Slice every layer back to its marked length plus ``keep`` positions fed since the mark.

    Exact because inside a branch layers only concatenate (see :func:`cache_branch`).
    """
    for layer, length, cumulative in marks:
        if isinstance(layer, RoomyLayer) and layer.keep_first(length + keep):
            continue
        keys = getattr(layer, "keys", None)
        if getattr(layer, "is_initialized", False) and keys is not None and keys.dim() >= 2:
            layer.keys = layer.keys[..., :length + keep, :]
            layer.values = layer.values[..., :length + keep, :]
        if cumulative is not None:
            layer.cumulative_length = cumulative + keep


@contextmanager
def cache_branch(state: DecodeState) -> Iterator[None]:
    """Run forward passes on ``state``'s cache, then remove whatever they appended.

    The restore is exact: full-attention layers and sliding layers with past recording
    (every :class:`DecodeState` cache has it) only *concatenate* on update, so slicing
    each layer back to its recorded length gives back the very tensors it held before;
    ``DecodeState``'s own bookkeeping (``cached``, its cropping allowance) stays valid.
    Unlike ``cache.crop`` this never trims a sliding layer, which would silently cost the
    state its ability to roll back later.
    """
    if state.cached != len(state.ids):
        raise InputError("cache_branch needs a state without pending ids; call state.score() first.")
    marks = branch_marks(state)
    try:
        yield
    finally:
        rewind(marks)


def _forward(state: DecodeState, ids: Sequence[int], logits_to_keep: int | Sequence[int],
             packed: Sequence[int] | None = None) -> torch.Tensor:
    """One forward pass of ``ids`` on the state's cache (inside a branch); float32 logits rows.

    ``logits_to_keep``: how many last rows, or which positions (a host list). ``packed``: the
    lengths of candidates packed after the cache (:func:`packed_layout`: their positions and
    visibility go to the batcher and the static passes as the job's layout); None: the ids
    are causal after the cache. The model's own call (``direct``: alone, or the fallback)
    builds the packed masks only when it runs, so a pass that runs batched or static never
    pays for them. In a batched request the pass is shared with other requests' rows
    (:mod:`ensemble_core.decoding.scheduler`).
    """
    t0 = time.perf_counter()
    member = state.member
    cache = state.cache
    n = len(ids)
    keep = list(range(n - logits_to_keep, n)) if isinstance(logits_to_keep, int) else [int(i) for i in logits_to_keep]

    def direct() -> torch.Tensor:
        # positions: the model's own call takes them as an index on its device
        wanted = logits_to_keep if isinstance(logits_to_keep, int) else to_device(keep, member.device)
        if packed is None:
            return single_pass(member.model, ids, cache, wanted, member.device)
        mask, positions = packed_masks(state, packed)
        return single_pass(member.model, ids, cache, wanted, member.device, attention_mask=mask,
                           position_ids=positions)

    if packed is None:
        job = causal_job(cache, ids, keep, direct)
    else:
        positions, block = packed_layout(packed, cache.get_seq_length(), HOST)
        job = Job(cache, list(map(int, ids)), positions, block, keep, direct)
    return _submit(state, route(job), len(ids), t0)


def _submit(state: DecodeState, job: Job, fed: int, t0: float) -> torch.Tensor:
    """Run ``job`` (alone or through the request's batcher) and count its passes and the ids they fed."""
    rows = run_job(state.batch, state.member, job)
    state.stats.forward_passes += job.steps
    state.stats.tokens_fed += fed
    state.stats.seconds += time.perf_counter() - t0
    return rows


@torch.inference_mode()
def branch_feed(state: DecodeState, ids: Sequence[int]) -> torch.Tensor:
    """Next-token logits after each of ``ids``, appended on a branch in one pass: ``[len(ids), V]``."""
    return _forward(state, list(ids), len(ids))


@torch.inference_mode()
def branch_feed_steps(state: DecodeState, token: torch.Tensor, n: int,
                      choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``token`` (unread, on the device) then the argmax of each row after it (or ``choose(row)``: a draw),
    ``n`` passes on a branch, none read: the rows after each fed token (``[n, V]``) and the id chosen from
    each (``[n]``, the last not fed).

    Why (#38): a greedy segment drafts on from the raw logits without the host choosing between its
    passes; one job of ``n`` steps (:attr:`~ensemble_core.decoding.forward.Job.steps`) runs them back to
    back alone, and batched with the other requests' steps, so the request's thread waits once per
    chunk. The same rows and ids as ``n`` calls of :func:`branch_feed`, each fed the id chosen from the last row.
    """
    job = state.unread_job(token)
    job.steps, job.follow, job.choose = n, state.unread_job, choose
    rows = _submit(state, job, n, time.perf_counter())
    assert job.step_ids is not None, "a job of steps ends with its steps' ids or raises"
    return rows, job.step_ids


# ----------------------------------------------------------------------------- scoring
def _token_values(rows: torch.Tensor, targets: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "logprob":
        return torch.log_softmax(rows, dim=-1).gather(-1, targets[:, None])[:, 0]
    return rows.gather(-1, targets[:, None])[:, 0]


def _end_value(row: torch.Tensor, eos_ids: Sequence[int], kind: str) -> torch.Tensor:
    """Score of "the text ends here": log of the total EOS probability (or the best EOS logit)."""
    ids = to_device(sorted(eos_ids), row.device)
    if kind == "logprob":
        return torch.logsumexp(torch.log_softmax(row, dim=-1)[ids], dim=0)[None]
    return row[ids].max()[None]


def _check_candidates(state: DecodeState, candidates: Sequence[Sequence[int]], terminal: Sequence[bool] | None,
                      kind: str) -> list[bool]:
    if kind not in SCORING_KINDS:
        raise InputError(f"Unknown scoring kind {kind!r}; use one of {', '.join(SCORING_KINDS)}.")
    if not candidates:
        raise InputError("score_candidates needs at least one candidate.")
    vocab = state.member.vocab_size
    for c in candidates:
        if any(not 0 <= int(t) < vocab for t in c):
            raise InputError(f"A candidate holds token ids outside member {state.member.name!r}'s vocabulary ({vocab}).")
    ends = [False] * len(candidates) if terminal is None else [bool(t) for t in terminal]
    if len(ends) != len(candidates):
        raise InputError("terminal must have one flag per candidate.")
    if any(ends) and not state.member.eos_token_ids:
        raise InputError(f"Member {state.member.name!r} has no EOS token to score a finished candidate with.")
    return ends


def _groups(lengths: Sequence[int], ends: Sequence[bool], vocab: int) -> list[list[int]]:
    """Candidate indices per packed pass, keeping the logits of one pass under MAX_LOGIT_BYTES."""
    max_rows = max(32, MAX_LOGIT_BYTES // (4 * max(vocab, 1)))
    groups: list[list[int]] = [[]]
    rows = 0
    for i, (n, end) in enumerate(zip(lengths, ends)):
        need = max(n - 1, 0) + (1 if end and n else 0)
        if groups[-1] and rows + need > max_rows:
            groups.append([])
            rows = 0
        groups[-1].append(i)
        rows += need
    return groups


@torch.inference_mode()
def score_candidates_inline(state: DecodeState, candidates: Sequence[Sequence[int]], kind: str = "logprob",
                            terminal: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """Per-token scores of each candidate continuation of ``state``'s ids, in one packed pass.

    ``candidates[i]`` are token ids of this member; ``terminal[i]`` adds one more value,
    the score of ending right after the candidate (log of the total EOS probability for
    ``kind="logprob"``, the best EOS logit for ``"logit"``). Returns one 1-D float tensor
    per candidate (empty for an empty, non-terminal candidate). The state's ids and cache
    are unchanged afterwards (pending ids, if any, are committed first). A state whose model
    runs elsewhere scores next to its cache and ships only the per-token scores.
    """
    own = delegate(state, "score_candidates_inline")
    if own is not None:
        return own(candidates, kind, terminal)
    ends = _check_candidates(state, candidates, terminal, kind)
    row0 = state.score()[-1]  # the context's last row: predicts every candidate's first token
    eos = sorted(state.member.eos_token_ids)
    lengths = [len(c) for c in candidates]
    result: list[torch.Tensor | None] = [None] * len(candidates)
    for group in _groups(lengths, ends, state.member.vocab_size):
        live = [i for i in group if lengths[i] > 0]
        keep: list[int] = []  # packed positions whose logits are needed
        starts: dict[int, int] = {}
        pos = 0
        for i in live:
            starts[i] = pos
            keep.extend(range(pos, pos + lengths[i] - 1))
            if ends[i]:
                keep.append(pos + lengths[i] - 1)
            pos += lengths[i]
        rows_at: dict[int, torch.Tensor] = {}
        if keep:
            with cache_branch(state):
                packed = [int(t) for i in live for t in candidates[i]]
                out = _forward(state, packed, keep, [lengths[i] for i in live])
            rows_at = {p: out[j] for j, p in enumerate(keep)}
        for i in group:
            n = lengths[i]
            preds = [row0] + [rows_at[starts[i] + j] for j in range(n - 1)] if n else []
            values = []
            if n:
                targets = to_device([int(t) for t in candidates[i]], row0.device)
                values.append(_token_values(torch.stack(preds), targets, kind))
            if ends[i]:
                last = rows_at[starts[i] + n - 1] if n else row0
                values.append(_end_value(last, eos, kind))
            result[i] = torch.cat(values) if values else row0.new_zeros(0)
    return [r for r in result if r is not None]


@torch.inference_mode()
def score_candidates_separately(state: DecodeState, candidates: Sequence[Sequence[int]], kind: str = "logprob",
                                terminal: Sequence[bool] | None = None) -> list[torch.Tensor]:
    """The same scores as :func:`score_candidates_inline`, one forward pass per candidate.

    The reference (and the baseline it is timed against): each candidate is run alone
    behind the cached context with the model's own causal mask, then removed again.
    """
    ends = _check_candidates(state, candidates, terminal, kind)
    row0 = state.score()[-1]
    eos = sorted(state.member.eos_token_ids)
    result = []
    for cand, end in zip(candidates, ends):
        ids = [int(t) for t in cand]
        rows = row0[None]
        if ids and (len(ids) > 1 or end):
            with cache_branch(state):
                out = _forward(state, ids if end else ids[:-1], len(ids) if end else len(ids) - 1)
            rows = torch.cat([row0[None], out], dim=0)
        values = []
        if ids:
            targets = to_device(ids, row0.device)
            values.append(_token_values(rows[: len(ids)], targets, kind))
        if end:
            values.append(_end_value(rows[len(ids)], eos, kind))
        result.append(torch.cat(values) if values else row0.new_zeros(0))
    return result
