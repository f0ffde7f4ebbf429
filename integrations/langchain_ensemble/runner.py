"""Running one core generation for an adapter: timeout, cancellation, and an async bridge.

The core's :class:`~ensemble_core.GenerationStream` is a blocking iterator that checks a
``threading.Event`` between rounds. Everything here is built on that one mechanism:

* ``timeout`` sets the event from a timer, and the run then raises
  :class:`GenerationTimeout` (after yielding what was committed before the deadline);
* the async bridge iterates the stream in a worker thread and hands deltas to the event
  loop through an ``asyncio.Queue``, so the loop never blocks on a forward pass; when the
  consuming task is cancelled (or stops iterating), it sets the event and the worker
  stops after the current round.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from contextlib import aclosing
from typing import Any

from ensemble_core import Ensemble, GenerationCancelled, GenerationResult
from ensemble_core.chat import Prompt

from .registry import lock_for


class GenerationTimeout(GenerationCancelled, TimeoutError):
    """A generation ran past the adapter's ``timeout``; it was stopped, not retried."""

    def __init__(self, timeout: float, text_so_far: str = "") -> None:
        self.timeout, self.text_so_far = timeout, text_so_far
        super().__init__(
            f"The ensemble did not finish within timeout={timeout} s and was stopped "
            f"({len(text_so_far)} characters were generated). Raise `timeout`, lower `max_tokens`, "
            "or use fewer / smaller members."
        )


class CoreRun:
    """One generation: iterate it for text deltas; ``result`` is set once it is exhausted.

    The ensemble's lock is held for each round (one ``next`` on the core stream), not for
    the whole generation: concurrent requests on one ensemble interleave round by round
    (each request has its own decoding states; the method object only holds
    request-independent tables), no two rounds compete for the same cores, and a stream
    that its consumer abandons half-way cannot block anybody else.
    """

    def __init__(self, ensemble: Ensemble, prompt: Prompt, overrides: dict[str, Any],
                 timeout: float | None = None) -> None:
        self.ensemble, self.prompt, self.overrides, self.timeout = ensemble, prompt, overrides, timeout
        self.cancel_event = threading.Event()
        self.timed_out = False
        self.result: GenerationResult | None = None

    def cancel(self) -> None:
        """Stop after the current round (idempotent; harmless once finished)."""
        self.cancel_event.set()

    def _on_deadline(self) -> None:
        self.timed_out = True
        self.cancel_event.set()

    def __iter__(self) -> Iterator[str]:
        timer = None
        if self.timeout is not None:
            timer = threading.Timer(self.timeout, self._on_deadline)
            timer.daemon = True
            timer.start()
        lock = lock_for(self.ensemble)
        stream = self.ensemble.stream(self.prompt, cancel=self.cancel_event, **self.overrides)
        deltas = iter(stream)
        try:
            while True:
                with lock:  # a cancelled run still takes one (cheap) step: the core then reports "cancelled"
                    delta = next(deltas, None)
                if delta is None:
                    break
                yield delta
        finally:
            if timer is not None:
                timer.cancel()
            self.cancel_event.set()  # a consumer that stopped early also stops the core loop
        self.result = stream.result
        if self.timed_out and self.result is not None and self.result.finish_reason == "cancelled":
            raise GenerationTimeout(self.timeout or 0.0, self.result.text)
        assert self.result is not None

    def run(self) -> GenerationResult:
        """Generate to the end and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def astream(self) -> AsyncIterator[str]:
        """The same deltas, produced in a worker thread so that the event loop stays free.

        Closing this iterator early or cancelling the task that awaits it cancels the run.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def post(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the loop was closed: nobody is listening any more
                self.cancel()

        def work() -> None:
            try:
                for delta in self:
                    post("delta", delta)
            except BaseException as exc:  # handed to the awaiting task, re-raised there
                post("error", exc)
            else:
                post("done", None)

        worker = threading.Thread(target=work, name="ensemble-generation", daemon=True)
        worker.start()
        try:
            while True:
                kind, value = await queue.get()
                if kind == "delta":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            self.cancel()

    async def arun(self) -> GenerationResult:
        """Generate to the end in a worker thread; cancelling the awaiting task cancels the run."""
        async with aclosing(self.astream()) as deltas:
            async for _ in deltas:
                pass
        assert self.result is not None
        return self.result
