"""Reaching Ray, placing member actors, calling them with a bound on every wait, releasing them.

Ray is imported here only, and only when a Ray member is built (:func:`import_ray`), so
the library keeps working without it. A member actor is shared by every ensemble of the
process that asks for the same model on the same resources, like local weights
(``members._LOADED``); :func:`release` drops one reference and kills the actor with the
last one. A shared actor that is dead for good (killed, or its restarts used up) or
belongs to an earlier Ray session (``ray.shutdown()`` and a new ``ray.init()``) is never
handed out again: :func:`acquire` places a fresh one instead.

:class:`ActorLink` is the one place that waits for an actor. Every ``ray.get`` has a
timeout, and every failure becomes a typed error naming the member, its node and what to
do (:class:`~ensemble_core.errors.MemberUnavailableError`); the member's own errors
(``InputError``...) come back as themselves. Request states are freed by a weak
finalizer (so a request dropped half-way, by an error or a cancelled stream, frees them
too): the finalizer only queues the id, and a daemon thread hands the queue to the
actor, because Ray must not be called from inside a garbage collection.
"""

from __future__ import annotations

import pickle
import queue
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ensemble_core.errors import EnsembleError, MemberUnavailableError, MissingDependencyError, ModelLoadError, StateLostError
from ensemble_core.models.loading import MemberSpec
from ensemble_core.remote.actor import MemberActor
from ensemble_core.remote.options import RayMemberSpec, RayOptions

_LOCK = threading.Lock()
#: How often a call that found its actor restarting asks again (within ``call_timeout_s``).
RESTART_POLL_S = 0.25
#: How long :func:`acquire` waits for a shared actor's answer to a liveness probe (a dead actor's
#: fails at once; a busy one's is not awaited: busy counts as alive).
PROBE_S = 0.05
#: Why an actor is gone for good, and what to do (retrying on it cannot work): no restart left...
DIED = "died for good (killed, or its restarts, RayOptions.max_restarts, used up)"
DEAD_FIX = (
    "Build the Ensemble again: a new Ensemble of this member places a fresh actor and loads the model there. "
    "If it keeps dying, look at the node (`ray status`, `ray logs`; out of memory is the usual cause) or raise "
    "RayOptions.max_restarts."
)
#: ... or placed in an earlier Ray session (its handle means nothing in this one).
STALE = "belongs to an earlier Ray session (ray.shutdown() / a new ray.init() since it was placed)"
STALE_FIX = (
    "Build the Ensemble again: a new Ensemble of this member places a fresh actor in the Ray this process is "
    "joined to now (close() ensembles before ray.shutdown() to free their actors)."
)


def import_ray() -> Any:
    """The ``ray`` module, or a typed error that says how to install it."""
    try:
        import ray
    except ImportError as exc:
        raise MissingDependencyError("ray", "members on Ray actors (backend='ray')", "pip install 'tokensemble[ray]'") from exc
    return ray


def connect(options: RayOptions) -> Any:
    """Join the Ray of ``options.address``, or the one this process already joined, or start a small local one."""
    ray = import_ray()
    with _LOCK:
        if not ray.is_initialized():
            kwargs: dict[str, Any] = {"namespace": options.namespace, "log_to_driver": True}
            if options.address is not None:
                ray.init(address=options.address, **kwargs)
            else:
                # "local": a new Ray of this process, even if `ray start` runs on this machine (join that with "auto")
                ray.init(address="local", include_dashboard=False, object_store_memory=options.object_store_memory, **kwargs)
    return ray


def session_of(ray: Any) -> tuple[str, ...] | None:
    """Which Ray connection this process has now (GCS address, node, job): a new ``ray.init()`` changes it,
    even of the same cluster (a new job). None where Ray cannot say (Ray Client)."""
    try:
        context = ray.get_runtime_context()
        return (str(context.gcs_address), str(context.get_node_id()), str(context.get_job_id()))
    except Exception:
        return None


@dataclass
class WireCounter:
    """Calls and pickled bytes sent to / received from one actor (``RayOptions.count_bytes``)."""

    calls: int = 0
    sent: int = 0
    received: int = 0
    by_op: dict[str, list[int]] = field(default_factory=dict)  # op -> [calls, sent, received]

    def add(self, op: str, sent: int, received: int) -> None:
        self.calls += 1
        self.sent += sent
        self.received += received
        row = self.by_op.setdefault(op, [0, 0, 0])
        row[0] += 1
        row[1] += sent
        row[2] += received

    def reset(self) -> None:
        self.calls = self.sent = self.received = 0
        self.by_op.clear()


