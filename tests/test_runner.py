"""The model runner: concurrent requests' CPU passes run in one thread (:mod:`ensemble_core.decoding.runner`).

Threads and calls are counted, never timed: quiet request threads compute with one intra-op thread,
their passes run on the runner, texts equal those of requests run one by one, and the process starts
fewer OpenMP helpers while a batch runs.
"""

from __future__ import annotations

import asyncio
import functools
import os
import subprocess
import sys
import threading
import weakref
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ensemble_core import Ensemble, Member
from ensemble_core.decoding import runner
from ensemble_core.decoding.runner import ModelRunner, cpu_runner, is_quiet, member_thread, quiet, runs_on_cpu, where
from ensemble_core.methods.selection import run_all
from ensemble_core.serving.runtime import Run
from ensemble_core.testing import tiny_member

REPO = Path(__file__).resolve().parents[1]
PROMPTS = ["Hi", "What is 2 + 2?", "Write one sentence about the sea.", "Count: one, two, three,"]


@pytest.fixture(scope="module")
def llama() -> Member:
    return tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def gemma() -> Member:
    return tiny_member("gemma3-270m", seed=0, initializer_range=0.2)


@pytest.fixture()
def two_threads():
    """The process computes with two intra-op threads for the test (the suite's workers use one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def in_thread(fn):
    box = {}

    def work() -> None:
        box["value"] = fn()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    return box["value"]


def test_quiet_threads_compute_with_one_thread_and_the_count_comes_back(two_threads) -> None:
    inside = threading.Event()
    leave = threading.Event()
    seen: dict[str, object] = {}

    def request() -> None:
        with quiet():
            seen["request"] = (torch.get_num_threads(), is_quiet())
            seen["runner"] = cpu_runner().run(torch.get_num_threads)  # the runner computes with every thread
            inside.set()
            leave.wait(30)
        seen["after"] = (torch.get_num_threads(), is_quiet())

    t = threading.Thread(target=request)
    t.start()
    assert inside.wait(30)
    # while a quiet block runs, a member thread of a lone quiet request computes with every thread,
    # one of a request among others is quiet
    seen["alone"] = in_thread(lambda: _inside(member_thread(True, alone=True)))
    seen["among"] = in_thread(lambda: _inside(member_thread(True, alone=False)))
    seen["unquiet request"] = in_thread(lambda: _inside(member_thread(False, alone=False)))
    leave.set()
    t.join()
    assert seen["request"] == (1, True)
    assert seen["runner"] == 2
    assert seen["alone"] == (2, False)
    assert seen["among"] == (1, True)
    assert seen["after"] == (2, False)
    assert runner._quiet_threads == 0
    # the last quiet block set the count that new threads begin with back
    assert in_thread(torch.get_num_threads) == 2


def _inside(context) -> tuple[int, bool]:
    with context:
        return torch.get_num_threads(), is_quiet()


def test_the_runner_hands_back_results_errors_and_the_callers_modes() -> None:
    own = ModelRunner()
    assert own.run(threading.get_ident) != threading.get_ident()
    with pytest.raises(KeyError, match="no such row"):
        own.run(lambda: {}["no such row"])
    # a call made on the runner's own thread runs at once (a pass that runs another would wait for itself)
    assert own.run(lambda: own.run(lambda: 41) + 1) == 42
    with torch.inference_mode():
        assert own.run(torch.is_inference_mode_enabled)
    assert not own.run(torch.is_inference_mode_enabled)
    with torch.no_grad():
        assert not own.run(torch.is_grad_enabled)
    assert own.calls == 6  # the nested call ran inside its caller's


def test_the_runner_keeps_nothing_of_a_finished_call() -> None:
    """A pass's function holds its jobs and their caches (a static slot is lent until its cache is freed): the
    runner lets go of it before the caller wakes, not when the next call arrives."""
    own = ModelRunner()

    class Cache:
        pass

    cache = Cache()
    freed = weakref.ref(cache)
    assert own.run(functools.partial(id, cache)) == id(cache)  # as the batcher's partial holds its jobs
    del cache
    assert freed() is None  # the lambda (and with it the cache) is gone although no other call came


def test_only_a_quiet_threads_cpu_passes_go_to_the_runner(llama: Member) -> None:
    ray_like = type("RemoteMember", (), {"device": "cpu"})()  # a Ray member names its actor's device
    assert runs_on_cpu(llama) and not runs_on_cpu(ray_like)
    me = threading.get_ident()
    assert where(llama)(threading.get_ident) == me
    with quiet():
        assert where(llama)(threading.get_ident) != me
        assert where(ray_like)(threading.get_ident) == me


@pytest.mark.parametrize("method", ["single", "safe", "specem"])
def test_a_batch_runs_its_passes_on_the_runner_and_gives_the_texts_of_requests_one_by_one(
        method: str, llama: Member, gemma: Member) -> None:
    members = [llama] if method == "single" else [llama, gemma]
    options = {"max_new_tokens": 10}
    if method == "specem":
        options["parallel"] = True  # member threads: quiet beside the other requests
    ens = Ensemble(members, method=method, **options)
    alone = [ens.generate(p).text for p in PROMPTS]
    with passes_by_thread(members) as threads:
        batched = ens.batch(PROMPTS)
    assert [r.text for r in batched] == alone
    assert ens.method.batcher.stats.batched_calls > 0
    # no request thread ran a pass: every pass of the batch, shared or alone (the last request's tail), ran on the
    # runner, except SpecEM's drafts while its request ran alone (its member threads then draft side by side; how
    # many rounds a request runs alone depends on when the others finish, so only where the passes ran is counted)
    others = {name for name in threads if name != "ensemble-model-runner"}
    if method == "specem":
        assert threads["ensemble-model-runner"] > 0, threads
        assert all(name.startswith("ensemble-member") for name in others), threads
    else:
        assert threads["ensemble-model-runner"] >= 10 and not others, threads
    assert runner._quiet_threads == 0


@contextmanager
def passes_by_thread(members: list[Member]):
    """Counts the members' forward passes by the name of the thread that ran them."""
    counts: Counter[str] = Counter()

    def count(*_):
        counts[threading.current_thread().name] += 1

    hooks = [m.model.model.layers[0].register_forward_pre_hook(count) for m in members]
    try:
        yield counts
    finally:
        for hook in hooks:
            hook.remove()


