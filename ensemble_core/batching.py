"""Batched decoding across concurrent requests: one forward pass per member for many rows.

Decode on a CPU (and on a small GPU model) is memory-bound: a SmolLM2-135M float32 step
reads ~540 MB of weights whatever the number of rows it computes. So requests that run at
the same time should share their forward passes. Methods (SAFE, SpecEM, the baselines)
stay per-request code; batching happens one level down, where every model call goes
through :class:`~ensemble_core.members.DecodeState` (``score``) or
:mod:`~ensemble_core.verify_inline` (``_forward``: draft steps on a cache branch, packed
candidate scoring). Each call becomes a :class:`Job`; a request's thread submits it to the
method's :class:`Batcher` and blocks until its rows come back.

When to run (the flush rule). A request is a :class:`Participant`; it is *active* while
its thread runs a method step (with as many threads as run its members, when a method
runs them in threads). The batcher runs everything queued as soon as every active thread
of every live participant has a job waiting (nobody else can still add a row), or when
the queue has waited ``max_wait_ms``, counted from the end of the last pass or the latest
job queued, but at most ``PATIENCE`` times that (a participant busy elsewhere, e.g.
building a token table, never stalls the others for long; nothing can deadlock). A
request that finishes, is cancelled or sits between two steps of a slow stream consumer
is simply not active, and one that starts joins at the next flush: continuous batching
for free. A request running alone skips the queue (its passes run in its own threads).

How to run (:func:`batched_forward`). Jobs of one model are grouped by length (padding
wastes compute: :func:`plan_groups`); a group of one row runs the member's ordinary,
unbatched forward (so a lone request is bit-identical to unbatched decoding). In a larger
group, the rows' layers that can stay in the model's :class:`~ensemble_core.slab.Slab` (its
batch KV storage, where the rows' own caches live between passes) are read and written
there, with no copy; the others (sliding layers past their window, a row that sits a pass
out in the middle of the slab) are gathered as follows. The pass gathers every such
row's KV cache into a left-padded batch cache, right-pads the new ids,
passes explicit per-row position ids and a custom 4-D additive mask per layer type (the
same mechanism as :func:`~ensemble_core.verify_inline.packed_masks`): a query sees its
row's real cached keys, the new keys its job allows (causal, or the packed-candidate
block structure) and, on sliding-window layers, only keys less than ``window`` positions
back. Afterwards each row's new keys/values are appended to its own cache with the
layer's own ``update`` (so sliding-layer bookkeeping stays exactly as unbatched).
Everything is exact in arithmetic; only floating-point summation order differs from the
1-row pass (see ``docs/benchmarks.md``, "Batching"). A cache we cannot gather exactly (a
layer type other than :class:`DynamicLayer` / :class:`DynamicSlidingWindowLayer`, a
sliding layer that no longer holds its window) makes that group fall back to per-row
passes.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from .cache import RoomyLayer, RoomySlidingLayer
from .errors import InvalidOptionError
from .slab import Slab


@dataclass(frozen=True)
class BatchingConfig:
    """How concurrent requests share forward passes.

    ``enabled``: on by default (a lone request runs the unbatched pass, so single-caller
    outputs are unchanged). ``max_batch_rows``: rows per member per forward pass (more
    wait for the next pass; also the number of worker threads of ``Ensemble.batch``).
    ``max_wait_ms``: the longest a queued row waits for requests still busy elsewhere
    before its pass runs without them (100: after a pass, eight requests' Python work
    runs one at a time under the GIL before they all queue again; SpecEM x8 on the real
    pair made 3.3-3.5 tokens/s with 20 ms, 3.9-4.4 with 100, 4.2 with 300).
    ``max_pad_ratio``: rows of very different lengths (a 300-token prefill next to
    one-token decode steps) go to separate passes when padding would more than multiply
    the tokens computed by this ratio. ``max_pad_tokens``: nor may padding add more than
    this many tokens to a pass (None: no limit). Long rows are compute-bound on a CPU, and
    a padded token costs as much as a real one while a separate pass costs about one
    weight read: eight GSM8K prompts (90-174 tokens) prefilled in one padded pass took
    3.0-3.1 s on either bundled model, 2.3 s in pairs, 2.6-3.0 s one by one. 64 is about
    one weight read's worth of tokens for the bundled members on this CPU.
    """

    enabled: bool = True
    max_batch_rows: int = 16
    max_wait_ms: float = 100.0
    max_pad_ratio: float = 2.0
    max_pad_tokens: int | None = 64

    def __post_init__(self) -> None:
        if not isinstance(self.enabled, bool):
            raise InvalidOptionError("batching.enabled", self.enabled, "True or False")
        rows = self.max_batch_rows
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
            raise InvalidOptionError("batching.max_batch_rows", rows, "an integer >= 1")
        wait = self.max_wait_ms
        if isinstance(wait, bool) or not isinstance(wait, (int, float)) or not 0 <= wait <= 10_000:
            raise InvalidOptionError("batching.max_wait_ms", wait, "a number of milliseconds in [0, 10000]")
        ratio = self.max_pad_ratio
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio >= 1:
            raise InvalidOptionError("batching.max_pad_ratio", ratio, "a number >= 1")
        pad = self.max_pad_tokens
        if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int) or pad < 0):
            raise InvalidOptionError("batching.max_pad_tokens", pad, "an integer >= 0, or None for no limit")


def batching_config(value: Any) -> BatchingConfig:
    """``Ensemble(batching=...)``: None/True → defaults, False → off, a dict → fields, or a config."""
    if value is None or value is True:
        return BatchingConfig()
    if value is False:
        return BatchingConfig(enabled=False)
    if isinstance(value, BatchingConfig):
        return value
    if isinstance(value, dict):
        return BatchingConfig(**value)
    raise InvalidOptionError("batching", value, "True, False, a dict of BatchingConfig fields or a BatchingConfig")


# ----------------------------------------------------------------------------- jobs
@dataclass(eq=False)
class Job:
    """One model call of one request: ``ids`` fed on ``cache``, logits wanted at ``keep``.

    ``positions`` are the true position ids of ``ids``; ``block[i, j]`` says whether new
    token ``i`` may attend to new token ``j`` (lower-triangular for ordinary decoding).
    ``direct`` runs the very same call unbatched (used for a group of one and as the
    fallback). The result is a float ``[len(keep), V]`` tensor.
    """

    cache: Any
    ids: list[int]
    positions: torch.Tensor
    block: torch.Tensor
    keep: list[int]
    direct: Callable[[], torch.Tensor]
    participant: Participant | None = None
    queued_at: float = 0.0
    done: bool = False
    result: torch.Tensor | None = None
    error: BaseException | None = None


def causal_job(cache: Any, ids: Sequence[int], keep: Sequence[int], direct: Callable[[], torch.Tensor],
               device: Any) -> Job:
    """A job for ids appended after everything in ``cache`` (ordinary incremental decoding)."""
    n = len(ids)
    start = int(cache.get_seq_length())
    block = torch.ones(n, n, dtype=torch.bool, device=device).tril()
    return Job(cache, [int(i) for i in ids], start + torch.arange(n, device=device), block, list(keep), direct)


@dataclass
class Participant:
    """One request as the batcher sees it.

    ``active``: how many of its threads may submit a job now (1 while its thread runs a
    step; the number of member threads while a method runs its members in threads, see
    :meth:`Batcher.threads`; 0 while paused). ``waiting``: its jobs queued and not yet done.
    The request holds up a pass only while ``waiting < active``.
    """

    active: int = 0
    waiting: int = 0


@dataclass
class BatcherStats:
    """What the batcher did: model calls made, rows served, and how many calls held several rows.

    ``slab_in_place``: batched passes whose rows' full-attention states were read where they
    lay (:mod:`~ensemble_core.slab`); ``slab_rebuilt``: passes that first copied rows in.
    """

    model_calls: int = 0
    batched_calls: int = 0
    rows: int = 0
    fallback_rows: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    max_rows: int = 0
    slab_in_place: int = 0
    slab_rebuilt: int = 0
    calls_by_member: dict[str, int] = field(default_factory=dict)
    rows_by_member: dict[str, int] = field(default_factory=dict)
    seconds_by_member: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"model_calls": self.model_calls, "batched_calls": self.batched_calls, "rows": self.rows,
                "fallback_rows": self.fallback_rows, "real_tokens": self.real_tokens,
                "padded_tokens": self.padded_tokens, "max_rows": self.max_rows,
                "slab_in_place": self.slab_in_place, "slab_rebuilt": self.slab_rebuilt,
                "calls_by_member": dict(self.calls_by_member), "rows_by_member": dict(self.rows_by_member),
                "seconds_by_member": dict(self.seconds_by_member)}


# ----------------------------------------------------------------------------- the thread's binding
@dataclass(frozen=True)
class Binding:
    """The batcher and participant a decoding state submits its jobs to."""

    batcher: Batcher
    participant: Participant

    def run(self, member: Any, job: Job) -> torch.Tensor:
        return self.batcher.submit(member, self.participant, job)


_LOCAL = threading.local()


@contextmanager
def bound(binding: Binding | None) -> Iterator[None]:
    """Decoding states created in this thread now submit to ``binding`` (None: no change)."""
    if binding is None:
        yield
        return
    previous = getattr(_LOCAL, "binding", None)
    _LOCAL.binding = binding
    try:
        yield
    finally:
        _LOCAL.binding = previous


def current() -> Binding | None:
    """The binding of the request running in this thread (None: decode unbatched)."""
    return getattr(_LOCAL, "binding", None)


def concurrent_requests() -> int:
    """How many requests decode together with this thread's, itself included (1: unbatched or alone).

    Why: a lever that trades extra tokens per pass for fewer passes (prompt lookup) pays while
    passes are bound by reading the weights, i.e. for few rows; with many rows per pass the
    extra tokens are compute, so a method asks this before choosing how many to feed.
    """
    binding = current()
    return 1 if binding is None else binding.batcher.requests


def member_threads(count: int) -> Any:
    """Context manager for a request about to run ``count`` member threads (see :meth:`Batcher.threads`).

    Yields the ``done`` callback each thread calls when it finishes; without a batcher
    (unbatched decoding) it is a no-op.
    """
    binding = current()
    if binding is None:
        return nullcontext(lambda: None)
    return binding.batcher.threads(binding.participant, count)


def run_job(binding: Binding | None, member: Any, job: Job) -> torch.Tensor:
    """Run ``job`` now (no binding) or through the request's batcher."""
    if binding is None:
        return job.direct()
    return binding.run(member, job)