class ActorLink:
    """Calls to one member actor, each bounded by ``call_timeout_s``; failures become typed errors."""

    def __init__(self, ray: Any, handle: Any, name: str, options: RayOptions) -> None:
        self.ray, self.handle, self.name, self.options = ray, handle, name, options
        self.node = "(not started)"
        #: The Ray connection the actor was placed from (its handle means nothing in another one).
        self.session = session_of(ray)
        #: Why the actor is gone for good (dead, or of an earlier Ray session), once a call found out; else None.
        self.dead: str | None = None
        self.wire = WireCounter()
        #: Measure pickled sizes of calls and answers (``RayOptions.count_bytes``; the benchmark turns it on).
        self.count_bytes = options.count_bytes
        #: State ids to free, ``threading.Event`` marks (set once everything before them is sent), None to stop.
        self._freed: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._send_lock = threading.Lock()
        self._closed = False
        self._flusher = threading.Thread(target=self._flush_loop, name=f"free-states-{name}", daemon=True)
        self._flusher.start()

    # ------------------------------------------------------------------ waiting
    def wait(self, ref: Any, what: str, timeout: float | None = None) -> Any:
        """``ray.get(ref)`` within the timeout; Ray's failures as :class:`MemberUnavailableError`."""
        ray = self.ray
        limit = self.options.call_timeout_s if timeout is None else timeout
        try:
            return ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError as exc:
            raise MemberUnavailableError(self.name, self.node, f"did not answer {what} within {limit:g} s") from exc
        except ray.exceptions.ActorDiedError as exc:  # no restart left (or killed with no_restart): for good
            self.dead = DIED
            raise self._dead_error(what) from exc
        except ray.exceptions.RayActorError as exc:  # ActorUnavailableError: restarting or unreachable for now
            raise MemberUnavailableError(
                self.name,
                self.node,
                f"failed during {what}: its Ray actor died or became unreachable (this request's decoding state is gone)",
            ) from exc
        except ray.exceptions.RayTaskError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, StateLostError):
                raise MemberUnavailableError(
                    self.name, self.node, "was restarted and no longer holds this request's decoding state"
                ) from exc
            if isinstance(cause, EnsembleError):
                raise cause from None
            raise

    def _dead_error(self, what: str) -> MemberUnavailableError:
        fix = STALE_FIX if self.dead == STALE else DEAD_FIX
        return MemberUnavailableError(self.name, self.node, f"failed during {what}: its Ray actor {self.dead}", fix)

    def submit(self, method: str, *args: Any, what: str | None = None) -> Any:
        """``handle.<method>.remote(*args)``; a call Ray refuses to send (an actor of an earlier Ray
        session, one Ray no longer knows) as :class:`MemberUnavailableError` (``what``: the call, for it)."""
        try:
            with self._send_lock:
                return getattr(self.handle, method).remote(*args)
        except Exception as exc:
            if self.session != session_of(self.ray):
                self.dead = STALE
            else:
                self.dead = f"cannot be reached ({type(exc).__name__}: {exc})"
            raise self._dead_error(what or method) from exc

    def gone(self) -> bool:
        """Whether the actor is dead for good or of another Ray session (one cheap look; a busy actor is alive)."""
        if self.dead is None and self.session != session_of(self.ray):
            self.dead = STALE
        if self.dead is not None:
            return True
        ray = self.ray
        try:
            ref = self.submit("held")
        except MemberUnavailableError:
            return True
        ready, _ = ray.wait([ref], timeout=PROBE_S)
        if ready:
            try:
                ray.get(ref, timeout=0)
            except ray.exceptions.ActorDiedError:
                self.dead = DIED
            except Exception:  # restarting, or any other answer: not dead for good
                pass
        return self.dead is not None

    def _until_restarted(self, ask: Callable[[], Any], what: str) -> Any:
        """``wait(ask())``, asking again while Ray restarts the actor (only for calls safe to repeat)."""
        deadline = time.monotonic() + self.options.call_timeout_s
        while True:
            try:
                return self.wait(ask(), what, max(deadline - time.monotonic(), 0.001))
            except MemberUnavailableError as exc:
                restarting = isinstance(exc.__cause__, self.ray.exceptions.ActorUnavailableError)
                if not restarting or time.monotonic() + RESTART_POLL_S >= deadline:
                    raise
                time.sleep(RESTART_POLL_S)

    def call(self, sid: int, changes: Sequence[Any], op: str, args: Sequence[Any]) -> Any:
        """One operation on state ``sid`` after its pending ``changes`` (see ``MemberActor.call``).

        A state's first call starts it afresh on the actor, so it is repeated while the actor
        restarts (the first request after a failure waits for the reloaded model); any later
        call fails at once, because the restarted actor has lost the state.
        """
        payload = (sid, list(changes), op, list(args))
        if changes and changes[0][0] == "start":
            answer = self._until_restarted(lambda: self.submit("call", *payload, what=op), op)
        else:
            answer = self.wait(self.submit("call", *payload, what=op), op)
        if self.count_bytes:
            self.wire.add(op, len(pickle.dumps((sid, changes, op, args), protocol=5)), len(pickle.dumps(answer, protocol=5)))
        return answer

    # ------------------------------------------------------------------ freeing states
    def forget(self, sid: int) -> None:
        """Queue state ``sid`` to be freed (safe from a finalizer: no lock, no Ray call)."""
        self._freed.put(sid)

    def _flush_loop(self) -> None:
        """Send queued frees in batches (the only sender of frees, so a mark orders them before a count)."""
        stop = False
        while not stop:
            items = [self._freed.get()]
            while True:
                try:
                    items.append(self._freed.get_nowait())
                except queue.Empty:
                    break
            stop = any(item is None for item in items)
            sids = [item for item in items if isinstance(item, int)]
            if sids:
                with self._send_lock:
                    try:
                        self.handle.free.remote(sids)
                    except Exception:  # the actor is gone: so are its states
                        pass
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()

    def held(self) -> int:
        """States the actor holds once every free queued so far has reached it."""
        mark = threading.Event()
        self._freed.put(mark)
        if not self._closed:  # a closed link's frees are not sent any more (its actor is gone)
            mark.wait(self.options.call_timeout_s)
        return int(self._until_restarted(lambda: self.submit("held"), "held"))

    def rss(self) -> int:
        """Resident memory of the actor process, in bytes."""
        return int(self._until_restarted(lambda: self.submit("rss"), "rss"))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._freed.put(None)