def test_a_lone_quiet_requests_member_threads_run_their_own_passes(llama: Member, gemma: Member) -> None:
    # SpecEM alone through asyncio: its members draft side by side, each in its own thread with every
    # intra-op thread (one may finish first); the request thread's own passes go to the runner
    ens = Ensemble([llama, gemma], method="specem", parallel=True, max_new_tokens=10)
    expected = ens.generate("Count: one, two, three,").text
    with passes_by_thread([llama, gemma]) as threads:
        result = asyncio.run(Run(ens, "Count: one, two, three,").arun())
    assert result.text == expected
    drafting = {name for name in threads if name != "ensemble-model-runner"}
    assert drafting and all(name.startswith("ensemble-member") for name in drafting), threads
    assert set(run_all(lambda _: is_quiet(), [0, 1], parallel=True)) == {False}


def test_an_async_request_runs_its_passes_on_the_runner(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=8)
    expected = ens.generate("Hi").text
    with passes_by_thread([llama]) as threads:
        result = asyncio.run(Run(ens, "Hi").arun())
    assert result.text == expected
    assert set(threads) == {"ensemble-model-runner"} and sum(threads.values()) >= 2, threads
    with passes_by_thread([llama]) as threads:
        assert ens.generate("Hi").text == expected
    assert "ensemble-model-runner" not in threads  # a request in the main thread runs its own passes


def test_an_async_request_without_batching_runs_its_passes_on_the_runner(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=8, batching=False)  # run_job without a batcher
    expected = ens.generate("Hi").text
    with passes_by_thread([llama]) as threads:
        assert asyncio.run(Run(ens, "Hi").arun()).text == expected
    assert set(threads) == {"ensemble-model-runner"}, threads


def test_which_requests_in_other_threads_hand_their_passes_to_the_runner(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=8)
    expected = ens.generate("Hi").text
    # a blocking request in a thread of the caller's (LangChain's sync batch, a web framework's worker)
    with passes_by_thread([llama]) as threads:
        assert in_thread(lambda: Run(ens, "Hi").run().text) == expected
    assert set(threads) == {"ensemble-model-runner"}, threads
    # a stream consumed there: the caller's code runs between deltas, so its thread computes as it was
    with passes_by_thread([llama]) as threads:
        assert in_thread(lambda: "".join(ens.stream("Hi"))) == expected
    assert "ensemble-model-runner" not in threads, threads
    assert runner._quiet_threads == 0


def test_a_pass_that_fails_on_the_runner_fails_its_requests_and_the_runner_serves_on(llama: Member) -> None:
    ens = Ensemble([llama], method="single", max_new_tokens=6)
    layer = llama.model.model.layers[0]

    def broken(*args, **kwargs):
        raise RuntimeError("layer 0 is broken")

    layer.forward = broken
    try:
        with pytest.raises(RuntimeError, match="layer 0 is broken"):
            ens.batch(PROMPTS[:2])
    finally:
        del layer.forward
    assert [r.text for r in ens.batch(PROMPTS[:2])] == [ens.generate(p).text for p in PROMPTS[:2]]


#: Runs a batch of six GSM8K-like prompts on the bundled SmolLM2 with two intra-op threads and prints how many
#: threads the process gained at most while it ran (each OpenMP team of a thread adds a helper).
SCRIPT = """
import os, threading, time, torch
torch.set_num_threads(2)
from ensemble_core import Ensemble

def count():
    return len(os.listdir("/proc/self/task"))

ens = Ensemble(["smollm2-135m-instruct"], method="single", max_new_tokens=12, member_options={"prefix_cache": 0})
ens.generate("warm up")
before, peak, stop = count(), [0], threading.Event()

def watch():
    while not stop.is_set():
        peak[0] = max(peak[0], count())
        time.sleep(0.002)

w = threading.Thread(target=watch); w.start()
ens.batch([f"Question {i}: what is {i} + {2 * i}? Think step by step." for i in range(6)])
stop.set(); w.join()
print(before, peak[0])
"""


@pytest.mark.real  # the bundled SmolLM2 (converted on first use)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_a_batch_of_a_real_member_starts_no_openmp_team_per_request() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, peak = map(int, proc.stdout.split()[-2:])
    # six worker threads, the runner, the watcher and the runner's one helper; one team per worker would add six more
    assert peak - before <= 10, proc.stdout
