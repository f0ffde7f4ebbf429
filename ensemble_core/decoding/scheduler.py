"""The scheduler of batched decoding: which requests' rows share a forward pass, and when.

Decode on a CPU (and on a small GPU model) is memory-bound: a SmolLM2-135M float32 step
reads ~540 MB of weights whatever the number of rows it computes. So requests that run at
the same time should share their forward passes. Methods (SAFE, SpecEM, the baselines)
stay per-request code; batching happens one level down, where every model call goes
through :class:`~ensemble_core.decoding.members.DecodeState` (``score``) or
:mod:`~ensemble_core.decoding.verify_inline` (``_forward``: draft steps on a cache branch,
packed candidate scoring). Each call becomes a :class:`Job`; a request's thread submits it to the
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

How to run: :func:`~ensemble_core.decoding.forward.batched_forward` (the forward layer). Which
thread runs a pass: a quiet request thread (:mod:`~ensemble_core.decoding.runner`) hands its CPU
passes, lone and batched, to the model runner, so that concurrent requests compute in one
OpenMP team; any other thread runs them itself.
"""

from __future__ import annotations

import functools
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from ensemble_core.decoding.forward import (
    Job,
    batched_forward,
    greedy_choices,
    plan_groups,
    run_alone,
    run_pass,
    run_steps,
)
from ensemble_core.decoding.runner import where
from ensemble_core.decoding.slab import Slab
from ensemble_core.errors import InvalidOptionError
from ensemble_core.options import check_bool, check_int, check_number


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
        check_bool("batching.enabled", self.enabled)
        check_int("batching.max_batch_rows", self.max_batch_rows, 1)
        check_number("batching.max_wait_ms", self.max_wait_ms, 0, 10_000, expected="a number of milliseconds in [0, 10000]")
        check_number("batching.max_pad_ratio", self.max_pad_ratio, 1)
        check_int("batching.max_pad_tokens", self.max_pad_tokens, 0, optional=True,
                  expected="an integer >= 0, or None for no limit")


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
    lay (:mod:`~ensemble_core.decoding.slab`); ``slab_rebuilt``: passes that first copied rows in.
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
        return where(member)(lambda: run_alone(job))
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
        """A lone request's call: the plain pass, now, in the calling thread (a quiet one's: on the runner).

        Nothing can share it, and its members' threads (SpecEM drafting with both members at
        once) then overlap their passes exactly as unbatched decoding does instead of taking
        turns in the batcher (measured: SpecEM x1 at 0.74x of unbatched before this).
        """
        def one_pass(jobs: list[Job]) -> None:
            (step,) = jobs
            t0 = time.perf_counter()
            try:
                step.result = run_pass(step)
            except Exception as exc:  # noqa: BLE001 - raised below, in the request's thread
                step.error = exc
            self._record(member, jobs=1, lengths=[len(step.ids)], padded=len(step.ids), batched=False,
                         seconds=time.perf_counter() - t0)

        def passes() -> None:
            with torch.inference_mode():
                run_steps([job], one_pass)

        where(member)(passes)
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

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
        # a queue is in submission order (appended under the lock, taken from the front): its first job is its oldest
        oldest = min((q[0].queued_at for _, q in self._queues.values() if q), default=None)
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
                where(member)(functools.partial(self._run_member, member, jobs))
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
        """The member's taken jobs, grouped by length; then the next steps of those that ask for several
        (:func:`~ensemble_core.decoding.forward.run_steps`), all in one pass per step."""
        with torch.inference_mode():
            run_steps(jobs, lambda passing: self._run_groups(member, passing))

    def _run_groups(self, member: Any, jobs: list[Job]) -> None:
        for group in plan_groups([len(j.ids) for j in jobs], self.config.max_pad_ratio, self.config.max_pad_tokens):
            self._run_group(member, [jobs[i] for i in group])

    def _run_group(self, member: Any, jobs: list[Job]) -> None:
        static = getattr(member, "static", None)
        if static is not None and len(jobs) > 1:  # rows on the member's static slots apart from the others
            on_pool = [job for job in jobs if static.owns(job)]
            if 0 < len(on_pool) < len(jobs):
                self._run_group(member, on_pool)
                self._run_group(member, [job for job in jobs if not static.owns(job)])
                return
        t0 = time.perf_counter()
        results: list[torch.Tensor] | None = None
        if len(jobs) > 1 and static is not None:  # rows on the member's static slots: one pass over its pool
            results = static.run_batch(jobs)
        if len(jobs) > 1 and results is None:
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
            greedy_choices(jobs, results)
            for job, rows in zip(jobs, results):
                job.result = rows
            self._record(member, jobs=len(jobs), lengths=lengths, padded=max(lengths) * len(jobs), batched=True,
                         seconds=time.perf_counter() - t0)
            return
        for job in jobs:
            try:
                job.result = run_pass(job)
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