@dataclass
class Placed:
    """A member actor shared in this process: its link, what it reported, who uses it."""

    link: ActorLink
    info: dict[str, Any]
    spec: MemberSpec
    users: int = 0


_PLACED: dict[Hashable, Placed] = {}


def acquire(placement: RayMemberSpec, options: RayOptions, member_options: dict[str, Any] | None = None) -> Placed:
    """The actor for ``placement`` (placed and loaded on first use, then shared); counts one more user.

    A shared actor that is gone for good (:meth:`ActorLink.gone`: dead, or of an earlier Ray
    session) is dropped from the share, and a fresh one is placed: its remaining users keep
    the dead one, whose calls say so.
    """
    spec = placement.spec(**(member_options or {}))
    key = (spec, placement.placement_key(options))
    ray = connect(options)
    while True:
        with _LOCK:
            placed = _PLACED.get(key)
        if placed is None:
            break
        gone = placed.link.gone()  # outside the lock: it may wait PROBE_S for the actor
        with _LOCK:
            if _PLACED.get(key) is not placed:  # released or replaced meanwhile: look again
                continue
            if not gone:
                placed.users += 1
                return placed
            del _PLACED[key]
        _drop(placed)
    actor_options = placement.actor_options(options)
    handle = ray.remote(MemberActor).options(**actor_options).remote(spec, options.torch_threads)
    link = ActorLink(ray, handle, spec.name or str(spec.source), options)
    try:
        info = link.wait(handle.info.remote(), "its start (placing the actor and loading the model)", options.start_timeout_s)
    except MemberUnavailableError as exc:
        link.close()
        ray.kill(handle, no_restart=True)
        if isinstance(exc.__cause__, ray.exceptions.GetTimeoutError):
            raise MemberUnavailableError(
                link.name,
                "(none)",
                f"could not be started: {exc.reason}",
                f"Check that the cluster has a node with {actor_options} free (`ray status`), or raise "
                "RayOptions.start_timeout_s for large models.",
            ) from exc
        raise ModelLoadError(
            f"Member {link.name!r} could not be loaded in its Ray actor ({exc.__cause__}). Check that the model "
            "exists on that node (an alias's package, the local path, or the hub id in the node's cache)."
        ) from exc
    link.name, link.node = info["name"], f"{info['node_id'][:12]} ({info['host']})"
    with _LOCK:
        placed = _PLACED.setdefault(key, Placed(link, info, spec))
        placed.users += 1
    if placed.link is not link:  # another thread placed the same member meanwhile
        link.close()
        ray.kill(handle, no_restart=True)
    return placed


def _drop(placed: Placed) -> None:
    """Stop ``placed``'s link and kill its actor (no error if it is gone already)."""
    placed.link.close()
    if placed.link.session == session_of(placed.link.ray):  # an earlier session's actor died with it
        try:
            placed.link.ray.kill(placed.link.handle, no_restart=True)
        except Exception:  # already gone (Ray shut down, node lost)
            pass


def release(link: ActorLink | None = None) -> None:
    """Drop one user of ``link``'s actor (all actors when None); the last user kills it."""
    with _LOCK:
        for key, placed in list(_PLACED.items()):
            if link is not None and placed.link is not link:
                continue
            placed.users = 0 if link is None else placed.users - 1
            if placed.users <= 0:
                del _PLACED[key]
                _drop(placed)
