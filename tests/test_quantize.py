"""Dynamic int8 members (ensemble_core.models.quantize): options, loading, numerics, decoding.

A tiny random-weight member with SmolLM2's real tokenizer is saved to a directory and
loaded back through the ordinary load path, with and without ``quantize="int8"``, so the
per-process model cache, the head and incremental decoding are all the real ones. The
speed and quality effect on the bundled members is measured in docs/benchmarks.md.
"""

from __future__ import annotations

import pytest
import torch
from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear

from ensemble_core import Ensemble, Member
from ensemble_core.errors import InvalidOptionError
from ensemble_core.models.loading import MemberSpec, per_member_options
from ensemble_core.models.products import CpuLinear
from ensemble_core.testing import greedy_decode, random_ids, reference_greedy, tiny_member


def test_spec_rejects_what_int8_cannot_do() -> None:
    for bad, says in [({"quantize": "int4"}, "'int8'"),
                      ({"quantize": "int8", "device": "cuda:0"}, "off the CPU"),
                      ({"quantize": "int8", "device_map": "auto"}, "off the CPU"),
                      ({"quantize": "int8", "dtype": "bfloat16"}, "dtype='float32'")]:
        with pytest.raises(InvalidOptionError, match="quantize") as info:
            MemberSpec("smollm2-135m-instruct", **bad)
        assert says in str(info.value), (bad, str(info.value))
    assert MemberSpec("smollm2-135m-instruct", quantize="int8", device="cpu").quantize == "int8"


def test_per_member_options_read_one_value_for_all_or_one_each() -> None:
    assert per_member_options(2, "auto", (), ("int8",)) == [{"dtype": "auto", "quantize": "int8"}] * 2
    assert per_member_options(2, "float32", ("cpu",), ("none", "int8")) == [
        {"dtype": "float32", "device": "cpu", "quantize": None},
        {"dtype": "float32", "device": "cpu", "quantize": "int8"}]
    with pytest.raises(InvalidOptionError, match="one per member \\(3\\)"):
        per_member_options(3, "auto", (), ("int8", "none"))


@pytest.fixture(scope="module")
def saved_tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    member = tiny_member("smollm2-135m-instruct", seed=3, hidden=128, layers=2)
    path = tmp_path_factory.mktemp("tiny-smollm2")
    member.model.save_pretrained(path)
    member.tokenizer.save_pretrained(path)
    return str(path)


def test_int8_member_is_its_own_model_with_a_float_head(saved_tiny: str) -> None:
    plain, int8 = Member.load(saved_tiny), Member.load(saved_tiny, quantize="int8")
    assert int8.model is not plain.model and Member.load(saved_tiny, quantize="int8").model is int8.model
    layers = [m for m in int8.model.modules() if isinstance(m, DynamicInt8Linear)]
    assert len(layers) == 2 * 7  # q, k, v, o, gate, up, down per decoder layer
    assert type(int8.model.get_output_embeddings()) is CpuLinear  # the head decides the token: float32
    assert not any(isinstance(m, DynamicInt8Linear) for m in plain.model.modules())  # the float copy is untouched
    ids = random_ids(24, 5)
    with torch.inference_mode():
        a = plain.model(input_ids=torch.tensor([ids])).logits[0]
        b = int8.model(input_ids=torch.tensor([ids])).logits[0]
    assert not torch.equal(a, b)
    assert float((a - b).abs().max() / a.abs().max()) < 0.05  # per-channel int8: close, not equal


def test_int8_member_decodes_incrementally_and_in_an_ensemble(saved_tiny: str, tiny_gemma: Member) -> None:
    int8 = Member.load(saved_tiny, quantize="int8")
    prompt = random_ids(12, 6)
    assert greedy_decode(int8.start_from_ids(prompt), 10) == reference_greedy(int8, prompt, 10)
    result = Ensemble([int8, tiny_gemma], method="safe", max_new_tokens=8).generate("Hello")
    assert result.stats["drafted"] >= 8  # random weights: the draft may be specials only, the passes are real
    assert all(m["forward_passes"] > 0 for m in result.stats["members"])
