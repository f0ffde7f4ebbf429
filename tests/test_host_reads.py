"""Host reads per output token (``ensemble_core.bench.host_reads``), counted, not timed (#38).

On a GPU every read of a tensor value (``.item()``, ``float``, ``bool``, ``.tolist()``) waits for the
device, so the methods must read per round, not per candidate or per vocabulary. The count is the
code's, the same on any device: the CPU holds it here; a lent GPU counts the synchronisations
themselves (``tests/gpu_check.py``, ``syncs_per_token``).
"""

from __future__ import annotations

import pytest
import torch

from ensemble_core import Ensemble, Member
from ensemble_core.bench.host_reads import HostReads, cuda_syncs
from ensemble_core.text.distributions import prefix_merge


def test_host_reads_count_scalar_reads_and_tolist_and_restore_tolist() -> None:
    original = torch.Tensor.tolist
    t = torch.arange(6.0)
    with HostReads() as reads:
        assert t.sum().item() == 15.0 and float(t[1]) == 1.0 and bool(t[2] > 1) and int(t[3]) == 3
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
        assert torch.equal(t * 2, torch.arange(0.0, 12.0, 2.0))  # other ops pass through unchanged
    assert reads.counts["item"] == 4 and reads.counts["tolist"] == 1 and reads.per_token(5) == 1.0
    assert torch.Tensor.tolist is original
    with pytest.raises(RuntimeError), HostReads():
        raise RuntimeError("boom")
    assert torch.Tensor.tolist is original  # restored on the way out of an error too
    if not torch.cuda.is_available():
        with cuda_syncs() as syncs:  # without CUDA: nothing to count, and no error
            t.sum().item()
        assert dict(syncs) == {}


def test_prefix_merge_reads_its_scores_once() -> None:
    keys = [b"So", b"Sof", b"Sofia", b" the", b"S"]
    fused = torch.tensor([0.3, 0.2, 0.1, 0.3, 0.1])
    top = torch.tensor([True, True, False, True, True])
    with HostReads() as reads:
        scores = prefix_merge(keys, fused, top)
    assert torch.allclose(scores, torch.tensor([0.6, 0.3, 0.1, 0.3, 0.1]))
    assert reads.total <= 3, reads.counts  # the scores, the drafter's marks, the threshold: not per candidate


#: Reads per output token, measured when these bounds were set (2026-12-05, tiny random pair, 32 tokens):
#: single 1.0 (the chosen id), every-token 4.3 (each member's top-k ids, the fused choice), SAFE with
#: every point ensembled (random members, published drafting) 3.8 (was 8.0: prefix merge read every
#: candidate), SpecEM 0.6 (once per round). The bounds leave ~20 % for honest changes; a read per
#: candidate or per vocabulary entry breaks them.
BOUNDS = {"single": 1.0, "every-token": 5.0, "safe": 4.6, "specem": 1.0}


@pytest.mark.parametrize("method", list(BOUNDS))
def test_reads_per_output_token_stay_per_round(method: str, tiny_llama: Member, tiny_qwen: Member) -> None:
    members = [tiny_llama] if method == "single" else [tiny_llama, tiny_qwen]
    config = {"safe": {"drafter": 0, "published": True}, "specem": {"parallel": False}}.get(method, {})
    ensemble = Ensemble(members, method=method, max_new_tokens=32, batching=False, **config)
    ensemble.generate("Hello there", max_new_tokens=4)  # first-use work (token tables) is not per token
    with HostReads() as reads:
        result = ensemble.generate("Name three primary colors.")
    tokens = result.stats.get("tokens", result.completion_tokens)
    assert tokens >= 16, result
    assert reads.per_token(tokens) <= BOUNDS[method], (dict(reads.counts), tokens)
