"""Reliability weights (``ensemble_core.methods.reliability``): a weak member must not drag the answers.

* Pure pieces: body sizes read off the bundled models' configs, the prior (size, a quarter
  without a chat template, a quarter more on a request with tools for a template without
  them), which weights win (``fusion_weights`` > ``reliability_weights`` > the prior >
  ``"none"``), the option checks, Hedge with a zero weight, calibration's rule,
  the wins a decision gives.
* Every method on tiny members (real tokenizers, random weights): the weights reach the
  fusion / Hedge / the judges, and the stats report each member's weight and wins;
  ``reliability="none"`` is the published uniform vote.
* The benchmark's check of an ensemble against its best member, on synthetic records.
* Two real tests: on the bundled trio the stats give Gemma-3 (no chat template) the smallest weight,
  and on a request with tools (offered, or calls and results in the history) SmolLM2 and Gemma-3
  (no tool template) a quarter less again.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from test_safe import checked, scripted

from ensemble_core import Member
from ensemble_core.bench import Row, summarize_rows
from ensemble_core.bench.records import accuracy_difference, vs_best_member
from ensemble_core.bench.report import _weak_member_lines
from ensemble_core.decoding.stats import MemberStats
from ensemble_core.errors import InvalidOptionError
from ensemble_core.methods.every_token import EveryTokenEnsemble
from ensemble_core.methods.generate_then_select import GenerateThenSelect
from ensemble_core.methods.reliability import (
    Votes,
    Weights,
    body_parameters,
    calibrate,
    calibrated_weights,
    fallback_formats,
    has_chat_template,
    member_weights,
    prior_weights,
    uses_tools,
)
from ensemble_core.methods.safe import SafeConfig, SafeEnsemble
from ensemble_core.methods.single import SingleModel
from ensemble_core.methods.specem import SpecEMEnsemble, hedge_update
from ensemble_core.testing import bundled_tokenizer, tiny_config
from ensemble_core.text.chat import template_supports_tools

#: The bundled models' shapes (their GGUF configs): hidden, layers, intermediate, heads, kv heads, head dim.
SHAPES = {"smollm2-135m-instruct": (576, 30, 1536, 9, 3, 64), "gemma3-270m": (640, 18, 2048, 4, 1, 256),
          "qwen2.5-coder-0.5b-instruct": (896, 24, 4864, 14, 2, 64)}
NAMES = list(SHAPES)


def stub(alias: str, template: bool | None = None) -> SimpleNamespace:
    """What the prior reads off a member: its config (the bundled model's full-size shape), its tokenizer and
    whether its (real) template renders tools, as :attr:`Member.native_tools` reads it."""
    d, layers, ffn, heads, kv, head_dim = SHAPES[alias]
    tokenizer = bundled_tokenizer(alias)
    config = tiny_config(alias, tokenizer, hidden=d, layers=layers, intermediate_size=ffn, num_attention_heads=heads,
                         num_key_value_heads=kv, head_dim=head_dim)
    has = bool(tokenizer.chat_template) if template is None else template
    text = (tokenizer.chat_template or "{{ x }}") if has else None
    return SimpleNamespace(name=alias, model=SimpleNamespace(config=config), chat_template=None,
                           tokenizer=SimpleNamespace(chat_template=text), native_tools=template_supports_tools(text))


@pytest.fixture(scope="module")
def trio_stubs() -> list[SimpleNamespace]:
    return [stub(n) for n in NAMES]


@pytest.fixture(scope="module")
def tiny_pair(tiny_llama: Member, tiny_gemma: Member) -> list[Member]:
    return [tiny_llama, tiny_gemma]


# ============================================================================ the prior
def test_body_sizes_of_the_bundled_models(trio_stubs: list[SimpleNamespace]) -> None:
    # the layers only: Gemma-3's 262k-row embedding (170 M of its 268 M) does not count
    assert [body_parameters(m) for m in trio_stubs] == [106_168_320, 100_270_080, 357_826_560]


def test_body_size_without_a_config_counts_parameters_outside_the_embeddings() -> None:
    model = torch.nn.Module()
    model.embed, model.body, model.head = torch.nn.Embedding(100, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 100)
    model.config = SimpleNamespace()
    model.get_input_embeddings = lambda: model.embed
    model.get_output_embeddings = lambda: model.head
    assert body_parameters(SimpleNamespace(model=model)) == 8 * 8 + 8 + 100  # the body and the head's bias


def test_prior_weighs_by_size_and_a_quarter_without_a_chat_template(trio_stubs: list[SimpleNamespace]) -> None:
    assert [has_chat_template(m) for m in trio_stubs] == [True, False, True]  # Gemma-3 is a base model
    weights = prior_weights(trio_stubs)
    raw = [106_168_320, 100_270_080 / 4, 357_826_560]
    assert weights == pytest.approx([r / sum(raw) for r in raw])
    assert weights == pytest.approx([0.217, 0.051, 0.732], abs=1e-3)
    assert weights[2] > weights[0] + weights[1]  # the strong member outweighs the two small ones together
    assert prior_weights(trio_stubs, template_penalty=1.0)[1] == pytest.approx(100_270_080 / 564_264_960)
    # the Qwen pair
    assert prior_weights([trio_stubs[0], trio_stubs[2]]) == pytest.approx([0.229, 0.771], abs=1e-3)


TOOL = {"type": "function", "function": {"name": "multiply", "description": "Multiply two numbers.",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}


def test_prior_weighs_a_member_down_once_per_format_it_reads_through_a_fallback(trio_stubs: list[SimpleNamespace]) -> None:
    # Qwen's template renders tools; SmolLM2's renders chats but not tools; Gemma-3 has no template at all
    assert [fallback_formats(m) for m in trio_stubs] == [0, 1, 0]
    assert [fallback_formats(m, tools=True) for m in trio_stubs] == [1, 2, 0]
    raw = [106_168_320 / 4, 100_270_080 / 16, 357_826_560]
    assert prior_weights(trio_stubs, tools=True) == pytest.approx([r / sum(raw) for r in raw])
    # the Qwen pair on a request with tools: SmolLM2 reads them as system-prompt instructions (docs/agents.md)
    assert prior_weights([trio_stubs[0], trio_stubs[2]], tools=True) == pytest.approx([0.069, 0.931], abs=1e-3)
    # SmolLM2 + Gemma-3 keep their order: each fallback costs both alike
    smol, gemma = prior_weights(trio_stubs[:2], tools=True)
    assert smol / gemma == pytest.approx(prior_weights(trio_stubs[:2])[0] / prior_weights(trio_stubs[:2])[1])


#: An agent's conversation after one call and its result.
AFTER_A_CALL = [{"role": "user", "content": "What is 6 times 7?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"id": "c1", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}]


@pytest.mark.parametrize("choice, penalized", [("auto", True), ("required", True), ("multiply", True), ("none", False)])
def test_a_request_offering_tools_takes_the_tool_fallback_into_the_prior(
        trio_stubs: list[SimpleNamespace], choice: str, penalized: bool) -> None:
    pair = [trio_stubs[0], trio_stubs[2]]
    config = SafeConfig(tools=[TOOL], tool_choice=choice)
    assert uses_tools(config) is penalized
    assert member_weights(pair, config).values == pytest.approx(prior_weights(pair, tools=penalized))
    assert member_weights(pair, config, "What is 6 times 7?").values == pytest.approx(prior_weights(pair, tools=penalized))
    # a conversation with tool calls and results involves tools whatever the tool choice (an agent's answer turn)
    assert uses_tools(config, AFTER_A_CALL)
    assert member_weights(pair, config, AFTER_A_CALL).values == pytest.approx(prior_weights(pair, tools=True))
    assert not uses_tools(SafeConfig()) and not uses_tools(SimpleNamespace())
    assert not uses_tools(SafeConfig(), AFTER_A_CALL[:1]) and not uses_tools(SafeConfig(), "6 * 7?")
    # explicit and calibrated weights are the user's: no format penalty on them
    assert member_weights(pair, SafeConfig(tools=[TOOL], fusion_weights=[1, 1])).values == (0.5, 0.5)


def test_which_weights_win(trio_stubs: list[SimpleNamespace]) -> None:
    prior = member_weights(trio_stubs, SafeConfig())
    assert prior.source == "prior" and prior.values == pytest.approx(prior_weights(trio_stubs))
    none = member_weights(trio_stubs, SafeConfig(reliability="none"))
    assert none.source == "none" and none.uniform and none.tensor() is None  # the published arithmetic
    calibrated = member_weights(trio_stubs, SafeConfig(reliability_weights={"gemma3-270m": 0}))
    assert calibrated.source == "reliability_weights" and calibrated.values == (0.5, 0.0, 0.5)
    explicit = member_weights(trio_stubs, SafeConfig(fusion_weights=[1, 1, 2], reliability_weights=[0, 1, 1]))
    assert explicit.source == "fusion_weights" and explicit.values == (0.25, 0.25, 0.5)
    # configs without the options (a method of one's own) are uniform
    assert member_weights(trio_stubs, SimpleNamespace()).source == "none"
    with pytest.raises(InvalidOptionError, match="reliability_weights"):
        member_weights(trio_stubs, SafeConfig(reliability_weights={"nobody": 1}))
    with pytest.raises(InvalidOptionError, match="reliability_weights"):
        member_weights(trio_stubs, SafeConfig(reliability_weights=[1, 1]))


@pytest.mark.parametrize("option, value", [
    ("reliability", "online"), ("reliability", ""), ("template_penalty", 0), ("template_penalty", 1.5),
    ("template_penalty", "0.25"), ("reliability_weights", [-1, 1]), ("reliability_weights", "qwen"),
    ("reliability_weights", [0, 0]), ("reliability_weights", {"a": float("inf")}),
])
def test_reliability_options_are_checked(option: str, value: object) -> None:
    with pytest.raises(InvalidOptionError, match=option):
        SafeConfig(**{option: value})


@pytest.mark.parametrize("method", [SafeEnsemble, EveryTokenEnsemble, SpecEMEnsemble, GenerateThenSelect])
def test_weights_naming_no_member_fail_at_construction(tiny_pair: list[Member], method: type) -> None:
    """Not at the first request (the names are known when the method is built)."""
    with pytest.raises(InvalidOptionError, match="reliability_weights.*unknown: qwen"):
        method(tiny_pair, reliability_weights={"qwen": 2})
    with pytest.raises(InvalidOptionError, match="reliability_weights.*one per member"):
        method(tiny_pair, reliability_weights=[1, 2, 3])
    if method in (SafeEnsemble, EveryTokenEnsemble):  # the fusing methods take fusion_weights too
        with pytest.raises(InvalidOptionError, match="fusion_weights.*unknown: qwen"):
            method(tiny_pair, fusion_weights={"qwen": 2})
    assert method(tiny_pair, reliability_weights={tiny_pair[0].name: 2}).members == tiny_pair


def test_weights_of_a_subset_and_uniform_starts() -> None:
    w = Weights((0.2, 0.0, 0.8), "prior")
    assert w.of([0, 2]) == pytest.approx([0.2, 0.8]) and w.of([1]) == [1.0]
    assert Weights((0.5, 0.5), "prior").tensor() is None
    assert Weights((1 / 3,) * 3, "none").of([0, 1, 2]) == [1 / 3] * 3  # exactly the published start


def test_hedge_keeps_a_zero_weight_at_zero() -> None:
    assert hedge_update([0.5, 0.0, 0.5], [1.0, 1.0, 0.0], 1.0) == pytest.approx([0.731, 0.0, 0.269], abs=1e-3)


def test_votes_count_a_members_first_choice() -> None:
    votes = Votes.start(Weights((0.25, 0.75), "prior"))
    votes.count(torch.tensor([[0.6, 0.4], [0.3, 0.7]]), chosen=1)
    votes.count(torch.tensor([[0.6, 0.4], [0.8, 0.2]]), chosen=0)
    votes.win(1)
    members = votes.annotate([MemberStats("a", "member"), MemberStats("b", "member")])
    assert (votes.wins, votes.decisions) == ([1, 3], 3)
    assert [(m.weight, m.wins) for m in members] == [(0.25, 1), (0.75, 3)]


def test_calibration_takes_the_vote_from_a_member_far_below_the_best() -> None:
    assert calibrated_weights({"a": 0.8, "b": 0.5, "c": 0.3}) == {"a": 0.8, "b": 0.5, "c": 0.0}
    assert calibrated_weights({"a": 0.2, "b": 0.2}) == {"a": 0.2, "b": 0.2}


def test_calibrate_on_tiny_members(tiny_pair: list[Member]) -> None:
    questions = ["Say hi.", "Count to three.", "Name a colour."]
    # "right" means what the first member answers alone: it scores 3/3, the other (almost surely) 0/3
    answers = [SingleModel([tiny_pair[0]], max_new_tokens=6).generate(q).text for q in questions]
    weights = calibrate(tiny_pair, questions, answers, correct=lambda out, ans: out == ans, max_new_tokens=6)
    assert weights == {tiny_pair[0].name: 0.8, tiny_pair[1].name: 0.0}
    with pytest.raises(InvalidOptionError):
        calibrate(tiny_pair, questions, answers[:2], correct=lambda out, ans: True)


# ============================================================================ every method
def test_safe_the_prior_lets_the_chat_member_win_where_uniform_votes_let_the_base_model(tiny_llama: Member,
                                                                                         tiny_gemma: Member) -> None:
    drafter = scripted(tiny_llama, "That is Incorrect.", confidence=0.6)  # has a chat template
    verifier = scripted(tiny_gemma, " That is wrong.", confidence=0.9)  # a base model: a quarter of the vote
    uniform = checked(SafeEnsemble([drafter, verifier], max_new_tokens=20, reliability="none")).generate("Is 2 + 2 = 5?")
    assert uniform.text == "That is wrong."  # the published vote (tests/test_safe.py)
    result = checked(SafeEnsemble([drafter, verifier], max_new_tokens=20)).generate("Is 2 + 2 = 5?")
    # after "That is": weighted average of " Inc" 0.8 * 0.6 + 0.2 * ~0 = 0.48 < 0.5, a point; fused " Inc" 0.48
    # against " wrong" 0.2 * 0.9 = 0.18: the drafter keeps its word
    assert result.text == "That is Incorrect."
    s = result.stats
    assert s["reliability"] == "prior" and s["ensembled"] >= 1
    assert [m["weight"] for m in s["members"]] == pytest.approx([0.8, 0.2])
    assert s["members"][0]["wins"] == s["ensembled"] and s["members"][1]["wins"] == 0
    assert [m["weight"] for m in uniform.stats["members"]] == [0.5, 0.5] and uniform.stats["reliability"] == "none"
    # fusion_weights given explicitly win over the prior
    given = SafeEnsemble([drafter, verifier], max_new_tokens=20, fusion_weights=[1, 1]).generate("Is 2 + 2 = 5?")
    assert given.text == "That is wrong." and given.stats["reliability"] == "fusion_weights"


def test_safe_drafts_with_the_most_reliable_member_by_default(tiny_llama: Member, tiny_gemma: Member) -> None:
    chat_last = [tiny_gemma, tiny_llama]  # the base model first: the prior makes the chat member (index 1) draft
    result = SafeEnsemble(chat_last, max_new_tokens=6).generate("Hi")
    assert result.stats["drafter"] == tiny_llama.name and SafeEnsemble(chat_last).primary is tiny_llama
    assert [m["role"] for m in result.stats["members"]] == ["verifier", "drafter"]
    assert SafeEnsemble(chat_last, max_new_tokens=6, reliability="none").generate("Hi").stats["drafter"] == tiny_gemma.name
    assert SafeEnsemble(chat_last, max_new_tokens=6, drafter=0).generate("Hi").stats["drafter"] == tiny_gemma.name
    assert SafeEnsemble(chat_last, fusion_weights=[3, 1]).primary is tiny_gemma  # the largest weight given


def test_every_token_reports_weights_and_wins(tiny_pair: list[Member]) -> None:
    result = EveryTokenEnsemble(tiny_pair, max_new_tokens=8).generate("Hello")
    members = result.stats["members"]
    assert result.stats["reliability"] == "prior" and [m["weight"] for m in members] == pytest.approx([0.8, 0.2])
    assert all(0 <= m["wins"] <= result.stats["rounds"] for m in members)
    uniform = EveryTokenEnsemble(tiny_pair, max_new_tokens=8, reliability="none").generate("Hello")
    assert [m["weight"] for m in uniform.stats["members"]] == [0.5, 0.5]


def test_specem_hedge_starts_from_the_prior(tiny_pair: list[Member]) -> None:
    still = SpecEMEnsemble(tiny_pair, hedge=False, max_new_tokens=16, segment_length=4).generate("Hi")
    assert all(w == pytest.approx([0.8, 0.2]) for w in still.stats["weight_trajectory"])
    result = SpecEMEnsemble(tiny_pair, max_new_tokens=16, segment_length=4).generate("Hi")
    s = result.stats
    assert s["reliability"] == "prior"
    assert [m["weight"] for m in s["members"]] == pytest.approx(s["final_weights"], abs=1e-6)
    assert [m["wins"] for m in s["members"]] == s["wins"] and sum(s["wins"]) == s["rounds"]
    uniform = SpecEMEnsemble(tiny_pair, hedge=False, max_new_tokens=16, segment_length=4,
                             reliability="none").generate("Hi")
    assert uniform.stats["weight_trajectory"][0] == [0.5, 0.5]


def test_generate_then_select_weighs_the_judges(tiny_pair: list[Member], tiny_qwen: Member) -> None:
    members = [*tiny_pair, tiny_qwen]
    result = GenerateThenSelect(members, max_new_tokens=8).generate("Hello there")
    s = result.stats
    assert s["reliability"] == "prior" and [m["weight"] for m in s["members"]][1] < 0.2
    assert [m["wins"] for m in s["members"]] == [int(i == s["chosen"]) for i in range(3)]
    # a judge with no weight does not count: with only the first member's vote its scores decide
    own = GenerateThenSelect(members, max_new_tokens=8, reliability_weights=[1, 0, 0]).generate("Hello there")
    totals = own.stats["scores"][0]
    assert own.stats["chosen"] == max(range(3), key=lambda c: (totals[c], -c))


# ============================================================================ the benchmark's check
def _rec(method: str, q: int, correct: bool) -> dict:
    return {"method": method, "kind": "x", "question_id": f"q{q}", "latency_s": 1.0, "tokens": 10, "chars": 50,
            "correct": correct, "ttft_s": 0.1, "time_to_L_s": None, "et": None, "corrupted": False,
            "finish_reason": "eos", "stats": {}}


def test_accuracy_difference_interval() -> None:
    assert accuracy_difference([(True, True)]) is None
    diff, lo, hi = accuracy_difference([(False, True)] * 10 + [(True, True)] * 10)
    assert diff == -0.5 and hi < 0
    diff, lo, hi = accuracy_difference([(True, False), (False, True)] * 10)
    assert diff == 0 and lo < 0 < hi
    assert accuracy_difference([(True, True)] * 8) == (0.0, 0.0, 0.0)


def test_the_summary_flags_an_ensemble_below_its_best_member_and_names_the_weak_member() -> None:
    trio, pair = ("weak", "base", "strong"), ("weak", "strong")
    rows = [Row("single[weak]", "single", runner=object(), member="weak"),
            Row("single[base]", "single", runner=object(), member="base"),
            Row("single[strong]", "single", runner=object(), member="strong"),
            Row("specem", "specem", runner=object(), members=trio),
            Row("specem[members=weak+strong]", "specem", runner=object(), members=pair),
            Row("safe[drafter=weak]", "safe", runner=object(), drafter="weak", members=trio)]
    records = []
    for q in range(20):
        records += [_rec("single[weak]", q, q < 2), _rec("single[base]", q, q == 0), _rec("single[strong]", q, q < 12),
                    _rec("specem", q, q < 3), _rec("specem[members=weak+strong]", q, 1 <= q < 13),
                    _rec("safe[drafter=weak]", q, q < 11)]
    summary = summarize_rows(rows, records)
    trio_check = summary["specem"]["vs_best_member"]
    assert trio_check["member"] == "strong" and trio_check["difference"] == pytest.approx(-0.45)
    assert trio_check["status"] == "below" and trio_check["interval"][1] < 0
    assert trio_check["lowered_by"] == ["base"] and trio_check["weaker"] == ["weak", "base"]
    pair_check = summary["specem[members=weak+strong]"]["vs_best_member"]
    assert pair_check["status"] == "tie" and pair_check["difference"] == 0 and pair_check["lowered_by"] == []
    safe = summary["safe[drafter=weak]"]["vs_best_member"]
    assert safe["status"] == "tie" and safe["lowered_by"] == []  # no SAFE subset row with the same drafter
    assert "vs_best_member" not in summary["single[strong]"]
    assert vs_best_member(summary, records)["specem"] == trio_check  # reproducible: fixed seed
    text = "\n".join(_weak_member_lines(summary))
    assert "| specem | strong (60.0%) | 15.0% | -45 (" in text and "**below** | base |" in text
    assert "clearly (the whole interval under 0): specem" in text


# ============================================================================ real trio
@pytest.mark.real
def test_the_trio_gives_gemma3_the_smallest_weight(smollm2: Member, gemma3: Member, qwen: Member) -> None:
    from ensemble_core import Ensemble

    trio = [smollm2, gemma3, qwen]
    for method in ("safe", "every-token"):
        result = Ensemble(trio, method=method, max_new_tokens=6).generate("What is 6 - 2? Answer briefly.")
        weights = [m["weight"] for m in result.stats["members"]]
        assert result.stats["reliability"] == "prior" and sum(weights) == pytest.approx(1.0, abs=1e-5)
        assert min(weights) == weights[1] and max(weights) == weights[2], weights
        assert weights == pytest.approx([0.217, 0.051, 0.732], abs=2e-3)


@pytest.mark.real
def test_on_a_request_with_tools_the_members_without_tool_templates_weigh_less(
        smollm2: Member, gemma3: Member, qwen: Member) -> None:
    """The real templates decide: Qwen's renders tools, SmolLM2's and the fallback transcript do not."""
    from ensemble_core import Ensemble

    assert [m.native_tools for m in (smollm2, gemma3, qwen)] == [False, False, True]
    trio = Ensemble([smollm2, gemma3, qwen], method="safe", max_new_tokens=4)
    with_tools = trio.generate("What is 6 times 7?", tools=[TOOL])
    weights = [m["weight"] for m in with_tools.stats["members"]]
    assert weights == pytest.approx([0.068, 0.016, 0.916], abs=2e-3)
    without = trio.generate("What is 6 times 7?", tools=[TOOL], tool_choice="none")
    assert [m["weight"] for m in without.stats["members"]] == pytest.approx([0.217, 0.051, 0.732], abs=2e-3)
    # the answer turn after a tool's result, no tools offered: the members still read the call and the result
    answer = trio.generate([*AFTER_A_CALL, {"role": "user", "content": "Answer in one sentence."}])
    assert [m["weight"] for m in answer.stats["members"]] == pytest.approx([0.068, 0.016, 0.916], abs=2e-3)
