"""The notebooks execute end to end on the bundled models (small limits), and are stored without outputs.

Executed with nbclient in a kernel running this interpreter (jupyter_client maps the
kernel spec's ``python`` to ``sys.executable``). A failing cell, including a failing
adapter import, fails the test: nothing here is skipped.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NAMES = ["quickstart.ipynb", "langchain.ipynb", "llamaindex.ipynb", "agents.ipynb"]


def test_notebooks_exist_and_are_stripped() -> None:
    found = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
    assert found == sorted(NAMES)
    for name in NAMES:
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name} has stored outputs"
                limits = [int(n) for n in re.findall(r"max_(?:new_)?tokens=(\d+)", cell.source)]
                # CI time: short replies; 48 where an agent's call and answer must fit (Qwen's call is ~25 tokens)
                assert all(n <= (48 if name == "agents.ipynb" else 32) for n in limits), \
                    f"{name}: keep notebook limits <= 32 tokens (48 in agents.ipynb) ({limits})"


@pytest.mark.real
@pytest.mark.parametrize("name", NAMES)
def test_notebook_executes(name: str, tmp_path: Path) -> None:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    # The kernel is a process of its own beside the suite's other worker: one intra-op thread, as
    # tests/conftest.py gives the workers (torch's default of one per core left two OpenMP pools spinning on
    # 2 cores: quickstart took 178 s next to a busy core instead of 36 s).
    env = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **os.environ,
           "OMP_NUM_THREADS": os.environ.get("ENSEMBLE_TEST_THREADS", "1")}
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)
    texts = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "stream"]
    assert any(t.strip() for t in texts), f"{name} printed nothing"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors
