"""Which threads do a member's CPU work: loading leaves the caller's thread without an OpenMP team.

GNU OpenMP keeps a team of helper threads for every thread that ran a parallel region until that
thread ends; once the teams outnumber the cores, every region waits for sleeping helpers. A CPU
member therefore loads in a thread of its own (``loading.in_passing_thread``), so that requests run
from other threads (async frameworks, the server) do not pay for a team the loading left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from ensemble_core.models.loading import MemberSpec, in_passing_thread, on_cpu

REPO = Path(__file__).resolve().parents[1]

#: Loads a bundled member with two intra-op threads, waits until the process's thread count settles
#: (an ended thread's helpers exit after it), then runs one parallel region in the caller's thread:
#: prints the thread counts before and after that region.
SCRIPT = """
import os, time, torch
torch.set_num_threads(2)
from ensemble_core.models.loading import MemberSpec, load_objects

def count():
    return len(os.listdir("/proc/self/task"))

def settled():
    last, since, deadline = count(), time.monotonic(), time.monotonic() + 20
    while time.monotonic() < deadline and time.monotonic() - since < 1.0:
        time.sleep(0.05)
        if count() != last:
            last, since = count(), time.monotonic()
    return last

load_objects(MemberSpec("smollm2-135m-instruct"))
before = settled()
torch.randn(1_000_000).exp_()  # large enough for a parallel region
print(before, count())
"""


@pytest.mark.real  # loads the bundled SmolLM2 (converted on first use)
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads through Linux's /proc")
def test_loading_a_cpu_member_leaves_the_callers_thread_without_an_openmp_team() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600, env=env,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    before, after = map(int, proc.stdout.split()[-2:])
    # the caller's first parallel region starts its team (one helper for two threads): loading left none
    # (loading in the caller's thread leaves it one, and the region then starts nobody: after == before)
    assert after == before + 1, proc.stdout


def test_in_passing_thread_runs_elsewhere_and_hands_back_the_result_or_the_error() -> None:
    caller = threading.get_ident()
    assert in_passing_thread(lambda: threading.get_ident()) != caller

    def fails() -> None:
        raise KeyError("no such weight")

    with pytest.raises(KeyError, match="no such weight"):
        in_passing_thread(fails)


def test_only_cpu_members_load_in_a_thread_of_their_own() -> None:
    # a GPU member loads in the caller's thread: its current CUDA device (torch.cuda.set_device) is per thread
    assert on_cpu(MemberSpec("smollm2-135m-instruct")) and on_cpu(MemberSpec("smollm2-135m-instruct", device="cpu"))
    assert not on_cpu(MemberSpec("smollm2-135m-instruct", device="cuda:1"))
    assert not on_cpu(MemberSpec("smollm2-135m-instruct", device_map="auto"))
