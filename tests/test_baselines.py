"""Baselines in the same harness: the single model, every-token UniTE / GaC, generate-then-select."""

from __future__ import annotations

import pytest

from ensemble_core import Ensemble, InvalidOptionError, Member
from ensemble_core.bench.host_reads import HostReads
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


ZH = "北京是哪个国家的首都？请用中文回答。"


@pytest.mark.parametrize(("seed", "budget"), [(0, 12), (1, 6)])
def test_every_token_cuts_the_last_fused_string_to_the_budget(seed: int, budget: int) -> None:
    """``max_new_tokens`` counts the first member's tokens: a fused string that spans more of them than are left
    (tiny seed 0: a 4-byte CJK character with 2 tokens left; seed 1: ``oom`` after ``subdul``) is cut at a
    character boundary and ends the answer with ``length`` (it was appended whole: 14 tokens for 12, 7 for 6)."""
    members = [tiny_member("smollm2-135m-instruct", seed=seed, initializer_range=0.2),
               tiny_member("qwen2.5-coder-0.5b-instruct", seed=seed, initializer_range=0.2)]
    method = Ensemble(members, method="every-token")
    result = method.generate(ZH, max_new_tokens=budget)
    assert result.finish_reason == "length" and FFFD not in result.text
    assert 0 < result.stats["tokens"] <= budget, (result.stats["tokens"], result.text)
    longer = method.generate(ZH, max_new_tokens=budget + 8)  # greedy: the same strings, the cut one whole
    assert longer.text.startswith(result.text) and len(longer.text) > len(result.text)
    assert "".join(method.stream(ZH, max_new_tokens=budget)) == result.text


@pytest.mark.real
def test_every_token_keeps_a_real_cjk_answer_within_the_budget(smollm2: Member, qwen: Member) -> None:
    """SmolLM2 first, Qwen's ``中华人民`` is one token but 7 SmolLM2 byte tokens: it wrote 12 tokens for 6."""
    result = Ensemble([smollm2, qwen], method="every-token").generate(ZH, max_new_tokens=6)
    assert (result.text, result.finish_reason, result.stats["tokens"]) == ("北京是中", "length", 6)
    assert smollm2.count_tokens(result.text) == 6



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


def test_generate_then_select_counts_the_tokens_it_returns() -> None:
    """``stats["tokens"]`` is the returned text's length in the primary member's tokens, as for the other methods:
    not the chosen answer's before the budget cut (Qwen's answer, 17 SmolLM2 tokens for a budget of 6)."""
    members = [tiny_member("smollm2-135m-instruct", seed=5, initializer_range=0.2),
               tiny_member("qwen2.5-coder-0.5b-instruct", seed=5, initializer_range=0.2)]
    result = GenerateThenSelect(members, max_new_tokens=6).generate(ZH)
    assert result.stats["chosen"] == 1 and result.finish_reason == "length"
    assert result.stats["tokens"] == members[0].count_tokens(result.text) == 6, (result.stats, result.text)




# ----------------------------------------------------------------------------- single: steps per read
def test_single_reads_bursts_of_steps_with_the_same_tokens(tiny_pair: list[Member]) -> None:
    """``steps_per_read`` (#38): greedy steps queued unread and read once per burst (1, 2, 4, ... 16 steps) write
    what reading every token writes, streamed and batched too, with ~6 reads for 40 tokens instead of 40."""
    member = tiny_pair[0]
    each = Ensemble([member], method="single", max_new_tokens=40, batching=False).generate(PROMPTS[0])
    method = Ensemble([member], method="single", max_new_tokens=40, batching=False, steps_per_read=16)
    with HostReads() as reads:
        burst = method.generate(PROMPTS[0])
    assert (burst.text, burst.finish_reason, burst.stats["tokens"]) == (each.text, each.finish_reason, 40)
    assert each.stats["rounds"] == 40 and burst.stats["rounds"] == 6  # 1 + 2 + 4 + 8 + 16 + 9
    assert reads.per_token(40) <= 0.25, reads.counts  # one read per burst (a cut character may add one)
    assert "".join(method.stream(PROMPTS[0])) == each.text
    batched = Ensemble([member], method="single", max_new_tokens=40, steps_per_read=16).batch(PROMPTS[:2])
    assert batched[0].text == each.text


def test_steps_per_read_samples_in_bursts_and_leaves_grammars_one_token_per_read(tiny_pair: list[Member]) -> None:
    member = tiny_pair[0]
    sampled, reads = [], []
    for n in (1, 16):
        with HostReads() as counted:
            sampled.append(Ensemble([member], method="single", max_new_tokens=12, do_sample=True, seed=3, batching=False,
                                    steps_per_read=n).generate(PROMPTS[1]))
        reads.append(counted.total)
    assert sampled[0].text == sampled[1].text and sampled[0].stats["rounds"] == 12  # the same draws, in bursts
    assert sampled[1].stats["rounds"] < 6 and reads[1] < reads[0] // 2, (sampled[1].stats["rounds"], reads)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    shaped = Ensemble([member], method="single", max_new_tokens=24, batching=False, steps_per_read=16,
                         response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with HostReads() as reads:
        result = shaped.generate(PROMPTS[1])
    chosen = result.stats["tokens"] + (result.finish_reason == "eos")
    assert reads.total >= chosen, reads.counts  # under a grammar each token is read as it is chosen: no bursts
    assert result.stats["rounds"] <= chosen  # a round may take the tokens the grammar forces with its pass (#38)
    for bad in (0, 65, True, 2.0):
        with pytest.raises(InvalidOptionError, match="steps_per_read"):
            Ensemble([member], method="single", steps_per_read=bad)


@pytest.mark.real
def test_a_burst_ends_at_the_end_of_text_as_reading_each_token_does(smollm2: Member) -> None:
    """The steps queued behind an end of text are dropped: the same reply, the same finish, the state cropped
    to the reply (a real model that ends its answer inside a burst)."""
    prompt = "What is 2+2? Answer in one short sentence."
    each = Ensemble([smollm2], method="single", max_new_tokens=64, batching=False).generate(prompt)
    method = Ensemble([smollm2], method="single", max_new_tokens=64, batching=False, steps_per_read=16)
    burst = method.generate(prompt)
    assert each.finish_reason == "eos" and each.stats["tokens"] < 31  # ends inside the 16-step burst
    assert (burst.text, burst.finish_reason, burst.stats["tokens"]) == (each.text, "eos", each.stats["tokens"])
    assert burst.stats["rounds"] < each.stats["rounds"] / 2
