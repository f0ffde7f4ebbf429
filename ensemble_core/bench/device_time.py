"""How much of a run its device spends computing: the union of the device's busy intervals.

Why (#38): once a member's step is a captured graph, the host launches a pass in microseconds, so a
run is bound either by the device (its kernels: fewer passes or faster ones help) or by the host (the
Python of every request's token: the methods, the scheduler, the pipeline; on a GPU the device then
idles between passes). Which one shows as the share of the wall time the device is busy. On a GPU
busy means some kernel, copy or fill runs (the union of their intervals, so kernels of several streams
that overlap count once); on a CPU, where the "device" is the host itself, busy means some top-level
torch op runs, and the rest is Python.

The profiler slows the host (a few microseconds per op), never the kernels: take the busy time from a
profiled run and the wall time from an unprofiled run of the same tokens (``tests/gpu_check.py``,
``tests/gpu_papers.py``: ``device_busy_share``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class DeviceTime:
    """What :func:`device_time` measured: ``busy_ms`` of the device over the block's ``wall_ms``."""

    device: str
    busy_ms: float = 0.0
    wall_ms: float = 0.0
    intervals: int = 0  # the events seen: kernels, copies and fills (GPU), ops (CPU)
    error: str | None = None  # why the profiler measured nothing (the block itself ran all the same)

    def share(self, timed_ms: float | None = None) -> float | None:
        """The share of a run's wall time the device is busy: ``busy_ms`` over ``timed_ms``, the wall time
        of an unprofiled run of the same tokens (the profiler lengthens the host's work, not the kernels).
        On a CPU, where the profiler lengthens the ops themselves, and without ``timed_ms``: over this
        profiled block's own wall time. None without a wall time or without a busy interval seen."""
        wall = self.wall_ms if timed_ms is None or self.device == "cpu" else timed_ms
        return self.busy_ms / wall if wall > 0 and self.intervals else None  # nothing seen: unknown, not idle


def busy_union(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals: time during which at least one runs."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def _intervals(prof: Any, device: str) -> list[tuple[float, float]]:
    """The busy intervals (microseconds) of a finished profile: the GPU's own events (kernels, copies,
    fills), or on a CPU its ops (nested ones lie inside their callers, so the union is the same), never
    user annotations. Read from the profiler's raw records where this torch has them: building its
    event tree takes seconds for the 10^5 ops of a CPU run, the raw records milliseconds."""
    from torch.autograd import DeviceType

    kind = DeviceType.CUDA if device == "cuda" else DeviceType.CPU
    raw = getattr(getattr(prof, "profiler", None), "kineto_results", None)
    if raw is not None:
        return [(e.start_ns() / 1000, e.end_ns() / 1000) for e in raw.events()
                if e.device_type() == kind and not e.is_user_annotation()]
    return [(float(e.time_range.start), float(e.time_range.end)) for e in prof.events()
            if e.device_type == kind and not e.is_user_annotation]


def _all_threads() -> object | None:
    """The profiler's option to record the ops of every thread (a batch's request threads run theirs on
    their own; by default only the profiling thread's are recorded), where this torch has it."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):  # an older torch: the profiling thread only (GPU kernels are all seen)
        return None


@contextmanager
def device_time(device: str | None = None) -> Iterator[DeviceTime]:
    """Profile the block and fill the yielded :class:`DeviceTime` on exit. ``device``: ``"cuda"`` or
    ``"cpu"`` (default: ``"cuda"`` where CUDA is available)."""
    from torch.profiler import ProfilerActivity, profile

    kind = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device_time measures 'cuda' or 'cpu', not {kind!r}")
    result = DeviceTime(kind)
    # a GPU's kernels need no record of the host's ops (CUPTI sees them all, whichever thread launched them):
    # recording every op would slow the host for nothing
    activities = [ProfilerActivity.CUDA] if kind == "cuda" else [ProfilerActivity.CPU]
    prof: Any = None
    try:  # a profiler that cannot start costs the measurement, never the run it measures
        prof = profile(activities=activities, experimental_config=_all_threads() if kind == "cpu" else None)
        prof.__enter__()
    except Exception as exc:  # noqa: BLE001 - any profiler failure: the share is unknown, with the reason
        prof, result.error = None, f"{type(exc).__name__}: {exc}"
    start = time.perf_counter()
    try:
        yield result
    finally:
        if kind == "cuda":
            torch.cuda.synchronize()
        result.wall_ms = 1000 * (time.perf_counter() - start)
        if prof is not None:
            try:
                prof.__exit__(None, None, None)
                spans = _intervals(prof, kind)
                result.busy_ms, result.intervals = busy_union(spans) / 1000, len(spans)
            except Exception as exc:  # noqa: BLE001 - as above
                result.error = f"{type(exc).__name__}: {exc}"
