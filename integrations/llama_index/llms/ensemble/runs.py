"""One generation on a shared ensemble, from sync or async code.

The core's :class:`~ensemble_core.GenerationStream` is a blocking iterator (one method
round per step) that checks a ``threading.Event`` between rounds. A :class:`Run` adds the
two things an LLM adapter needs on top:

* the ensemble's lock (:func:`.shared.lock_for`), taken when the first step runs, so
  that generations on one ensemble take turns; a run cancelled while it waits gives up
  without generating;
* an async face that runs the steps in a worker thread, so the event loop keeps serving
  other tasks during forward passes. Cancelling the awaiting task
  or closing the async iterator sets the cancel event; the worker then stops after the
  round it is in, instead of decoding for nobody.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ensemble_core import Ensemble, GenerationCancelled, GenerationResult
from ensemble_core.chat import Prompt

from .shared import lock_for

#: How often a run waiting for the ensemble's lock looks at its cancel event.
LOCK_POLL_S = 0.05


class Run:
    """Iterate for committed text deltas; ``result`` is set once the iterator is exhausted.

    Options are validated when the run is created (``Ensemble.stream`` applies them to the
    method's config), so a bad option raises at the call, not at the first chunk.
    """

    def __init__(self, ensemble: Ensemble, prompt: Prompt, overrides: dict[str, Any]) -> None:
        self.ensemble = ensemble
        self.stream = ensemble.stream(prompt, **overrides)
        self.result: GenerationResult | None = None
        self._iter: Iterator[str] | None = None

    @property
    def cancelled(self) -> bool:
        return self.stream.cancel_event.is_set()

    def cancel(self) -> None:
        """Stop after the current round (idempotent; harmless once finished)."""
        self.stream.cancel()

    def __iter__(self) -> Iterator[str]:
        if self._iter is None:
            self._iter = self._steps()
        return self._iter

    def _steps(self) -> Iterator[str]:
        lock = lock_for(self.ensemble)
        while not lock.acquire(timeout=LOCK_POLL_S):
            if self.cancelled:
                raise GenerationCancelled("The generation was cancelled while waiting for the ensemble.")
        try:
            yield from self.stream
            self.result = self.stream.result
        finally:
            lock.release()
            self.cancel()  # a consumer that stopped early also stops the core loop

    def run(self) -> GenerationResult:
        """Generate to the end (blocking) and return the result."""
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    async def arun(self) -> GenerationResult:
        """Generate to the end in a worker thread; cancelling the awaiting task cancels the run."""
        try:
            return await asyncio.to_thread(self.run)
        except asyncio.CancelledError:
            self.cancel()
            raise

    def close(self) -> None:
        """Cancel and release the ensemble now (a sync consumer that stops iterating early)."""
        self.cancel()
        if self._iter is not None:
            self._iter.close()

    async def adeltas(self) -> AsyncIterator[str]:
        """The deltas, produced by one worker thread that owns the whole iteration.

        The worker, not the event loop, holds the ensemble's lock from the first step to
        the last, so the lock is released as soon as the core loop ends, whatever the
        consumer does; deltas reach the loop through an ``asyncio.Queue``.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def post(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: nobody listens any more
                self.cancel()

        def work() -> None:
            try:
                for delta in self:
                    post("delta", delta)
            except BaseException as exc:  # re-raised in the consuming task
                post("error", exc)
            else:
                post("done", None)

        threading.Thread(target=work, name="ensemble-llamaindex", daemon=True).start()
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
