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


@pytest.mark.real  # reads the bundled models' tokenizers from the conversion cache
def test_gpu_check_dry_runs_every_step(tmp_path: Path) -> None:
    tokenizers = tmp_path / "tok"
    tokenizers.mkdir()
    for alias, folder in (("smollm2-135m-instruct", "smol"), ("gemma3-270m", "gemma")):
        (tokenizers / folder).symlink_to(convert_gguf(BUNDLED[alias].locate()))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu_check.py"), "--tokenizers", str(tokenizers),
                           "--out", str(out), "--dry", "--tokens", "8", "--reps", "1"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "gpu_check.json").read_text())
    steps = ("single", "verify_inline", "safe_ceiling", "specem", "placement", "batching")
    assert [s for s in steps if s not in report or "error" in report[s]] == [], {s: report.get(s) for s in steps}
    assert report["verify_inline"]["max_abs_diff_fp32"]["llama-1b"] < 1e-3


@pytest.mark.real  # the bundled tokenizers, as above
def test_gpu_papers_dry_runs_every_step(tmp_path: Path) -> None:
    """``tests/gpu_papers.py`` (#38: the papers' sizes) end to end in its ``--dry`` form."""
    tokenizers = tmp_path / "tok"
    tokenizers.mkdir()
    for alias, folder in (("smollm2-135m-instruct", "smol"), ("gemma3-270m", "gemma"),
                          ("qwen2.5-coder-0.5b-instruct", "qwen")):
        (tokenizers / folder).symlink_to(convert_gguf(BUNDLED[alias].locate()))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "gpu_papers.py"), "--tokenizers", str(tokenizers),
                           "--out", str(out), "--dry", "--tokens", "8"],
                          capture_output=True, text=True, timeout=900, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads((out / "gpu_papers.json").read_text())
    steps = ["bandwidth", "members"] + [label for label, *_ in papers.METHODS]
    assert [s for s in steps if s not in report or "error" in report[s]] == [], {s: report.get(s) for s in steps}
    for name, speeds in report["members"].items():  # every path ran and was timed (a number, not an error;
        # the values themselves are not checked: tiny shapes on a shared CPU say nothing about speed)
        assert all(isinstance(speeds[k], float) for k in
                   ("floor_ms", "eager_ms", "static_generate_ms", "core_single_ms")), (name, speeds)
    assert all(report[label]["tokens"] >= 1 and isinstance(report[label]["ms_per_token"], float)
               for label, *_ in papers.METHODS)
