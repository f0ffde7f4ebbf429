"""SpecEM: Hedge, config errors, the method end to end on tiny and real members."""

from __future__ import annotations

import math

import pytest
import torch

from ensemble_core import ConfigurationError, Ensemble, InvalidOptionError, Member, NoMembersError
from ensemble_core.methods.single import SingleModel
from ensemble_core.methods.specem import SpecEMConfig, SpecEMEnsemble, hedge_rewards, hedge_step, hedge_update
from ensemble_core.testing import reference_last_row, tiny_member

PROMPT = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?"


# ----------------------------------------------------------------------------- Hedge
def test_hedge_reward_formula() -> None:
    # verifier rows, candidate columns; member 2's candidate is rated worst by both others
    s = [[0.5, 0.4, 0.1],
         [0.3, 0.6, 0.1],
         [0.2, 0.2, 0.6]]
    members = [0, 1, 2]
    rewards = hedge_rewards(s, members, members)
    # member 0: judges 1,2 x rivals 1,2: s1: 0.3>=0.6 no, 0.3>=0.1 yes; s2: 0.2>=0.2 yes, 0.2>=0.6 no -> 2/4
    # member 1: s0: 0.4>=0.5 no, 0.4>=0.1 yes; s2: 0.2>=0.2 yes, 0.2>=0.6 no -> 2/4
    # member 2: s0: 0.1>=0.5 no, 0.1>=0.4 no; s1: no, no -> 0, floored to 1 -> 1/4
    assert rewards == [0.5, 0.5, 0.25]
    assert hedge_rewards(s, members, members, floor=False) == [0.5, 0.5, 0.0]
    # K = 2 with the published floor: every member always earns 1, so Hedge cannot move a pair
    assert hedge_rewards([[0.9, 0.1], [0.8, 0.2]], [0, 1], [0, 1]) == [1.0, 1.0]
    assert hedge_rewards([[0.9, 0.1], [0.8, 0.2]], [0, 1], [0, 1], floor=False) == [1.0, 0.0]
    # a verifier that does not draft gets the mean reward (keeps its share)
    assert hedge_rewards([[0.9, 0.1], [0.2, 0.8], [0.5, 0.5]], [0, 1, 2], [0, 1], floor=False) == [0.5, 0.5, 0.5]


def test_hedge_update_and_step() -> None:
    assert math.isclose(hedge_step(10.0, 4, 1), 0.5) and math.isclose(hedge_step(10.0, 4, 5), 0.1)
    assert math.isclose(hedge_step(10.0, 4, 5, "constant"), 0.5)
    w = hedge_update([1 / 3] * 3, [0.5, 0.5, 0.25], 1.0)
    assert math.isclose(sum(w), 1.0) and w[0] == w[1] > w[2]
    assert math.isclose(w[0] / w[2], math.exp(0.25))
    assert hedge_update([0.5, 0.5], [1.0, 1.0], 3.0) == [0.5, 0.5]


def test_the_default_reward_learns_for_a_pair() -> None:
    """K = 2: the published reward is 1 for both members whatever the scores; win-rate is not."""
    assert SpecEMConfig().reward == "win-rate"
    judged = [[0.9, 0.1], [0.8, 0.2]]  # both verifiers prefer member 0's candidate
    assert hedge_rewards(judged, [0, 1], [0, 1], floor=True) == [1.0, 1.0]
    w = hedge_update([0.5, 0.5], hedge_rewards(judged, [0, 1], [0, 1], floor=False), hedge_step(10.0, 2, 1))
    assert w[0] > 0.6 > 0.4 > w[1]


# ----------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("options", [
    {"segment_length": 0}, {"segment_length": True}, {"scoring": "prob"}, {"normalization": "sum"},
    {"eta": -1.0}, {"eta": float("inf")}, {"eta_decay": "sqrt"}, {"reward": "best"}, {"hedge": "yes"},
    {"drafters": []}, {"drafters": [0, 0]}, {"verifiers": [-1]}, {"parallel": "auto"}, {"max_new_tokens": 0},
    {"prompt_lookup": -1}, {"prompt_lookup": "4"}, {"prompt_lookup": False},
])
def test_bad_config_values(options: dict) -> None:
    with pytest.raises(InvalidOptionError):
        SpecEMConfig(**options)


def test_bad_configs_against_members(tiny_llama: Member, tiny_gemma: Member) -> None:
    pair = [tiny_llama, tiny_gemma]
    with pytest.raises(NoMembersError):
        SpecEMEnsemble([tiny_llama])
    with pytest.raises(InvalidOptionError):
        SpecEMEnsemble(pair, drafters=[0, 5])
    with pytest.raises(ConfigurationError, match="no member named"):
        SpecEMEnsemble(pair, verifiers=["nobody"])
    with pytest.raises(ConfigurationError, match="neither draft nor verify"):
        SpecEMEnsemble(pair, drafters=[0], verifiers=[0])
    with pytest.raises(ConfigurationError, match="Unknown option"):
        SpecEMEnsemble(pair, lookahead=3)
    with pytest.raises(ConfigurationError, match="Unknown option"):
        Ensemble(pair, method="generate-then-select", segment_length=5)
    method = SpecEMEnsemble(pair)
    with pytest.raises(InvalidOptionError):
        method.generate("hi", segment_length=-2)


