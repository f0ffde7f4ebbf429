"""The forward layer: every model call of the decoding layer, alone or batched across requests.

Every pass a member makes goes through here, in one of two forms:

* :func:`single_pass`: one request's ids on its own cache (ordinary decoding, a draft
  step, a verify window, a packed verify-in-line pass), the model's own forward;
* :func:`batched_forward`: the :class:`Job` s of several requests of one model in one pass
  (the scheduler, :mod:`~ensemble_core.decoding.scheduler`, decides which and when).

Keeping the model calls in one module is what lets a backend change how a pass runs
(graph capture on a GPU, a static cache) without touching the methods.

How a batched pass runs. Jobs of one model are grouped by length (padding wastes compute:
:func:`plan_groups`); a group of one row runs the member's ordinary, unbatched forward (so a
lone request is bit-identical to unbatched decoding). In a larger group, the rows' layers
that can stay in the model's :class:`~ensemble_core.decoding.slab.Slab` (its batch KV
storage, where the rows' own caches live between passes) are read and written there, with
no copy; the others (sliding layers past their window, a row that sits a pass out in the
middle of the slab) are gathered: every such row's KV cache goes into a left-padded batch
cache, the new ids are right-padded, explicit per-row position ids and a custom 4-D additive
mask per layer type (:mod:`~ensemble_core.decoding.masks`, the same mechanism as
verify-in-line) let a query see its row's real cached keys, the new keys its job allows
(causal, or the packed-candidate block structure) and, on sliding-window layers, only keys
less than ``window`` positions back. Afterwards each row's new keys/values are appended to
its own cache with the layer's own ``update`` (so sliding-layer bookkeeping stays exactly as
unbatched). Everything is exact in arithmetic; only floating-point summation order differs
from the 1-row pass (docs/benchmarks.md, "Batching"). A cache we cannot gather exactly (a
layer type other than :class:`DynamicLayer` / :class:`DynamicSlidingWindowLayer`, a sliding
layer that no longer holds its window) makes that group fall back to per-row passes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ensemble_core.decoding.cache import InPlaceAppend, RoomyLayer, RoomySlidingLayer
from ensemble_core.decoding.masks import additive_mask, allow_row, layer_types, sliding_window, text_config
from ensemble_core.decoding.slab import Slab
from ensemble_core.transfer import HOST, to_device


# ----------------------------------------------------------------------------- one request
def single_pass(model: Any, ids: Sequence[int] | torch.Tensor, cache: Any, logits_to_keep: int | torch.Tensor,
                device: Any, **kwargs: Any) -> torch.Tensor:
    """The model's own forward of ``ids`` on ``cache``: float32 logits rows ``[keep, V]``.

    ``ids``: host ids, or a tensor already on ``device`` (ids the host has not read, :attr:`Job.device_ids`).
    ``logits_to_keep`` is a count (the last rows) or an index tensor of positions; ``kwargs``
    carry a custom mask and position ids (verify-in-line). The cache is updated in place.
    """
    input_ids = ids.reshape(1, -1) if isinstance(ids, torch.Tensor) else to_device([list(ids)], device)
    out = model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=logits_to_keep, **kwargs)
    logits = out.logits[0]
    return (logits[-logits_to_keep:] if isinstance(logits_to_keep, int) else logits).float()


# ----------------------------------------------------------------------------- jobs
@dataclass(eq=False)
class Job:
    """One model call of one request: ``ids`` fed on ``cache``, logits wanted at ``keep``.

    ``positions`` are the true position ids of ``ids``; ``block[i, j]`` says whether new
    token ``i`` may attend to new token ``j`` (a packed verify pass's layout). Both None: a causal
    job (ordinary decoding), the ids at positions ``start ..`` each seeing those before it;
    :meth:`layout` builds them as tensors only for a pass that needs them (#38: two small tensors
    per request and token were host work that a batched or graphed pass never read).
    ``direct`` runs the very same call unbatched (used for a group of one and as the
    fallback); ``runner``, when set, runs it instead (a static slot's pass,
    :mod:`~ensemble_core.decoding.static`), with ``direct`` as its own fallback. The result is a
    float ``[len(keep), V]`` tensor. ``device_ids``, when set, are the ids on the model's device,
    not yet read by the host (a draft's argmax or sample, :func:`~ensemble_core.decoding.drafting.draft_tokens`);
    ``ids`` then hold placeholders of the same length, and every pass that builds its inputs on the
    host copies these over them on the device (:func:`place_device_ids`). ``greedy``: the requester
    chooses the argmax of its last kept row; a batched pass then reads it for every such job at once
    (:func:`greedy_choices`) into ``chosen`` (None: the requester takes it itself). A job of steps
    (``follow`` set: it builds the next pass's job from an id) asks for ``steps`` passes, each after the
    first fed the argmax of the pass before it, on the device (:func:`run_steps`; ``choose``, when set,
    chooses it instead of the argmax: a sampled draw); its result is then the kept row of every pass
    (``[steps, V]``) and ``step_ids`` the ids chosen from them (``[steps]``, on the device, unread).
    """

    cache: Any
    ids: list[int]
    positions: torch.Tensor | None
    block: torch.Tensor | None
    keep: list[int]
    direct: Callable[[], torch.Tensor]
    runner: Callable[[Job], torch.Tensor] | None = None
    participant: Any = None  # the scheduler's Participant that submitted it
    queued_at: float = 0.0
    done: bool = False
    result: torch.Tensor | None = None
    error: BaseException | None = None
    device_ids: torch.Tensor | None = None
    start: int = 0  # a causal job's first position (the cache's length when it was built)
    greedy: bool = False
    chosen: int | None = None
    steps: int = 1
    follow: Callable[[torch.Tensor], Job] | None = None
    choose: Callable[[torch.Tensor], torch.Tensor] | None = None
    step_ids: torch.Tensor | None = None

    @property
    def causal(self) -> bool:
        """Whether the ids are causal from :attr:`start` (no layout of their own)."""
        return self.positions is None

    def layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``positions`` ``[n]`` and ``block`` ``[n, n]`` as host tensors (a causal job's built here)."""
        if self.positions is not None and self.block is not None:
            return self.positions, self.block
        n = len(self.ids)
        return self.start + torch.arange(n, device=HOST), torch.ones(n, n, dtype=torch.bool, device=HOST).tril()


def place_device_ids(ids: torch.Tensor, placed: Sequence[tuple[int, Job]], width: int) -> None:
    """Copy the jobs' :attr:`Job.device_ids` over their placeholders in ``ids``, a device buffer whose first
    ``rows * width`` entries are the pass's ids row by row (``placed``: (row, job)); a copy on the device,
    queued on the stream like the pass, so nothing waits for the value."""
    flat = ids.view(-1)
    for row, job in placed:
        if job.device_ids is not None:
            flat[row * width: row * width + len(job.ids)].copy_(job.device_ids)


def run_pass(job: Job) -> torch.Tensor:
    """One pass of ``job``, unbatched: its ``runner``, else ``direct`` (its first step only, see :func:`run_steps`)."""
    return job.runner(job) if job.runner is not None else job.direct()


def run_alone(job: Job) -> torch.Tensor:
    """``job``'s own unbatched passes (all its steps): its result."""
    if job.follow is None:
        return run_pass(job)
    run_steps([job], _passes_alone)
    if job.error is not None:
        raise job.error
    assert job.result is not None
    return job.result


def _passes_alone(jobs: list[Job]) -> None:
    for job in jobs:
        try:
            job.result = run_pass(job)
        except Exception as exc:  # noqa: BLE001 - handed to the job's requester by run_alone
            job.error = exc


@dataclass(eq=False)
class _Steps:
    """A job of several steps while it runs: the job whose pass ran last, each pass's kept row and argmax."""

    origin: Job
    last: Job
    rows: list[torch.Tensor]
    ids: list[torch.Tensor]


def run_steps(jobs: Sequence[Job], run_group: Callable[[list[Job]], None]) -> None:
    """Run ``jobs`` (``run_group`` runs one pass of the jobs it is given, setting each one's ``result`` or
    ``error``), then every job of steps (one with a :attr:`Job.follow`) on: the argmax of its last kept row (one op for
    every greedy job going; a job's own :attr:`Job.choose` else, a draw) is fed by its next pass
    (:attr:`Job.follow`), on the device, the jobs still going in one pass, until each has run its steps.
    A job of steps ends with the kept row of each of its passes as its ``result`` (``[steps, V]``) and the
    ids chosen from them as ``step_ids`` (one step too: its row's choice is made here, like the others).

    Why (#38; vLLM's multi-step scheduling): a request that decodes greedily from the raw logits needs
    nothing from the host between its passes, so its thread waits once per ``steps`` tokens, not once
    per token, and the passes of concurrent requests need not wait for each request's Python between
    them: the host's work per step is the pass's own and one argmax over the rows going on.
    """
    run_group(list(jobs))
    going = [_Steps(job, job, [], []) for job in jobs if job.follow is not None]
    every = list(going)
    try:
        _step_on(going, run_group)
    except BaseException as exc:  # a job cut short must not pass for one of a single step
        for chain in every:
            if chain.origin.error is None and len(chain.rows) < chain.origin.steps:
                chain.origin.error = exc if isinstance(exc, Exception) else RuntimeError("The steps were interrupted.")
        raise
    for chain in every:
        if chain.origin.error is None and len(chain.rows) == chain.origin.steps:
            chain.origin.result = torch.stack(chain.rows)
            chain.origin.step_ids = torch.cat(chain.ids)


def _step_on(going: list[_Steps], run_group: Callable[[list[Job]], None]) -> None:
    """:func:`run_steps`' loop: choose every chain's next id, run the next passes of those still going."""
    while going:
        live = []
        for chain in going:
            if chain.last.error is not None:
                chain.origin.error = chain.last.error
            else:
                live.append(chain)
        if not live:
            break
        lasts = [chain.last.result[-1] for chain in live]  # type: ignore[index]
        chosen = _choices(live, lasts)
        going = []
        for i, chain in enumerate(live):
            if chosen[i] is None:  # its own choice failed (the error is the job's)
                continue
            chain.rows.append(lasts[i])
            chain.ids.append(chosen[i])  # type: ignore[arg-type]
            if len(chain.rows) == chain.origin.steps:
                continue
            try:
                assert chain.origin.follow is not None, "a job of several steps says how to build the next"
                chain.last = chain.origin.follow(chain.ids[-1])
            except Exception as exc:  # noqa: BLE001 - handed to the job's requester
                chain.origin.error = exc
                continue
            going.append(chain)
        if going:
            run_group([chain.last for chain in going])


def _choices(chains: Sequence[_Steps], rows: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
    """Each chain's next id (``[1]``, on the device) from its last row: the argmax, in one op for every greedy
    chain, or the chain's own :attr:`Job.choose` (None where that raised: the error goes to the chain's job)."""
    ids: list[torch.Tensor | None] = [None] * len(chains)
    greedy = [i for i, chain in enumerate(chains) if chain.origin.choose is None]
    if greedy:
        picked = argmaxes([rows[i] for i in greedy])
        for j, i in enumerate(greedy):
            ids[i] = picked[j:j + 1]
    for i, chain in enumerate(chains):
        if chain.origin.choose is not None:
            try:
                ids[i] = choice(rows[i], chain.origin.choose)
            except Exception as exc:  # noqa: BLE001 - one request's draw fails its request only
                chain.origin.error = exc
    return ids


def argmaxes(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each ``[V]`` row's argmax (the first of equal maxima), ``[len(rows)]`` where the rows are: one op for all."""
    return rows[0].argmax()[None] if len(rows) == 1 else torch.stack(list(rows)).argmax(-1)


def choice(row: torch.Tensor, choose: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """The id chosen from a ``[V]`` logits row, ``[1]`` where the row is, not read: its argmax, or ``choose(row)``."""
    return (row.argmax() if choose is None else choose(row)).reshape(1)


def causal_job(cache: Any, ids: Sequence[int], keep: Sequence[int], direct: Callable[[], torch.Tensor]) -> Job:
    """A job for ids appended after everything in ``cache`` (ordinary incremental decoding)."""
    return Job(cache, list(map(int, ids)), None, None, list(keep), direct, start=int(cache.get_seq_length()))


#: Whether a batched pass on the CPU chooses its greedy rows' tokens too (:func:`greedy_choices`); off: measured
#: no faster there (tests turn it on to check the choice).
CHOOSE_ON_HOST = False


def greedy_choices(jobs: Sequence[Job], results: Sequence[torch.Tensor]) -> None:
    """Each greedy job's argmax of its last kept row (``results[i]`` is job ``i``'s rows), into ``chosen``: one
    argmax over those rows and one read for the whole batch, where the rows are on an accelerator.

    Why (#38): on a GPU a request that takes the argmax of its own row and reads it launches a kernel and
    waits for the device once per request and token; here once per pass. The same token as
    ``int(row.argmax())`` (the first of equal maxima, as there). On a CPU a read is no wait, and with 16
    concurrent `single` requests (``docs/results/host/host_per_token.py``) the choice made here halved the
    context switches per token (~21 -> ~9: each op of a request's thread hands the GIL to another and
    back) but was no faster (a stack of the rows' logits and an argmax over them in the flushing thread
    took what the requests' own argmaxes saved), so the CPU keeps choosing per request."""
    wanted = [i for i, job in enumerate(jobs) if job.greedy]
    if not wanted or (results[wanted[0]].device.type == "cpu" and not CHOOSE_ON_HOST):
        return
    ids = argmaxes([results[i][-1] for i in wanted]).tolist()
    for i, token in zip(wanted, ids):
        jobs[i].chosen = int(token)


# ----------------------------------------------------------------------------- pure helpers
def plan_groups(lengths: Sequence[int], max_pad_ratio: float, max_pad_tokens: int | None = None) -> list[list[int]]:
    """Indices of rows to run together: sorted by length, a group grows while padding stays cheap.

    A row joins the current group when the padded token count ``rows * longest`` stays
    within ``max_pad_ratio`` times the real tokens (plus a few: short rows are nearly free
    in a memory-bound pass) and adds at most ``max_pad_tokens`` padding tokens in all. A
    long prefill therefore runs on its own, next to a batch of one-token decode steps,
    instead of padding all of them to its length; prefills of different lengths run in
    several passes of similar lengths.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    real = 0
    for i in order:
        n = lengths[i]
        padded = (len(groups[-1]) + 1) * n if groups else 0
        fits = padded <= max_pad_ratio * (real + n) + 8
        if fits and max_pad_tokens is not None:
            fits = padded - real - n <= max_pad_tokens
        if groups and fits:
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    return groups


@dataclass(frozen=True)
class _RowLayout:
    """Where one row's cached keys sit: ``context`` ids cached, ``visible[t]`` of them exposed to layer type t."""

    context: int
    visible: dict[str, int]


def _row_layout(cache: Any, types: Sequence[str], window: int | None) -> _RowLayout | None:
    """How many cached keys each layer type exposes for this row, or None when it cannot be gathered."""
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != len(types):
        return None
    context = int(cache.get_seq_length())
    visible: dict[str, int] = {}
    for layer, kind in zip(layers, types):
        if type(layer) not in (DynamicLayer, RoomyLayer, DynamicSlidingWindowLayer, RoomySlidingLayer):
            return None
        held = layer.held() if isinstance(layer, InPlaceAppend) else None  # a buffer's prefix: no view made
        if held is not None:
            filled, stored = True, held
            if layer._k.shape[0] != 1:  # type: ignore[union-attr]
                return None
        else:
            keys = layer.keys
            filled = getattr(layer, "is_initialized", False) and keys is not None and keys.dim() == 4
            stored = int(keys.shape[-2]) if filled else 0
            if filled and keys.shape[0] != 1:
                return None
        if kind == "sliding_attention":
            if not window:
                return None
            need = min(context, window - 1)
            if stored < need:
                return None  # the window's states are gone: only the model's own pass is exact
            n = need
        elif kind == "full_attention":
            if stored != context:
                return None
            n = context
        else:
            return None
        if visible.setdefault(kind, n) != n:
            return None
    return _RowLayout(context, visible)


def _buffer(pool: dict[Any, torch.Tensor] | None, key: tuple[int, str], shape: tuple[int, int, int, int],
            like: torch.Tensor) -> torch.Tensor:
    """A ``shape`` tensor for the gathered cache: a view of ``pool``'s buffer from the previous pass when it fits.

    Why: a fresh 1-2 MB tensor per layer and pass comes from newly mapped pages, which fault
    in on first touch (measured, 8-row SmolLM2 step: 210 ms pooled vs 223 ms fresh). The
    pool belongs to one :class:`Batcher` and one model; the batcher runs one pass at a
    time, so a buffer is never used by two passes at once.
    """
    if pool is None:
        return like.new_empty(shape)
    b, h, w, d = shape
    buf = pool.get(key)
    if (buf is None or tuple(buf.shape[:2]) != (b, h) or buf.shape[3] != d or buf.shape[2] < w
            or buf.dtype != like.dtype or buf.device != like.device):
        buf = pool[key] = like.new_empty((b, h, w + w // 4 + 16, d))
    return buf[:, :, :w]


def _padded(tensors: Sequence[torch.Tensor | None], counts: Sequence[int], width: int, room: int,
            out: torch.Tensor) -> torch.Tensor:
    """Fill ``out`` (``[B, H, width + room, D]``): each row's last ``counts[r]`` states right-aligned in
    the first ``width`` (left padding, zeros), then ``room`` positions for this pass's new states."""
    for r, (t, n) in enumerate(zip(tensors, counts)):
        if n < width:
            out[r, :, :width - n].zero_()
        if n:
            out[r, :, width - n:width] = t[0, :, -n:]
    return out


def _masks(jobs: Sequence[Job], layouts: Sequence[_RowLayout], kinds: Sequence[str], widths: dict[str, int],
           width_new: int, window: int | None, dtype: torch.dtype, device: Any) -> dict[str, torch.Tensor]:
    """An additive ``[B, 1, N, K + N]`` mask per gathered layer type (cached states right-aligned in ``[0, K)``,
    new tokens at columns ``K ..``)."""
    masks: dict[str, torch.Tensor] = {}
    for kind in kinds:
        k = widths[kind]
        allowed = torch.zeros(len(jobs), width_new, k + width_new, dtype=torch.bool, device=HOST)
        for r, (job, lay) in enumerate(zip(jobs, layouts)):
            v = lay.visible[kind]
            allow_row(allowed[r], job, lay.context - v, k - v, v, k,
                       window if kind == "sliding_attention" else None)
        masks[kind] = additive_mask(to_device(allowed, device), dtype)
    return masks


def _slab_mask(jobs: Sequence[Job], contexts: Sequence[int], width_new: int, window: int | None,
               dtype: torch.dtype, device: Any) -> torch.Tensor:
    """The additive mask of layers read from a :class:`~ensemble_core.decoding.slab.Slab` (``window``: sliding ones).

    Row ``r``'s cached states sit at columns ``[0, c)`` (column = position) and its new
    tokens right after them, at ``[c, c + N)``; everything past is another row's length or scratch.
    """
    allowed = torch.zeros(len(jobs), width_new, max(contexts) + width_new, dtype=torch.bool, device=HOST)
    for r, (job, c) in enumerate(zip(jobs, contexts)):
        allow_row(allowed[r], job, 0, 0, c, c, window)
    return additive_mask(to_device(allowed, device), dtype)


#: Causal-LM classes whose head is exactly ``lm_head`` (+ the config's final logit soft-capping).
PLAIN_HEADS = ("LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM", "Qwen3ForCausalLM")


def _logits_rows(model: Any, jobs: Sequence[Job], ids: torch.Tensor, cache: Any, mask: Any,
                 positions: torch.Tensor) -> list[torch.Tensor]:
    """Each job's wanted logits rows, computing the vocabulary projection for those rows only.

    The head is the most expensive matrix of a small model (Gemma-3-270m: 262k x 640), so
    asking ``logits_to_keep`` for the union of every row's positions (a packed verify pass
    wants ~20, a draft step 1) would multiply its cost by the batch size. For known plain
    heads the body runs alone and the head sees exactly the wanted (row, position) pairs.
    """
    body, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if type(model).__name__ in PLAIN_HEADS and body is not None and head is not None:
        hidden = body(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask,
                      position_ids=positions).last_hidden_state
        rows = to_device([r for r, job in enumerate(jobs) for _ in job.keep], hidden.device)
        cols = to_device([k for job in jobs for k in job.keep], hidden.device)
        logits = head(hidden[rows, cols])
        cap = getattr(text_config(model), "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return list(logits.float().split([len(job.keep) for job in jobs]))
    wanted = sorted({k for job in jobs for k in job.keep})
    index = to_device(wanted, ids.device)
    out = model(input_ids=ids, cache=cache, use_cache=True, attention_mask=mask, position_ids=positions,
                logits_to_keep=index)
    column = {k: c for c, k in enumerate(wanted)}
    return [out.logits[r, [column[k] for k in job.keep]].float() for r, job in enumerate(jobs)]


def _slab_layers(slab: Slab | None, jobs: Sequence[Job], layouts: Sequence[_RowLayout],
                 types: Sequence[str]) -> list[int]:
    """The layers this pass keeps in ``slab`` ([] : gather them all).

    Full-attention layers that append in place, when every row has some context and the
    rows are distinct caches; sliding layers too while every row's holds its whole history.
    """
    if slab is None or len({id(j.cache) for j in jobs}) < len(jobs) or any(lay.context == 0 for lay in layouts):
        return []
    full = [idx for idx, kind in enumerate(types) if kind == "full_attention"]
    sliding = [idx for idx, kind in enumerate(types) if kind == "sliding_attention"]
    if not full or not all(type(job.cache.layers[idx]) is RoomyLayer for job in jobs for idx in full):
        return []
    whole = all(type(layer := job.cache.layers[idx]) is RoomySlidingLayer and layer.keys.shape[-2] == lay.context
                for job, lay in zip(jobs, layouts) for idx in sliding)
    return sorted(full + sliding) if whole else full


def batched_forward(model: Any, jobs: Sequence[Job], buffers: dict[Any, torch.Tensor] | None = None,
                    slab: Slab | None = None) -> list[torch.Tensor] | None:
    """One forward pass for all ``jobs`` of ``model``; None when a row's cache cannot be gathered exactly.

    ``buffers``: where to keep the gathered cache between passes (see :func:`_buffer`); None
    allocates. ``slab``: the model's :class:`~ensemble_core.decoding.slab.Slab`, where the rows'
    full-attention states stay between passes (None: gather those layers too).
    """
    from transformers import DynamicCache

    types = layer_types(model)
    window = sliding_window(model)
    layouts = [_row_layout(job.cache, types, window) for job in jobs]
    if any(lay is None for lay in layouts):
        return None
    order = list(range(len(jobs)))
    first = None
    width_new = max(len(j.ids) for j in jobs)
    kept = _slab_layers(slab, jobs, layouts, types)  # type: ignore[arg-type]
    if kept:
        assert slab is not None
        order = slab.order([j.cache for j in jobs])
        contexts = [layouts[i].context for i in order]  # type: ignore[union-attr]
        first = slab.place([jobs[i].cache for i in order], kept, contexts, width_new)
    jobs = [jobs[i] for i in order]
    layouts_ok: list[_RowLayout] = [lay for lay in (layouts[i] for i in order) if lay is not None]
    contexts = [lay.context for lay in layouts_ok]
    in_slab = set(kept) if first is not None else set()
    slab_kinds = {types[idx] for idx in in_slab}
    gathered = [kind for kind in dict.fromkeys(types) if kind not in slab_kinds]
    device = model.device
    widths = {kind: max(lay.visible[kind] for lay in layouts_ok) for kind in dict.fromkeys(types)}
    cache = DynamicCache()
    if any(widths.values()):
        layers: list[Any] = []
        for idx, kind in enumerate(types):
            if idx in in_slab:
                assert slab is not None and first is not None
                layers.append(slab.pass_layer(idx, first, contexts, width_new))
                continue
            counts = [lay.visible[kind] for lay in layouts_ok]
            tensors = {}
            for part in ("keys", "values"):
                rows = [getattr(job.cache.layers[idx], part) for job in jobs]
                like = next(t for t, n in zip(rows, counts) if n)
                shape = (len(jobs), like.shape[1], widths[kind] + width_new, like.shape[3])
                tensors[part] = _padded(rows, counts, widths[kind], width_new, _buffer(buffers, (idx, part), shape, like))
            keys, values = tensors["keys"], tensors["values"]
            layer = RoomyLayer()  # the model's update writes the new states into the room: no copy of the batch
            layer.adopt(keys, values, widths[kind])
            layers.append(layer)
        cache.layers = layers
    ids = torch.zeros(len(jobs), width_new, dtype=torch.long)  # built on the host, copied once each
    positions = torch.zeros(len(jobs), width_new, dtype=torch.long)
    for r, job in enumerate(jobs):
        n = len(job.ids)
        ids[r, :n] = torch.tensor(job.ids, dtype=torch.long)
        if job.causal:  # its positions, continued past its last one, are one range
            positions[r] = torch.arange(job.start, job.start + width_new)
            continue
        pos = job.layout()[0].to(HOST)
        positions[r, :n] = pos
        positions[r, n:] = pos[-1] + 1 + torch.arange(width_new - n)
    ids, positions = to_device(ids, device), to_device(positions, device)
    place_device_ids(ids, list(enumerate(jobs)), width_new)
    dtype = model.dtype if model.dtype.is_floating_point else torch.float32
    masks = _masks(jobs, layouts_ok, gathered, widths, width_new, window, dtype, device)
    for kind in slab_kinds:
        masks[kind] = _slab_mask(jobs, contexts, width_new, window if kind == "sliding_attention" else None,
                                 dtype, device)
    mask: Any = masks[types[0]] if len(masks) == 1 else masks
    results = _logits_rows(model, jobs, ids, cache, mask, positions)
    for idx, kind in enumerate(types):  # scatter: each row's new states go to its own cache
        if idx in in_slab:
            continue
        layer = cache.layers[idx]
        k = widths[kind]
        for r, job in enumerate(jobs):
            n = len(job.ids)
            job.cache.update(layer.keys[r:r + 1, :, k:k + n], layer.values[r:r + 1, :, k:k + n], idx)
    if first is not None:  # the slab rows already hold their new states: only the lengths move
        Slab.commit([job.cache for job in jobs], sorted(in_slab), contexts, [len(job.ids) for job in jobs])
    back = [0] * len(order)
    for r, i in enumerate(order):
        back[i] = r
    return [results[back[i]] for i in range(len(order))]