# ----------------------------------------------------------------------------- the batcher
#: The longest wait for a request that has not queued, in units of ``max_wait_ms``, while others keep queueing.
PATIENCE = 4

class Batcher:
    """Per-ensemble scheduler: one queue per model, flushed by whichever waiting thread sees it ready.

    There is no scheduler thread: the thread whose job completes the condition (or whose
    job waited ``max_wait_ms``) runs the forward passes for everybody, one model after the
    other, while holding no lock; the others sleep on a condition variable.
    """

    def __init__(self, config: BatchingConfig | None = None) -> None:
        self.config = config or BatchingConfig()
        self.stats = BatcherStats()
        self._cond = threading.Condition()
        self._queues: dict[int, tuple[Any, list[Job]]] = {}
        self._participants: dict[int, Participant] = {}
        self._flushing = False
        self._last_pass = 0.0
        self._last_submit = 0.0
        #: per model, the gathered cache buffers of its last batched pass (reused by the next)
        self._buffers: weakref.WeakKeyDictionary[Any, dict[Any, torch.Tensor]] = weakref.WeakKeyDictionary()
        #: per model, the batch KV storage its rows' full-attention layers live in between passes
        self._slabs: weakref.WeakKeyDictionary[Any, Slab] = weakref.WeakKeyDictionary()

    # ---------------------------------------------------------------- requests
    @property
    def requests(self) -> int:
        """Requests decoding now (joined, not paused, not left)."""
        with self._cond:
            return len(self._participants)

    def join(self) -> Participant:
        """A new request, active from now on (a stream joins when it starts)."""
        participant = Participant(active=1)
        with self._cond:
            self._participants[id(participant)] = participant
        return participant

    def pause(self, participant: Participant) -> None:
        """The request waits for its consumer (a stream at a ``yield``): do not wait for it."""
        with self._cond:
            participant.active = 0
            self._forget(participant)
            self._cond.notify_all()  # the others may have been waiting for this one only

    def resume(self, participant: Participant) -> None:
        with self._cond:
            participant.active = 1
            self._participants[id(participant)] = participant

    def leave(self, participant: Participant) -> None:
        """The request is finished (or abandoned); the last one to leave frees the batch KV memory.

        The slabs and gather buffers hold up to ``max_batch_rows`` rows of every layer's keys
        and values; with nobody left they only pin finished requests' memory. A paused stream
        whose row lived in a slab keeps its own views of it.
        """
        self.pause(participant)
        with self._cond:
            if not self._participants and not self._flushing and not any(q for _, q in self._queues.values()):
                self._slabs.clear()
                self._buffers.clear()

    @contextmanager
    def threads(self, participant: Participant, count: int) -> Iterator[Callable[[], None]]:
        """The request's thread hands its turn to ``count`` member threads until the block ends.

        Each member thread calls the yielded ``done`` when it will submit no more jobs. A
        pass then waits for every member thread that is still working (not just for one job
        of the request): the members' draft steps of one request land in the same pass
        instead of alternating between two half-empty ones (measured: SpecEM x8 on the pair
        ran SmolLM2 in 8-row passes next to Gemma-3 in 1-row passes, and then the reverse).
        """
        left = [count]

        def done() -> None:
            with self._cond:
                if left[0] <= 0:
                    return
                left[0] -= 1
                if left[0] > 0:  # the last thread's turn goes back to the request's thread
                    participant.active -= 1
                    self._cond.notify_all()  # the others may have been waiting for this thread only

        with self._cond:
            participant.active += count - 1
            self._participants[id(participant)] = participant
        try:
            yield done
        finally:
            with self._cond:
                if left[0] > 0:
                    participant.active -= left[0] - 1
                    left[0] = 0
                    self._cond.notify_all()

    def _forget(self, participant: Participant) -> None:
        if participant.active <= 0 and participant.waiting <= 0:
            self._participants.pop(id(participant), None)

    # ---------------------------------------------------------------- submitting
    def submit(self, member: Any, participant: Participant, job: Job) -> torch.Tensor:
        """Queue ``job`` and block until its rows are computed (by this thread or another)."""
        max_wait = self.config.max_wait_ms / 1000.0
        with self._cond:
            alone = self._alone(participant)
        if alone:
            return self._run_alone(member, job)
        with self._cond:
            job.participant, job.queued_at = participant, time.perf_counter()
            participant.waiting += 1
            self._participants[id(participant)] = participant
            self._queues.setdefault(id(member.model), (member, []))[1].append(job)
            self._last_submit = job.queued_at
            while not job.done:
                if not self._flushing:
                    taken = self._ready(max_wait)
                    if taken:
                        self._flush(taken)
                        continue
                if self._flushing:  # only the pass's end can change anything, and it notifies everyone:
                    self._cond.wait()  # rows left queued (over max_batch_rows) must not poll next to it
                    continue
                deadline = self._deadline(max_wait)
                timeout = max_wait if deadline is None else max(deadline - time.perf_counter(), 1e-4)
                self._cond.wait(timeout)
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def _alone(self, participant: Participant) -> bool:
        """Whether ``participant`` is the only running request and nothing is queued or running."""
        return (not self._flushing and list(self._participants) == [id(participant)]
                and not any(q for _, q in self._queues.values()))

    def _run_alone(self, member: Any, job: Job) -> torch.Tensor:
        """A lone request's call: the plain pass, now, in the calling thread.

        Nothing can share it, and its members' threads (SpecEM drafting with both members at
        once) then overlap their passes exactly as unbatched decoding does instead of taking
        turns in the batcher (measured: SpecEM x1 at 0.74x of unbatched before this).
        """
        t0 = time.perf_counter()
        with torch.inference_mode():
            result = job.direct()
        self._record(member, jobs=1, lengths=[len(job.ids)], padded=len(job.ids), batched=False,
                     seconds=time.perf_counter() - t0)
        return result

    def _ready(self, max_wait: float) -> list[tuple[Any, list[Job]]]:
        """The jobs to run now (up to ``max_batch_rows`` per model), or [] to keep waiting."""
        queued = [(m, q) for m, q in self._queues.values() if q]
        if not queued:
            return []
        everyone = all(p.waiting >= p.active for p in self._participants.values())
        deadline = self._deadline(max_wait)
        if not everyone and deadline is not None and time.perf_counter() < deadline:
            return []
        rows = self.config.max_batch_rows
        taken = []
        for member, queue in queued:
            taken.append((member, queue[:rows]))
            del queue[:rows]
        return taken

    def _deadline(self, max_wait: float) -> float | None:
        """When the queued jobs run even though some request has not queued yet (None: nothing queued).

        The wait starts at the oldest queued job or at the end of the last pass, whichever
        is later: a job queued while a pass ran is already old when the pass ends, but the
        requests that were inside that pass only now get their rows back (timing the wait
        from the job split SpecEM x8 into 1-2-row passes: 130 s vs 65-79 s). While other
        requests keep queueing jobs, the wait is extended to ``max_wait`` after the latest
        one, up to ``PATIENCE`` times ``max_wait``: after a verify pass, eight requests'
        scoring and bookkeeping run one at a time under the GIL and can take longer than
        ``max_wait``, and a pass started while some of them still compute is slowed by them
        (measured: a 9-token verify-tail pass of 6 rows took 1.6 s instead of 0.55 s).
        """
        oldest = min((j.queued_at for _, q in self._queues.values() for j in q), default=None)
        if oldest is None:
            return None
        since = max(oldest, self._last_pass)
        return min(max(since, self._last_submit) + max_wait, since + PATIENCE * max_wait)

    def _flush(self, taken: list[tuple[Any, list[Job]]]) -> None:
        """Run the taken jobs without the lock (called and returning with it held)."""
        self._flushing = True
        self._cond.release()
        try:
            for member, jobs in taken:
                self._run_member(member, jobs)
        finally:
            self._cond.acquire()
            self._flushing = False
            self._last_pass = time.perf_counter()
            for _, jobs in taken:
                for job in jobs:
                    if job.result is None and job.error is None:
                        job.error = RuntimeError("The batched forward pass was interrupted.")
                    job.done = True
                    p = job.participant
                    if p is not None:
                        p.waiting -= 1
                        self._forget(p)
            self._cond.notify_all()

    def _run_member(self, member: Any, jobs: list[Job]) -> None:
        with torch.inference_mode():
            for group in plan_groups([len(j.ids) for j in jobs], self.config.max_pad_ratio,
                                     self.config.max_pad_tokens):
                self._run_group(member, [jobs[i] for i in group])

    def _run_group(self, member: Any, jobs: list[Job]) -> None:
        t0 = time.perf_counter()
        results: list[torch.Tensor] | None = None
        if len(jobs) > 1:
            try:
                slab = self._slabs.setdefault(member.model, Slab())
                before = (slab.stats.in_place, slab.stats.rebuilt)
                results = batched_forward(member.model, jobs, self._buffers.setdefault(member.model, {}), slab)
                self.stats.slab_in_place += slab.stats.in_place - before[0]
                self.stats.slab_rebuilt += slab.stats.rebuilt - before[1]
            except Exception:  # noqa: BLE001 - an unexpected layout: fall back to exact per-row passes
                results = None
        lengths = [len(j.ids) for j in jobs]
        if results is not None:
            for job, rows in zip(jobs, results):
                job.result = rows
            self._record(member, jobs=len(jobs), lengths=lengths, padded=max(lengths) * len(jobs), batched=True,
                         seconds=time.perf_counter() - t0)
            return
        for job in jobs:
            try:
                job.result = job.direct()
            except Exception as exc:  # handed to the request's own thread
                job.error = exc
        self._record(member, jobs=len(jobs), lengths=lengths, padded=sum(lengths), batched=False,
                     seconds=time.perf_counter() - t0)

    def _record(self, member: Any, jobs: int, lengths: list[int], padded: int, batched: bool,
                seconds: float) -> None:
        """Count a group's passes: one batched call, or one plain call per job (a fallback when > 1)."""
        with self._cond:  # lone requests' member threads record concurrently
            stats = self.stats
            calls = 1 if batched else jobs
            stats.model_calls += calls
            stats.batched_calls += int(batched)
            stats.fallback_rows += jobs if not batched and jobs > 1 else 0
            stats.rows += jobs
            stats.real_tokens += sum(lengths)
            stats.padded_tokens += padded
            stats.max_rows = max(stats.max_rows, jobs if batched else 1)
            name = member.name
            stats.calls_by_member[name] = stats.calls_by_member.get(name, 0) + calls
            stats.rows_by_member[name] = stats.rows_by_member.get(name, 0) + jobs
            stats.seconds_by_member[name] = stats.seconds_by_member.get(name, 0.0) + seconds


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


