"""The GPU check script stays runnable: its ``--dry`` form (tiny shapes, on the CPU) in CI.

``tests/gpu_check.py`` is what a lent GPU runs (``../shared/gpu/README.md``); a session without
a GPU cannot run it for real, so a refactor could break it unseen until device time is being
spent. This runs the same script end to end on the CPU and checks that every step reported
numbers, not an error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ensemble_core.models.bundled import BUNDLED, convert_gguf

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
import gpu_papers as papers  # noqa: E402

#: The papers' method rows the dry run times, eager and graphed (every row is the same code with other
#: members; two keep the run within a few minutes on CI's two cores): SAFE, and SpecEM's packed passes.
DRY_METHODS = ["safe_threshold0_qwen0.5b_qwen7b", "specem_qwen7b_llama8b"]
#: One torch thread per script: CI's two cores already run two test processes.
ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


@pytest.mark.real  # reads the bundled models' tokenizers from the conversion cache
def test_gpu_check_dry_runs_every_step(tmp_path: Path) -> None:
    tokenizers = tmp_path / "tok"
    tokenizers.mkdir()
    for alias, folder in (("smollm2-135m-instruct", "smol"), ("gemma3-270m", "gemma")):
        (tokenizers / folder).symlink_to(convert_gguf(BUNDLED[alias].locate()))
    out = tmp_path / "out"
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu_check.py"), "--tokenizers", str(tokenizers),
                           "--out", str(out), "--dry", "--tokens", "8", "--reps", "1", "--passes", "graphs"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    steps = ("single", "verify_inline", "safe_ceiling", "specem", "placement", "batching", "batching_graphs")
    assert [s for s in steps if s not in report or "error" in report[s]] == [], {s: report.get(s) for s in steps}
    assert report["verify_inline"]["max_abs_diff_fp32"]["llama-1b"] < 1e-3
    rows = report["safe_ceiling"]
    assert all(row["reads_per_token"] >= 0 for row in rows.values()), rows  # the code's reads, counted on a CPU too
    # the device's busy share (on a CPU: the share of the profiled run in torch ops) was measured for every run
    assert all(0 < row["device_busy_share"] <= 1 for row in rows.values()), rows
    # and for 16 concurrent requests over the static pool (not over eager passes: launch-bound, not asked);
    # SpecEM's level (tiny random members write no text tokens with the other methods: no tokens/s to share)
    assert 0 < report["batching_graphs"]["specem"]["16"]["device_busy_share"] <= 1, report["batching_graphs"]
    assert "device_busy_share" not in report["batching"]["specem"]["16"]
    # each pooled member says how its passes ran: on a CPU static passes, no capture, and why not
    pooled = report["batching_graphs"]["passes"]
    assert set(pooled) == {"drafter-135m", "llama-1b", "gemma-1b"}, pooled
    assert all(p["counts"]["static"] > 0 and p["counts"]["captures"] == 0 and "graphs" in p["reasons"]
               for p in pooled.values()), pooled


@pytest.mark.real  # the bundled tokenizers, as above
def test_gpu_papers_dry_runs_every_step(tmp_path: Path) -> None:
    """``tests/gpu_papers.py`` (#38: the papers' sizes) end to end in its ``--dry`` form."""
    tokenizers = tmp_path / "tok"
    tokenizers.mkdir()
    for alias, folder in (("smollm2-135m-instruct", "smol"), ("gemma3-270m", "gemma"),
                          ("qwen2.5-coder-0.5b-instruct", "qwen")):
        (tokenizers / folder).symlink_to(convert_gguf(BUNDLED[alias].locate()))
    out = tmp_path / "out"
    env = {**os.environ, **ONE_THREAD, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu_papers.py"), "--tokenizers", str(tokenizers),
                           "--out", str(out), "--dry", "--tokens", "8", "--passes", "static", "graphs",
                           "--check-steps", "4", "--only", *DRY_METHODS],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "gpu_papers.json").read_text())
    assert set(DRY_METHODS) <= {label for label, *_ in papers.METHODS}
    steps = ["bandwidth", "passes_static", "passes_graphs", "members"] + [
        label + suffix for label in DRY_METHODS for suffix in ("", "_graphs")]
    assert [s for s in steps if s not in report or "error" in report[s]] == [], {s: report.get(s) for s in steps}
    for name, speeds in report["members"].items():  # every path ran and was timed (a number, not an error;
        # the values themselves are not checked: tiny shapes on a shared CPU say nothing about speed)
        assert all(isinstance(speeds[k], float) for k in ("floor_ms", "eager_ms", "static_generate_ms", "core_single_ms",
                                                          "core_single_static_ms", "core_single_graphs_ms")), (name, speeds)
    for name, check in report["passes_static"].items():  # static passes hold to eager on every shape (float32 here)
        assert check["vs_eager"]["same_tokens"] == check["vs_eager"]["steps"] == 4, (name, check)
        assert check["vs_eager"]["max_diff"] < 1e-3 and check["counts"]["fallbacks"] == 0, (name, check)
    for name, check in report["passes_graphs"].items():  # on a CPU "graphs" runs static and says why
        assert check["vs_static"]["max_diff"] == 0.0 and "CUDA" in check["reasons"]["graphs"], (name, check)
    assert all(report[label]["tokens"] >= 1 and isinstance(report[label]["ms_per_token"], float)
               for label in DRY_METHODS)
    assert all(0 < report[label + suffix]["device_busy_share"] <= 1 for label in DRY_METHODS for suffix in ("", "_graphs"))
