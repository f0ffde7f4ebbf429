"""The suite's own process layout: under ``./dev test`` every test file runs whole in one test process.

Why a test: the grouping failed silently once (pytest 9.2 dropped the ``@group`` node ids that xdist's
``xdist_group`` marks rely on), which split every file test by test over both processes: each loaded the
file's models again and both held the Qwen trio at once. ``tests/conftest.py`` now schedules by its own groups.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

from conftest import group_of

ROOT = Path(__file__).resolve().parents[1]
#: Three files, of which only plain-Python tests run (no model is built: the nested processes stay small
#: and quick next to the suite's own).
FILES = ("tests/test_lookup.py", "tests/test_datasets.py", "tests/test_tool_parsers.py")
ONLY_PLAIN = "not scripted and not generate_and_stream and not reports_schema_breaking"


def test_group_of_names_the_shared_groups_and_files() -> None:
    assert group_of("tests/test_agents.py::test_x[a::b]") == group_of("tests/test_demo.py::test_y") == "qwen-real"
    assert group_of("tests/test_ray.py::test_x") == group_of("tests/test_notebooks.py::test_y") == "child-processes"
    assert group_of("tests/test_safe.py::TestA::test_b[x/y]") == "test_safe.py"


def test_each_file_runs_whole_in_one_of_two_processes() -> None:
    env = {**os.environ, "PYTEST_ADDOPTS": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-v", "-p", "no:cacheprovider",
         "-k", ONLY_PLAIN, *FILES],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    workers: dict[str, set[str]] = defaultdict(set)
    for worker, nodeid in re.findall(r"^\[(gw\d+)\] \[\s*\d+%\] PASSED (\S+)", run.stdout, flags=re.M):
        workers[nodeid.split("::")[0]].add(worker)
    assert set(workers) == set(FILES), run.stdout[-3000:]
    assert all(len(w) == 1 for w in workers.values()), dict(workers)
    assert len(set().union(*workers.values())) == 2, dict(workers)  # both processes took work