def _text_config(model: Any) -> Any:
    cfg = model.config
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def model_layer_types(model: Any) -> list[str]:
    """Attention type of every decoder layer (``full_attention`` when the config says nothing)."""
    from .verify_inline import layer_types

    return layer_types(model)


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
        filled = getattr(layer, "is_initialized", False) and layer.keys is not None and layer.keys.dim() == 4
        stored = int(layer.keys.shape[-2]) if filled else 0
        if filled and layer.keys.shape[0] != 1:
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


def _sliding_window(model: Any) -> int | None:
    window = getattr(_text_config(model), "sliding_window", None)
    return int(window) if window else None


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
        allowed = torch.zeros(len(jobs), width_new, k + width_new, dtype=torch.bool, device=device)
        for r, (job, lay) in enumerate(zip(jobs, layouts)):
            v = lay.visible[kind]
            _allow_row(allowed[r], job, lay.context - v, k - v, v, k,
                       window if kind == "sliding_attention" else None)
        masks[kind] = _additive(allowed, dtype)
    return masks


def _slab_mask(jobs: Sequence[Job], contexts: Sequence[int], width_new: int, window: int | None,
               dtype: torch.dtype, device: Any) -> torch.Tensor:
    """The additive mask of layers read from a :class:`~ensemble_core.slab.Slab` (``window``: sliding ones).

    Row ``r``'s cached states sit at columns ``[0, c)`` (column = position) and its new
    tokens right after them, at ``[c, c + N)``; everything past is another row's length or scratch.
    """
    allowed = torch.zeros(len(jobs), width_new, max(contexts) + width_new, dtype=torch.bool, device=device)
    for r, (job, c) in enumerate(zip(jobs, contexts)):
        _allow_row(allowed[r], job, 0, 0, c, c, window)
    return _additive(allowed, dtype)