# ----------------------------------------------------------------------------- the method on tiny members
@pytest.fixture(scope="module")
def tiny_pair() -> list[Member]:
    return [tiny_member("smollm2-135m-instruct", seed=5), tiny_member("gemma3-270m", seed=5)]


def test_stream_equals_generate_and_batch_equals_one_by_one(tiny_pair: list[Member]) -> None:
    method = SpecEMEnsemble(tiny_pair, max_new_tokens=24, segment_length=4)
    prompts = ["Hello there", [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why?"}]]
    singles = [method.generate(p) for p in prompts]
    stream = method.stream(prompts[0])
    parts = list(stream)
    assert "".join(parts) == stream.result.text == singles[0].text
    assert stream.result.stats["chosen"] == singles[0].stats["chosen"]
    assert len(parts) >= 2  # streamed segment by segment
    batch = method.batch(prompts)
    assert [r.text for r in batch] == [r.text for r in singles]
    assert [r.finish_reason for r in batch] == [r.finish_reason for r in singles]
    for r in singles:
        assert r.text and "\ufffd" not in r.text and r.completion_tokens <= 24
        assert r.time_to_first_chunk is not None and r.time_to_first_chunk <= r.seconds
        s = r.stats
        assert s["rounds"] == len(s["chosen"]) == len(s["weight_trajectory"]) == sum(s["wins"])
        assert set(s["seconds"]) == {"draft", "verify", "update"}


def test_threads_give_the_same_result(tiny_pair: list[Member]) -> None:
    """Members on several devices draft / verify in threads; the outcome must not depend on it."""
    options = dict(max_new_tokens=16, segment_length=4)
    threaded = SpecEMEnsemble(tiny_pair, parallel=True, **options).generate("Hello there")
    assert threaded.text == SpecEMEnsemble(tiny_pair, parallel=False, **options).generate("Hello there").text


def test_views_stay_in_sync_with_a_verifier_only_member(tiny_pair: list[Member]) -> None:
    judge = tiny_member("gemma3-270m", seed=6, name="judge")
    method = SpecEMEnsemble([*tiny_pair, judge], drafters=[0, 1], max_new_tokens=30, segment_length=5)
    request = method.begin("Count to ten.", method.config)
    for _ in range(4):
        chunk = method.step(request)
        for view in request.views:
            assert view.state.response_ids == list(view.tokens.ids)
            if request.text:
                assert view.tokens.text == view.lead + request.text
        if chunk.done:
            break
    judge_view = request.views[2]
    assert torch.allclose(judge_view.state.score()[-1], reference_last_row(judge, judge_view.state.ids), atol=1e-4)
    assert len(request.weights) == 3 and request.wins[2] == 0  # the judge never drafts
    result = method.generate("Count to ten.")
    assert result.text and result.stats["verifiers"][-1] == "judge" and result.stats["drafters"] == [m.name for m in tiny_pair]


def test_hedge_off_keeps_weights_uniform(tiny_pair: list[Member]) -> None:
    third = tiny_member("smollm2-135m-instruct", seed=7)
    result = SpecEMEnsemble([*tiny_pair, third], hedge=False, max_new_tokens=24, segment_length=4,
                            reliability="none").generate("Hi")
    assert result.stats["rounds"] >= 2
    assert all(w == pytest.approx([1 / 3] * 3) for w in result.stats["weight_trajectory"])
    # with the default prior Hedge off keeps the prior (the tiny Gemma has no chat template: a quarter)
    prior = SpecEMEnsemble([*tiny_pair, third], hedge=False, max_new_tokens=24, segment_length=4).generate("Hi")
    assert all(w == pytest.approx([4 / 9, 1 / 9, 4 / 9]) for w in prior.stats["weight_trajectory"])


def test_single_drafter_output_with_stop_string_and_budget(tiny_pair: list[Member]) -> None:
    method = SpecEMEnsemble(tiny_pair, drafters=[1], max_new_tokens=40, segment_length=6)
    full = method.generate("Tell me a story.")
    assert full.finish_reason == "length" and full.completion_tokens <= 40
    words = full.text.split()
    assert len(words) >= 3
    stop = words[len(words) // 2]
    cut = method.generate("Tell me a story.", stop=[stop])
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]


def test_sampling_is_reproducible_under_a_seed(tiny_pair: list[Member]) -> None:
    method = SpecEMEnsemble(tiny_pair, max_new_tokens=16, segment_length=4, do_sample=True, temperature=0.8)
    a, b = method.generate("Hi", seed=11), method.generate("Hi", seed=11)
    assert a.text == b.text and a.stats["chosen"] == b.stats["chosen"]


def test_prompt_lookup_drafts_the_same_segments_in_fewer_passes(tiny_pair: list[Member]) -> None:
    """Guessed tokens only save drafting passes (both members: a full cache and Gemma-3's sliding
    layers, cut back inside the branch): greedy and seeded sampling pick the same segments."""
    prompt = "Repeat: la la la la la la la la la la la la."
    runs = {}
    for lookup in (0, 6):
        method = SpecEMEnsemble(tiny_pair, max_new_tokens=32, segment_length=8, prompt_lookup=lookup)
        greedy = method.generate(prompt)
        sampled = method.generate(prompt, do_sample=True, temperature=0.7, seed=4)
        runs[lookup] = (greedy.text, greedy.stats["chosen"], sampled.text,
                        [m["forward_passes"] for m in greedy.stats["members"]])
    assert runs[6][:3] == runs[0][:3]
    assert all(a < b for a, b in zip(runs[6][3], runs[0][3])), (runs[6][3], runs[0][3])


# ----------------------------------------------------------------------------- real models
@pytest.mark.real
def test_useless_member_loses_hedge_weight(smollm2: Member) -> None:
    copy = Member(smollm2.model, smollm2.tokenizer, name="smollm2-copy")
    useless = tiny_member("smollm2-135m-instruct", seed=0, name="random-weights")  # same tokenizer, random weights
    result = SpecEMEnsemble([smollm2, copy, useless], max_new_tokens=30).generate(PROMPT)
    stats = result.stats
    weights = [w[2] for w in stats["weight_trajectory"]]
    assert stats["rounds"] >= 3
    assert weights[-1] < 1 / 3 - 0.05 and all(b < a for a, b in zip(weights, weights[1:]))
    assert stats["final_weights"][0] > stats["final_weights"][2]
    assert stats["wins"][2] <= stats["rounds"] // 3
    assert "48" in result.text or "24" in result.text or "72" in result.text


@pytest.mark.real
def test_copy_member_is_deterministic_and_well_formed(smollm2: Member) -> None:
    copy = Member(smollm2.model, smollm2.tokenizer, name="smollm2-copy")
    method = SpecEMEnsemble([smollm2, copy], max_new_tokens=24)
    a, b = method.generate(PROMPT), method.generate(PROMPT)
    assert a.text == b.text and a.stats == {**b.stats, "seconds": a.stats["seconds"], "members": a.stats["members"]}
    assert a.text and "\ufffd" not in a.text and a.finish_reason in ("length", "eos")
    assert set(a.stats["chosen"]) == {0}  # identical candidates are scored once and tie: the first wins
    assert a.stats["final_weights"] == [0.5, 0.5]
    alone = SingleModel([smollm2], max_new_tokens=24).generate(PROMPT)
    assert alone.text.startswith(a.text.rsplit(" ", 1)[0])  # same greedy text, segment by segment


@pytest.mark.real
def test_prompt_lookup_keeps_the_real_pairs_segments(real_pair: list[Member]) -> None:
    """On the real pair guessing tokens changes the drafters' passes, not the text."""
    prompt = "Repeat this sentence twice: the quick brown fox jumps over the lazy dog."
    plain = SpecEMEnsemble(real_pair, max_new_tokens=40).generate(prompt)
    looked = SpecEMEnsemble(real_pair, max_new_tokens=40, prompt_lookup=6).generate(prompt)
    assert looked.text == plain.text and looked.stats["chosen"] == plain.stats["chosen"]
    passes = [[m["forward_passes"] for m in r.stats["members"]] for r in (plain, looked)]
    assert all(b < 0.8 * a for a, b in zip(*passes)), passes


@pytest.mark.real
def test_real_pair_streams_what_it_generates(real_pair: list[Member]) -> None:
    method = SpecEMEnsemble(real_pair, max_new_tokens=24, reward="win-rate")
    result = method.generate(PROMPT)
    stream = method.stream(PROMPT)
    assert "".join(stream) == result.text == stream.result.text
    assert result.text and result.completion_tokens <= 24 and "\nUser:" not in result.text
    assert sum(result.stats["wins"]) == result.stats["rounds"] >= 2
    assert result.stats["boundary_fallbacks"] == 0


def test_a_stop_string_across_two_segments_is_cut_before_it() -> None:
    """A stop that begins at the end of one committed segment and ends in the next draft (CJK text has no
    spaces to end segments at, so a stop like 'さは' straddles often): the answer ends before the stop. The
    draft was cut to "" and the stop's first part ('…Mah' for 'hM' here, '…高さ' with the real pair) stayed."""
    members = [tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2),
               tiny_member("gemma3-270m", seed=0, initializer_range=0.2)]
    ens = Ensemble(members, method="specem", segment_length=4, max_new_tokens=24)
    chunks = list(ens.stream("Hi"))
    full = "".join(chunks)
    ends = {chunks[i][-1] + chunks[i + 1][0] for i in range(len(chunks) - 1) if chunks[i] and chunks[i + 1]}
    assert "hM" in ends  # segments '...Mah' and 'Mah...': the stop straddles them
    for stop in ("hM", "y "):
        result = ens.generate("Hi", stop=[stop])
        assert (result.text, result.finish_reason) == (full[: full.find(stop)], "stop"), stop
