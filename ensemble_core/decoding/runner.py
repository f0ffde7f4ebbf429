"""The model runner: one thread that runs the CPU passes of concurrent requests (vLLM's model runner).

Why: torch's CPU kernels run on OpenMP, and GNU OpenMP keeps a team of helper threads for every
thread that ever ran a parallel region, until that thread ends. Once the teams hold more threads
than there are cores, every helper stops spinning between regions and sleeps, and each region of a
pass waits for them to wake. Concurrent requests (``Ensemble.batch``'s workers, the threads that
LangChain's ``ainvoke``, LlamaIndex's async agents and the server run requests in) each ran passes,
so each kept a team: a SmolLM2-shaped 4-row decode step took 110-132 ms beside three other threads'
idle teams, 78-101 ms without them (2 cores, ``docs/results/runner/idle_teams.py``).

So a request that runs in a thread other than the main one and whose deltas its caller takes at
once (``Ensemble.generate`` and ``batch``, ``Run.run``, ``Run.astream``'s generation thread, which
LangChain, LlamaIndex and the server go through) is *quiet* (:func:`quiet`): it computes its own
vocabulary-wide work (fusion, sampling, masks) with one intra-op thread, which never starts a team,
and hands every CPU pass to the one :class:`ModelRunner` thread, which computes it with the
process's threads in the only team. A member thread of a quiet request (SpecEM drafting both
members at once) is quiet too while other requests run; while its request runs alone it computes
its own passes with every thread, side by side with the other member's (:func:`member_thread`), as
unbatched decoding does. GPU passes and Ray members are not affected: a GPU's kernels do not run
on OpenMP, and a Ray member computes in its actor.

Not to be confused with ``Job.runner`` (a static slot's pass, :mod:`~ensemble_core.decoding.static`):
this module decides *which thread* runs a pass, not how.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

R = TypeVar("R")

_LOCK = threading.Lock()
_LOCAL = threading.local()
#: threads inside :func:`quiet` now, in the whole process
_quiet_threads = 0
#: intra-op threads of the process when the first quiet block began (what the runner computes with)
_process_threads = 0


def _set_threads(count: int) -> None:
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)


@contextmanager
def quiet() -> Iterator[None]:
    """This thread computes with one intra-op thread and hands its CPU passes to the runner.

    ``torch.set_num_threads`` also sets the count that threads started later begin with, so the
    last quiet block to end sets the process's count back (a thread of the user's, started while
    requests ran, begins with one thread; it can set its own). The process's count is read when
    no quiet block runs, under the lock that the last one restores it under.
    """
    global _quiet_threads, _process_threads
    with _LOCK:
        if _quiet_threads == 0:
            _process_threads = max(torch.get_num_threads(), 1)
        _quiet_threads += 1
    entered = threading.get_ident()
    previous = getattr(_LOCAL, "quiet", False)
    _LOCAL.quiet = True
    _set_threads(1)
    try:
        yield
    finally:
        here = threading.get_ident() == entered  # a generator closed by another thread: only the count
        if here:
            _LOCAL.quiet = previous
        with _LOCK:
            _quiet_threads -= 1
            if here:
                _set_threads(1 if previous else _process_threads)
            if _quiet_threads == 0:
                torch.set_num_threads(_process_threads)


@contextmanager
def _loud() -> Iterator[None]:
    """This thread computes with the process's threads (a member thread of a quiet request that runs alone)."""
    previous = getattr(_LOCAL, "quiet", False)
    _LOCAL.quiet = False
    with _LOCK:  # its request is inside a quiet block: the process's count is read
        count = _process_threads
    _set_threads(max(count, 1))
    try:
        yield
    finally:
        _LOCAL.quiet = previous


def member_thread(quiet_request: bool, alone: bool) -> AbstractContextManager[None]:
    """How a member thread of a request computes (entered in the member thread).

    A request that is not quiet: unchanged. A quiet one: quiet while other requests run; alone,
    with every thread and its passes in the member thread. Why: SpecEM's two members draft side
    by side, and one often finishes first; the other then goes on with every core (a first build
    that put both on the runner: four GSM8K answers of the bundled pair 68.8-72.9 s against 57.7-63.0 s).
    """
    if not quiet_request:
        return nullcontext()
    return _loud() if alone else quiet()


def is_quiet() -> bool:
    """Whether this thread is inside :func:`quiet` (its CPU passes go to the runner)."""
    return getattr(_LOCAL, "quiet", False)


def runs_on_cpu(member: Any) -> bool:
    """Whether ``member``'s passes run on this process's CPU (a Ray member's device is a string: no)."""
    device = getattr(member, "device", None)
    return isinstance(device, torch.device) and device.type == "cpu"


def _done() -> None:
    """What a finished :class:`_Call` holds instead of its function."""


@dataclass(eq=False)
class _Call:
    fn: Callable[[], Any]
    inference: bool
    grad: bool
    done: threading.Event
    result: Any = None
    error: BaseException | None = None


class ModelRunner:
    """A daemon thread that runs the functions handed to :meth:`run`, one at a time, in order.

    Its thread computes with the process's intra-op threads (as counted when the first quiet block
    began). The caller's grad mode and inference mode go with each call; the caller waits for the
    call to finish, even through a KeyboardInterrupt (raised after it: the pass writes into the
    caller's cache). Made again in a forked child (the thread does not survive a fork).
    """

    def __init__(self) -> None:
        self.calls = 0
        self._jobs: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = 0
        self._lock = threading.Lock()

    def run(self, fn: Callable[[], R]) -> R:
        """``fn()`` on the runner's thread; its result, or its exception raised here."""
        if threading.current_thread() is self._thread:  # a pass that runs another (nested): here and now
            return fn()
        call = _Call(fn, torch.is_inference_mode_enabled(), torch.is_grad_enabled(), threading.Event())
        self._start()
        self._jobs.put(call)
        interrupted: BaseException | None = None
        while not call.done.is_set():
            try:
                call.done.wait()
            except KeyboardInterrupt as exc:
                interrupted = exc
        if interrupted is not None:
            raise interrupted
        if call.error is not None:
            raise call.error
        return call.result

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._pid == os.getpid() and self._thread.is_alive():
                return
            self._jobs = queue.SimpleQueue()
            self._pid = os.getpid()
            self._thread = threading.Thread(target=self._serve, name="ensemble-model-runner", daemon=True)
            self._thread.start()

    def _serve(self) -> None:
        jobs = self._jobs
        while True:
            call = jobs.get()
            with _LOCK:
                count = _process_threads or torch.get_num_threads()
            _set_threads(max(count, 1))
            try:
                with torch.inference_mode(call.inference), torch.set_grad_enabled(call.grad):
                    call.result = call.fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised in its thread
                call.error = exc
            finally:
                # nothing of a finished call is kept (here until the next call arrived): a pass's jobs hold
                # their requests' caches, and a static slot is lent until its cache is freed (the last batch's
                # slots stayed busy, and every later request fell back to eager passes). The function goes
                # before the caller wakes, so a request that ends frees its slot at once.
                call.fn = _done
                self.calls += 1
                call.done.set()
            del call


_RUNNER = ModelRunner()


def cpu_runner() -> ModelRunner:
    """The process's model runner."""
    return _RUNNER


def where(member: Any) -> Callable[[Callable[[], R]], R]:
    """How this thread runs ``member``'s pass: on the runner (a quiet thread, a CPU member) or here."""
    if is_quiet() and runs_on_cpu(member):
        return _RUNNER.run
    return _here


def _here(fn: Callable[[], R]) -> R:
    return fn()
