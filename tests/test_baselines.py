"""Baselines in the same harness: the single model, every-token UniTE / GaC, generate-then-select."""

from __future__ import annotations

import pytest

from ensemble_core import Ensemble, InvalidOptionError, Member
from ensemble_core.methods.every_token import EveryTokenConfig, EveryTokenEnsemble
from ensemble_core.methods.generate_then_select import GenerateThenSelect
from ensemble_core.methods.single import SingleModel
from ensemble_core.testing import tiny_member

FFFD = "\ufffd"
PROMPTS = ["Say 東京 and 😀 twice.", "Write a Python function that adds two numbers.", "Wie heißt du?"]


@pytest.fixture(scope="module")
def tiny_pair() -> list[Member]:
    return [tiny_member("smollm2-135m-instruct", seed=5), tiny_member("gemma3-270m", seed=5)]


# ----------------------------------------------------------------------------- every token
def test_every_token_config_and_registry(tiny_llama: Member, tiny_gemma: Member) -> None:
    with pytest.raises(InvalidOptionError):
        EveryTokenConfig(distribution="max")
    with pytest.raises(InvalidOptionError):
        EveryTokenConfig(margin=-2)
    assert isinstance(Ensemble([tiny_llama, tiny_gemma], method="every-token").method, EveryTokenEnsemble)


@pytest.mark.parametrize("distribution", ["unite", "gac"])
def test_every_token_baseline(tiny_llama: Member, tiny_gemma: Member, distribution: str) -> None:
    method = EveryTokenEnsemble([tiny_llama, tiny_gemma], distribution=distribution, max_new_tokens=6)
    result = method.generate(PROMPTS[0])
    assert FFFD not in result.text and result.stats["rounds"] >= 1
    tokens = result.stats["tokens"]  # every token comes out of a fusion step: E/T is 1, never above
    assert result.stats["ensembled"] == tokens and result.stats["e_t"] == (1.0 if tokens else 0.0)
    assert result.stats["members"][0]["forward_passes"] == result.stats["members"][1]["forward_passes"]
    assert "".join(method.stream(PROMPTS[0])) == result.text
    assert [r.text for r in method.batch(PROMPTS[:1])] == [result.text]



# ----------------------------------------------------------------------------- generate-then-select
def test_generate_then_select_returns_one_members_full_answer(tiny_pair: list[Member]) -> None:
    method = GenerateThenSelect(tiny_pair, max_new_tokens=20)
    result = method.generate("Hello there")
    stats = result.stats
    assert result.text and stats["chosen"] in (0, 1) and len(stats["scores"]) == 2
    alone = SingleModel([tiny_pair[stats["chosen"]]], max_new_tokens=20).generate("Hello there")
    assert alone.text.startswith(result.text)
    assert result.time_to_first_chunk == pytest.approx(result.seconds, rel=0.2)  # nothing before the end
    stream = method.stream("Hello there")
    assert "".join(stream) == result.text


def test_generate_then_select_with_prompt_lookup_writes_the_same_answers(tiny_pair: list[Member]) -> None:
    plain = GenerateThenSelect(tiny_pair, max_new_tokens=24).generate("Repeat: la la la la la la la la.")
    looked = GenerateThenSelect(tiny_pair, max_new_tokens=24, prompt_lookup=5).generate("Repeat: la la la la la la la la.")
    assert (looked.text, looked.stats["chosen"], looked.stats["scores"]) == (plain.text, plain.stats["chosen"],
                                                                             plain.stats["scores"])
    passes = [[m["forward_passes"] for m in r.stats["members"]] for r in (plain, looked)]
    assert sum(passes[1]) < sum(passes[0]), passes


