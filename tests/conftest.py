"""Shared fixtures.

* ``smollm2`` / ``gemma3`` / ``real_pair``: the bundled real models (session-scoped; loaded
  once per test process through the member cache). Tests using them carry the ``real`` mark.
* ``qwen``: the third bundled real model, Qwen2.5-Coder-0.5B-Instruct (not a default member).
* ``tiny_llama`` / ``tiny_gemma`` / ``tiny_qwen``: random-weight members built from transformers
  configs with the *real* tokenizers, for fast tests of everything that does not need real weights.
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
