"""Where the server starts generations, and what it counts about them.

:meth:`Engine.start` is the **one** place a request becomes a generation. It builds a
:class:`ServedRun` (a :class:`~ensemble_core.serving.runtime.Run`: one worker thread per request).
With the ensemble's batching on (the default, :mod:`ensemble_core.decoding.scheduler`) concurrent
requests step at the same time and their rows share each member's forward passes
(continuous batching: a new request joins at the next pass, a finished or disconnected
one stops submitting); with ``batching=False`` the ensemble's lock is held per round and
requests interleave round by round. The app only uses the :class:`Generation` interface:

* ``astream()``: an async iterator of text deltas; closing it early, or cancelling the task
  that awaits it, cancels the generation;
* ``result``: the :class:`~ensemble_core.decoding.generation.GenerationResult` once the stream is exhausted;
* ``cancel()``: stop after the current round (idempotent).

:meth:`Engine.generate_keywords` is the one place that decides which request features
beyond the option policy (tools, tool choice, response format) reach the core.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any, Protocol

from ensemble_core.decoding.generation import GenerationResult
from ensemble_core.ensemble import Ensemble
from ensemble_core.errors import (
    ApiError,
    ConfigurationError,
    EnsembleError,
    GenerationCancelled,
    GenerationTimeout,
    InputError,
    UnsupportedParameterError,
)
from ensemble_core.serving.runtime import Run, config_fields
from ensemble_core.text.chat import Prompt

log = logging.getLogger("ensemble_core.server")

#: Request fields passed to the core (as ``Ensemble.stream`` keywords) when the core takes them.
CORE_FEATURES = ("tools", "tool_choice", "response_format")


class Generation(Protocol):
    result: GenerationResult | None

    def astream(self) -> AsyncIterator[str]: ...

    def cancel(self) -> None: ...


class ServedRun(Run):
    """A :class:`Run` that tells the engine how its core loop ended (from the worker thread)."""

    def __init__(self, engine: Engine, ensemble: Ensemble, prompt: Prompt, overrides: Mapping[str, Any],
                 timeout: float | None) -> None:
        super().__init__(ensemble, prompt, overrides, timeout)
        self._engine = engine
        self.outcome: str | None = None

    def _steps(self) -> Iterator[str]:
        self._engine._began()
        outcome = "failed"
        try:
            yield from super()._steps()
            outcome = "cancelled" if self.result is not None and self.result.finish_reason == "cancelled" else "completed"
        except GenerationTimeout:
            outcome = "timed_out"
            raise
        except (GenerationCancelled, GeneratorExit):
            outcome = "cancelled"
            raise
        except (InputError, ConfigurationError):  # the request's fault, answered 400 (an option checked as the run starts)
            outcome = "rejected"
            raise
        finally:
            self.outcome = outcome
            self._engine._ended(outcome)


class Engine:
    """An ensemble being served: starts generations and counts how they end.

    Counters (``snapshot()``, shown by ``GET /health``): ``started``, ``active``, and by
    outcome of the *core* loop ``completed``, ``cancelled`` (a cancel event stopped it:
    client gone, shutdown), ``timed_out``, ``rejected`` (the core refused the input or an
    option, e.g. a prompt too long for a member's window: answered 400) and ``failed``
    (anything else); ``disconnects`` counts clients that went away before their answer was
    complete (each cancels its generation).

    :meth:`stop_all` ends the live generations at shutdown: each answers with what it has
    (``finish_reason: "cancelled"``) instead of being cut when the server's grace period ends.
    """

    def __init__(self, ensemble: Ensemble, timeout: float | None = None) -> None:
        self.ensemble, self.timeout = ensemble, timeout
        self.fields = config_fields(ensemble)
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(("started", "active", "completed", "cancelled", "timed_out", "rejected",
                                       "failed", "disconnects"), 0)
        self._live: weakref.WeakSet[Run] = weakref.WeakSet()
        self.stopping = False
        params = inspect.signature(ensemble.stream).parameters
        #: Which of :data:`CORE_FEATURES` the core takes: as keywords of ``stream`` or as config fields.
        self.core_features = frozenset(name for name in CORE_FEATURES if name in params or name in self.fields)

    # ------------------------------------------------------------------ the swap point
    def start(self, prompt: Prompt, overrides: Mapping[str, Any], features: Mapping[str, Any] | None = None) -> Generation:
        """Start one generation. Options are validated here (typed errors raise before anything runs); once the
        server is stopping, a new one is refused (503)."""
        run = ServedRun(self, self.ensemble, prompt, {**overrides, **(features or {})}, self.timeout)
        with self._lock:
            if self.stopping:
                raise ApiError(503, "The server is shutting down; send the request again once it is back.",
                               type="server_error", code="server_shutting_down")
            self._live.add(run)
        return run

    def stop_all(self) -> int:
        """Cancel every live generation and refuse new ones (the server is stopping); returns how many.

        Each stops after its current round and answers with the text it has, ``finish_reason:
        "cancelled"``, whole or streamed (its finishing chunk and ``[DONE]``). Without this, uvicorn's
        graceful shutdown waited for them until its timeout and then cut them: a plain-text 500
        (which OpenAI's client retries) or a stream without its end. Safe to call from a signal handler:
        it only sets events.
        """
        with self._lock:
            self.stopping = True
            live = list(self._live)
        for run in live:
            run.cancel()
        if live:
            log.info("Stopping: %d generation(s) cancelled; each answers with what it has", len(live))
        return len(live)

    def generate_keywords(self, requested: Mapping[str, Any]) -> dict[str, Any]:
        """Request features (``tools`` …) → keywords for the core; raises :class:`UnsupportedParameterError` for the others.

        A feature passes through when the core takes it (``Ensemble.stream(tools=...)`` or a
        config field of that name; the core validates it); otherwise a non-neutral value is
        refused naming the field. The response side reads ``result.tool_calls`` and
        ``result.structured`` (``app.tool_calls``, ``app.content``).
        """
        out: dict[str, Any] = {}
        for name, value in requested.items():
            if value is None:
                continue
            if name in self.core_features:
                out[name] = value
            else:
                raise UnsupportedParameterError(
                    name, "tool calling and structured output are not available in this version of the ensemble core")
        return out

    # ------------------------------------------------------------------ bookkeeping
    def _began(self) -> None:  # counted when the worker starts: a run cancelled before that never ran
        with self._lock:
            self.counters["started"] += 1
            self.counters["active"] += 1

    def _ended(self, outcome: str) -> None:
        with self._lock:
            self.counters["active"] -= 1
            self.counters[outcome] += 1

    def client_gone(self) -> None:
        with self._lock:
            self.counters["disconnects"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)


class LoadingState:
    """The ensemble, loaded in a background thread once the socket is bound."""

    def __init__(self) -> None:
        self.engine: Engine | None = None
        self.error: BaseException | None = None
        self.done = threading.Event()
        self.started_at = time.time()
        self.load_seconds: float | None = None

    def load(self, build: Any, timeout: float | None) -> None:
        t0 = time.perf_counter()
        try:
            ensemble = build()
            ensemble.warm_up()  # the first requests would each wait for the members' token tables
            self.engine = Engine(ensemble, timeout)
            self.load_seconds = time.perf_counter() - t0
            log.info("Ready: %s (loaded in %.1f s)", self.engine.ensemble.name, self.load_seconds)
        except BaseException as exc:  # reported by /health; the command exits
            self.error = exc
            log.error("Loading the ensemble failed: %s", exc, exc_info=not isinstance(exc, EnsembleError))
        finally:
            self.done.set()
