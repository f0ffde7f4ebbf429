"""The device's busy share of a run (``ensemble_core.bench.device_time``, #38).

On a GPU it says whether a method is bound by the device or waits on the host; the GPU scripts report it
per method (``device_busy_share``). Here: the interval union it rests on, and real runs of a tiny member
on the CPU, where busy means some torch op runs (the batch's request threads included).
"""

from __future__ import annotations

import time

import pytest
import torch

from ensemble_core import Ensemble
from ensemble_core.bench.device_time import DeviceTime, busy_union, device_time
from ensemble_core.testing import tiny_member


def test_busy_union_counts_overlapping_intervals_once() -> None:
    assert busy_union([]) == 0.0
    assert busy_union([(0, 2), (1, 3), (5, 6)]) == 4.0  # two overlapping, one apart
    assert busy_union([(0, 10), (2, 3), (4, 5)]) == 10.0  # nested: the outer interval only
    assert busy_union([(5, 6), (0, 1), (1, 2)]) == 3.0  # any order; touching intervals do not double count


def test_share_uses_the_timed_wall_on_a_gpu_and_its_own_on_a_cpu() -> None:
    gpu, cpu = DeviceTime("cuda", 5.0, 20.0, intervals=3), DeviceTime("cpu", 5.0, 20.0, intervals=3)
    assert gpu.share() == 0.25 and gpu.share(10.0) == 0.5  # an unprofiled run's wall: the kernels are not slowed
    assert cpu.share(10.0) == 0.25  # the profiler lengthens a CPU's ops: the profiled run's own wall
    assert DeviceTime("cuda").share() is None and DeviceTime("cuda", 0.0, 5.0, 0).share() is None  # nothing seen
    with pytest.raises(ValueError, match="'cuda' or 'cpu'"), device_time("mps"):
        pass


def test_a_spin_is_busy_and_a_sleep_is_not() -> None:
    x = torch.randn(192, 192)
    with device_time("cpu") as spin:
        for _ in range(40):
            x = torch.tanh(x @ x)
    with device_time("cpu") as idle:
        time.sleep(0.05)
        torch.ones(1).add_(1)
    assert spin.intervals >= 80 and spin.share() > 0.5, spin  # mostly inside ops (matmul, tanh)
    assert idle.intervals >= 1 and idle.busy_ms < 5 and idle.share() < 0.1, idle  # mostly waiting


def test_a_batch_counts_the_ops_of_its_request_threads() -> None:
    """``Ensemble.batch`` runs each request in a thread of its own: their ops count too (by default the
    profiler records the profiling thread's only, which would read a batch as idle)."""
    member = tiny_member("smollm2-135m-instruct")
    ensemble = Ensemble([member], method="single", max_new_tokens=6)
    prompts = ["Count to three.", "Name a colour.", "Say hi."]
    ensemble.batch(prompts[:1])
    with device_time("cpu") as batch:
        results = ensemble.batch(prompts)
    assert all(r.stats.tokens >= 1 for r in results)
    assert batch.intervals > 50 and 0.05 < batch.share() <= 1.0, batch
    with device_time("cpu") as alone:
        ensemble.generate(prompts[0])
    assert alone.intervals > 10 and 0.05 < alone.share() <= 1.0, alone


def test_a_profiler_that_cannot_start_costs_the_measurement_not_the_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU box the profiler may be unusable (no CUPTI, another profiler running): the run it measures goes
    on, and the share is unknown with the reason, so one missing figure never costs a GPU step its others."""
    import torch.profiler

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUPTI_ERROR_NOT_INITIALIZED")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    with device_time("cpu") as busy:
        y = torch.ones(3) * 2
    assert torch.equal(y, torch.full((3,), 2.0)) and busy.wall_ms > 0
    assert busy.share() is None and busy.error == "RuntimeError: CUPTI_ERROR_NOT_INITIALIZED"
    with pytest.raises(KeyError), device_time("cpu"):  # the block's own errors still reach the caller
        raise KeyError("boom")
