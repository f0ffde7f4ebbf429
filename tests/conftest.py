"""Shared fixtures.

* ``smollm2`` / ``gemma3`` / ``real_pair``: the bundled real models (session-scoped; loaded
  once per test process through the member cache). Tests using them carry the ``real`` mark.
* ``qwen``: the third bundled real model, Qwen2.5-Coder-0.5B-Instruct (not a default member).
* ``tiny_llama`` / ``tiny_gemma`` / ``tiny_qwen``: random-weight members built from transformers
  configs with the *real* tokenizers, for fast tests of everything that does not need real weights.

Under ``./dev test`` (pytest-xdist, ``--dist loadgroup``) each file runs whole in one process
(:func:`pytest_xdist_make_scheduler`: the groups are :func:`group_of`, the longest first), and the
files that load the real Qwen2.5-Coder member (:data:`QWEN_FILES`) share one process: the trio takes
~9 GB there (weights and their prepacked copies), and two processes holding it next to the Ray and
notebook tests' own processes ran a 24 GB machine out of memory. The Ray and notebook files
(:data:`OWN_PROCESS_FILES`) also share one xdist process, so that their model-holding child processes
(Ray actors, notebook kernels) never run at the same time: next to the Qwen process they did, and
Ray's memory monitor killed the actors at 95 % of 23.5 GB (full suite, 2026-12-04: six test_ray
failures, none when run apart).
"""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# One intra-op thread: the suite runs generations in worker threads (async adapters) next to
# the main thread, and two OpenMP pools spinning on 2 cores slowed steps 5-20x when measured.
torch.set_num_threads(int(os.environ.get("ENSEMBLE_TEST_THREADS", "1")))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from ensemble_core import Member  # noqa: E402
from ensemble_core.testing import tiny_member  # noqa: E402

#: Test files that load the real Qwen2.5-Coder member: one xdist process runs them all.
QWEN_FILES = ("test_qwen_real.py", "test_trio_real.py", "test_agents.py", "test_demo.py", "test_reliability.py")
#: Test files whose models live in child processes (Ray actors, notebook kernels): one xdist process runs them.
OWN_PROCESS_FILES = ("test_ray.py", "test_notebooks.py")


#: Groups that take the most of a worker's time (a full run: ~690 s and ~530 s of ~2900 s): they start first,
#: one per worker, and the short files fill in after them (long jobs first, as one schedules unequal jobs
#: on two machines), so that neither worker is left alone with a long group at the end.
LONG_GROUPS = ("qwen-real", "child-processes")


def group_of(nodeid: str) -> str:
    """The group a test runs in under ``--dist loadgroup``: its file, or the shared group of its file."""
    filename = nodeid.split("::", 1)[0].rsplit("/", 1)[-1]
    return "qwen-real" if filename in QWEN_FILES else "child-processes" if filename in OWN_PROCESS_FILES else filename


@pytest.hookimpl(tryfirst=True, optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """Under ``--dist loadgroup``, xdist's scheduler of whole scopes with :func:`group_of` as the scope.

    Why not ``xdist_group`` marks: xdist 3.8 passes a mark's group by appending ``@group`` to the node id,
    which pytest 9.2's structured node ids ignore, so every mark was lost and files were split test by test
    over both workers (pytest-dev/pytest-xdist#1386). A scheduler that names its own scopes needs no mark.
    """
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FileGroupScheduling(LoadScopeScheduling):
        """Whole groups per worker, the long groups first (xdist would otherwise order them by test count)."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

        def _assign_work_unit(self, node: object) -> None:
            # Reorder the queue of groups, not the collections: a worker runs tests by their index in
            # the collection it sent, so those must stay as collected.
            for group in reversed(LONG_GROUPS):
                if group in self.workqueue:
                    self.workqueue.move_to_end(group, last=False)
            super()._assign_work_unit(node)

    config.option.loadscopereorder = False
    return FileGroupScheduling(config, log)


def free_cached_models() -> None:
    """Forget the models this process cached for earlier test files that nothing holds any more, and hand
    the memory back to the system.

    Every file's ``Member.load`` calls stay cached per process (``models.loading``: one entry per
    model, dtype and layout), so a test process grows with the files it ran (10 GB each, measured
    in a full run). A model still held (a session fixture's member) stays cached: forgetting it
    freed nothing, and the next file's load of it made a second copy (+4 GB in one process, measured).
    """
    import ctypes

    from ensemble_core.models.loading import clear_loaded
    from ensemble_core.serving.runtime import clear_shared

    clear_shared()  # the shared ensembles hold their members' models
    clear_loaded(unreferenced_only=True)
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # glibc keeps freed pages otherwise
    except (OSError, AttributeError):
        pass


#: A test process that holds more than this much of its own memory (not counting mapped weight files) frees,
#: before its next file, the models earlier files loaded that nothing holds any more (the session fixtures'
#: members stay): the Qwen group's process held 8-10 GB after it, and a full run had 20.6-21.5 of 23.5 GB in
#: use at its peak.
CACHE_LIMIT_BYTES = 6 * 2**30


def own_memory_bytes() -> int:
    """This process's anonymous resident memory (Linux), 0 where ``/proc`` does not say."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


#: Threads of requests an earlier file abandoned (a stream left after a few chunks ends after its round).
REQUEST_THREADS = ("ensemble-generation", "ensemble-batch", "ensemble-member")


def wait_for_abandoned_requests(seconds: float = 60.0) -> None:
    """Until the request threads earlier files left behind have ended and no request computes quietly.

    The model runner's thread count and its count of quiet requests are process-wide: an abandoned
    stream still finishing its round when the next file starts is counted in that file's exact counts
    (``runner._quiet_threads == 0``, the host reads of every thread)."""
    import threading
    import time

    from ensemble_core.decoding import runner

    def left() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith(REQUEST_THREADS)]

    deadline = time.monotonic() + seconds
    while (runner._quiet_threads or left()) and time.monotonic() < deadline:
        time.sleep(0.05)
    if runner._quiet_threads or left():  # a request that never ends: say so rather than wait silently per file
        import warnings

        warnings.warn(f"request threads still running after {seconds:.0f} s: {left()} "
                      f"(quiet requests: {runner._quiet_threads})", stacklevel=2)


@pytest.fixture(scope="module", autouse=True)
def _room_for_the_next_file(request: pytest.FixtureRequest) -> None:
    """Before each file: wait for the requests earlier files abandoned; before a file whose models live in child
    processes (:data:`OWN_PROCESS_FILES`), or when this process holds more than :data:`CACHE_LIMIT_BYTES`: free
    the models cached for earlier files."""
    wait_for_abandoned_requests()
    if request.path.name in OWN_PROCESS_FILES or own_memory_bytes() > CACHE_LIMIT_BYTES:
        free_cached_models()


@pytest.fixture(scope="session")
def smollm2() -> Member:
    return Member.load("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def gemma3() -> Member:
    return Member.load("gemma3-270m")


@pytest.fixture(scope="session")
def qwen() -> Member:
    return Member.load("qwen2.5-coder-0.5b-instruct")


@pytest.fixture(scope="session")
def real_pair(smollm2: Member, gemma3: Member) -> list[Member]:
    return [smollm2, gemma3]


@pytest.fixture(scope="session")
def tiny_llama() -> Member:
    return tiny_member("smollm2-135m-instruct", seed=0)


@pytest.fixture(scope="session")
def tiny_gemma() -> Member:
    return tiny_member("gemma3-270m", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen() -> Member:
    return tiny_member("qwen2.5-coder-0.5b-instruct", seed=0)


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