def _allow_row(allowed: torch.Tensor, job: Job, first_pos: int, ctx_col: int, visible: int, new_col: int,
               window: int | None) -> None:
    """Fill one row's ``[N, K]`` visibility: ``visible`` cached keys (positions from ``first_pos``) at
    columns ``ctx_col ..``, the job's new tokens at ``new_col ..`` (its ``block``), causal by position
    and within ``window`` (sliding layers); padding queries see themselves (no all-masked row)."""
    device = allowed.device
    n, width_new = len(job.ids), allowed.shape[0]
    q = job.positions.to(device)
    k_pos = first_pos + torch.arange(visible, device=device)
    ctx_ok = k_pos[None, :] <= q[:, None]
    new_ok = job.block.to(device)
    if window is not None:
        ctx_ok = ctx_ok & ((q[:, None] - k_pos[None, :]) < window)
        new_ok = new_ok & ((q[:, None] - q[None, :]) < window)
    allowed[:n, ctx_col:ctx_col + visible] = ctx_ok
    allowed[:n, new_col:new_col + n] = new_ok
    pads = torch.arange(n, width_new, device=device)
    allowed[pads, new_col + pads] = True


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``[B, N, K]`` booleans as the ``[B, 1, N, K]`` additive mask attention takes."""
    fill = torch.finfo(dtype).min
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, fill)[:, None]


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
        rows = torch.tensor([r for r, job in enumerate(jobs) for _ in job.keep], dtype=torch.long, device=hidden.device)
        cols = torch.tensor([k for job in jobs for k in job.keep], dtype=torch.long, device=hidden.device)
        logits = head(hidden[rows, cols])
        cap = getattr(_text_config(model), "final_logit_softcapping", None)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return list(logits.float().split([len(job.keep) for job in jobs]))
    wanted = sorted({k for job in jobs for k in job.keep})
    index = torch.tensor(wanted, dtype=torch.long, device=ids.device)
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
    allocates. ``slab``: the model's :class:`~ensemble_core.slab.Slab`, where the rows'
    full-attention states stay between passes (None: gather those layers too).
    """
    from transformers import DynamicCache

    types = model_layer_types(model)
    window = _sliding_window(model)
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
    ids = torch.zeros(len(jobs), width_new, dtype=torch.long, device=device)
    positions = torch.zeros(len(jobs), width_new, dtype=torch.long, device=device)
    for r, job in enumerate(jobs):
        n = len(job.ids)
        ids[r, :n] = torch.tensor(job.ids, dtype=torch.long, device=device)
        pos = job.positions.to(device)
        positions[r, :n] = pos
        positions[r, n:] = pos[-1] + 1 + torch.arange(width_new - n, device=device)
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
