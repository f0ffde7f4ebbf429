"""SpecEM: verify-in-line exactness, segment post-processing, Hedge, selection, the method end to end,
and the generate-then-select baseline."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from ensemble_core import ConfigurationError, Ensemble, InvalidOptionError, Member, NoMembersError
from ensemble_core.baselines import GenerateThenSelect, SingleModel
from ensemble_core.specem import (
    SpecEMConfig,
    SpecEMEnsemble,
    hedge_rewards,
    hedge_step,
    hedge_update,
    normalize_scores,
    postprocess_segment,
    select_candidate,
    use_threads,
)
from ensemble_core.testing import tiny_config
from ensemble_core.verify_inline import (
    UnsupportedAttentionError,
    score_candidates_inline,
    score_candidates_separately,
)

PROMPT = "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in total?"


# ----------------------------------------------------------------------------- helpers
def scratch_scores(member: Member, context: list[int], cand: list[int], end: bool, kind: str) -> torch.Tensor:
    """Scores of one candidate from a plain, cache-free forward pass over context + candidate."""
    with torch.inference_mode():  # only the rows that predict the candidate (and its end)
        rows = member.model(input_ids=torch.tensor([context + cand]), logits_to_keep=len(cand) + 1).logits[0].float()
    values = []
    if cand:
        r = torch.log_softmax(rows[: len(cand)], -1) if kind == "logprob" else rows[: len(cand)]
        values.append(r.gather(-1, torch.tensor(cand)[:, None])[:, 0])
    if end:
        eos = torch.tensor(sorted(member.eos_token_ids))
        r = rows[len(cand)]
        values.append((torch.logsumexp(torch.log_softmax(r, -1)[eos], 0) if kind == "logprob" else r[eos].max())[None])
    return torch.cat(values) if values else torch.zeros(0)


def last_row(member: Member, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return member.model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].float()


def assert_inline_exact(member: Member, context: list[int], cands: list[list[int]], ends: list[bool],
                        kinds: tuple[str, ...] = ("logprob", "logit"), scratch: bool = True) -> None:
    state = member.start_from_ids(context[:3])
    state.score(context[3:])
    before = (list(state.ids), state.cached, state.cache.get_seq_length())
    for kind in kinds:
        inline = score_candidates_inline(state, cands, kind, ends)
        alone = score_candidates_separately(state, cands, kind, ends)
        assert [len(v) for v in inline] == [len(c) + e for c, e in zip(cands, ends)]
        for a, b in zip(inline, alone):
            assert torch.allclose(a, b, atol=1e-4, rtol=0), (kind, (a - b).abs().max())
        if scratch and kind == kinds[0]:  # the kinds differ only in the final gather
            for a, c, e in zip(inline, cands, ends):
                assert torch.allclose(a, scratch_scores(member, context, c, e, kind), atol=1e-4, rtol=0), kind
    assert (list(state.ids), state.cached, state.cache.get_seq_length()) == before  # cache restored exactly
    assert torch.allclose(state.score([77])[-1], last_row(member, context + [77]), atol=1e-4)


def tiny(like: Member, seed: int, name: str | None = None, **overrides) -> Member:
    """A random-weight member with ``like``'s architecture family and (already loaded) tokenizer."""
    alias = "gemma3-270m" if "gemma" in type(like.model).__name__.lower() else "smollm2-135m-instruct"
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(alias, like.tokenizer, **overrides), dtype=torch.float32)
    return Member(model.eval().requires_grad_(False), like.tokenizer, name=name or f"tiny-{alias}-{seed}")


def random_ids(n: int, seed: int, lo: int = 200, hi: int = 5000) -> list[int]:
    return torch.randint(lo, hi, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ----------------------------------------------------------------------------- pure pieces
@pytest.mark.parametrize("text,finished,expected", [
    (" The answer is forty", False, " The answer is"),      # mid-word: back to the last space
    (" The answer is 4.", False, " The answer is 4."),       # ends at punctuation: kept
    (" so 48 / 2 = 24 \n", False, " so 48 / 2 = 24"),        # trailing whitespace left to the next round
    (" Supercalifragilistic", False, " Supercalifragilistic"),  # nothing to cut at: kept whole
    ("\n\n", False, "\n\n"),                                  # whitespace only: kept (progress)
    (" The answer is forty", True, " The answer is forty"),  # finished (EOS / stop): kept whole
    (" caf\ufffd", False, " caf"),                            # lone U+FFFD dropped (then: word kept whole)
    ("", False, ""),
])
def test_postprocess_segment(text: str, finished: bool, expected: str) -> None:
    assert postprocess_segment(text, finished) == expected


def test_normalisation_keeps_rankings_even_with_negative_logits() -> None:
    raw = [-2.0, -1.0, -4.0]  # mean raw logits can be negative: candidate 1 is best
    published = [s / sum(raw) for s in raw]  # the published divide-by-sum flips the order
    assert max(range(3), key=lambda i: published[i]) != 1
    for how in ("softmax", "minmax", "none"):
        norm = normalize_scores(raw, how)
        assert max(range(3), key=lambda i: norm[i]) == 1
    soft = normalize_scores(raw, "softmax")
    assert math.isclose(sum(soft), 1.0) and all(s > 0 for s in soft)
    assert normalize_scores([-1.0, -math.inf], "softmax") == [1.0, 0.0]  # an abstention gets nothing
    assert normalize_scores([3.0, 3.0], "minmax") == [1.0, 1.0]


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


def test_selection_is_weighted_vote() -> None:
    s = [[0.9, 0.1], [0.2, 0.8]]
    assert select_candidate([0.5, 0.5], s)[0] == 0  # 0.55 vs 0.45
    assert select_candidate([0.3, 0.7], s)[0] == 1  # weights decide
    assert select_candidate([0.5, 0.5], [[0.5, 0.5], [0.5, 0.5]])[0] == 0  # ties: first candidate
    assert select_candidate([0.5, 0.5], [[1.0, -math.inf], [1.0, 0.0]])[0] == 0


# ----------------------------------------------------------------------------- verify in line (tiny)
@pytest.mark.parametrize("context_len", [6, 30])
def test_inline_exact_on_tiny_sliding_window(context_len: int, tiny_gemma: Member) -> None:
    """Window 8: contexts and candidates longer than the window still score exactly."""
    member = tiny(tiny_gemma, seed=1, layers=3, sliding_window=8,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    cands = [random_ids(n, seed=n) for n in (1, 3, 7, 12, 0)]
    assert_inline_exact(member, random_ids(context_len, 0), cands, [False, True, False, True, True])


def test_inline_exact_on_tiny_llama(tiny_llama: Member) -> None:
    assert_inline_exact(tiny_llama, random_ids(9, 3), [random_ids(n, 10 + n) for n in (5, 2, 9)], [False, False, True])


def test_inline_after_rollbacks_keeps_decode_state_exact(tiny_gemma: Member) -> None:
    """Branches must not trim sliding layers behind DecodeState's back (it may still crop later)."""
    member = tiny(tiny_gemma, seed=2, layers=2, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])
    state = member.start_from_ids(random_ids(20, 1))
    state.score()
    cands = [random_ids(4, 5), random_ids(6, 6)]
    for i in range(4):
        state.score(random_ids(3, 20 + i))  # 3 fed since the last crop
        score_candidates_inline(state, cands)
        state.crop(len(state.ids) - 2)  # still exact (no re-prefill) because the branch restored everything
        assert torch.allclose(state.score()[-1], last_row(member, state.ids), atol=1e-4)
    assert state.stats.reprefills == 0


def test_flash_attention_verifier_is_refused(tiny_llama: Member, tiny_gemma: Member) -> None:
    fa = tiny(tiny_llama, seed=3, name="fa2")
    fa.model.config._attn_implementation = "flash_attention_2"
    other = tiny_gemma
    with pytest.raises(UnsupportedAttentionError, match="sdpa"):
        SpecEMEnsemble([fa, other])
    with pytest.raises(UnsupportedAttentionError):
        Ensemble([fa, other], method="generate-then-select")
    SpecEMEnsemble([fa, other], verifiers=[1])  # as a drafter only it is fine


# ----------------------------------------------------------------------------- config errors
@pytest.mark.parametrize("options", [
    {"segment_length": 0}, {"segment_length": True}, {"scoring": "prob"}, {"normalization": "sum"},
    {"eta": -1.0}, {"eta": float("inf")}, {"eta_decay": "sqrt"}, {"reward": "best"}, {"hedge": "yes"},
    {"drafters": []}, {"drafters": [0, 0]}, {"verifiers": [-1]}, {"parallel": "auto"}, {"max_new_tokens": 0},
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
def tiny_pair(tiny_llama: Member, tiny_gemma: Member) -> list[Member]:
    return [tiny(tiny_llama, seed=5), tiny(tiny_gemma, seed=5)]


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


def test_automatic_threads(tiny_llama: Member, tiny_gemma: Member, monkeypatch: pytest.MonkeyPatch) -> None:
    """None: threads for distinct CPU members on a multi-core machine, never for shared objects."""
    auto, on, off = SpecEMConfig(), SpecEMConfig(parallel=True), SpecEMConfig(parallel=False)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert use_threads([tiny_llama, tiny_gemma], auto) and not use_threads([tiny_llama, tiny_gemma], off)
    same_tokenizer = Member(tiny_llama.model, tiny_llama.tokenizer, name="again")  # one fast tokenizer, two threads
    assert not use_threads([tiny_llama, same_tokenizer], auto) and use_threads([tiny_llama, same_tokenizer], on)
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert not use_threads([tiny_llama, tiny_gemma], auto)


def test_tracks_stay_in_sync_with_a_verifier_only_member(tiny_pair: list[Member]) -> None:
    judge = tiny(tiny_pair[1], seed=6, name="judge")
    method = SpecEMEnsemble([*tiny_pair, judge], drafters=[0, 1], max_new_tokens=30, segment_length=5)
    request = method.begin("Count to ten.", method.config)
    for _ in range(4):
        chunk = method.step(request)
        for track in request.tracks:
            assert track.state.response_ids == list(track.view.ids)
            if request.text:
                assert track.view.text == track.lead + request.text
        if chunk.done:
            break
    judge_track = request.tracks[2]
    assert torch.allclose(judge_track.state.score()[-1], last_row(judge, judge_track.state.ids), atol=1e-4)
    assert len(request.weights) == 3 and request.wins[2] == 0  # the judge never drafts
    result = method.generate("Count to ten.")
    assert result.text and result.stats["verifiers"][-1] == "judge" and result.stats["drafters"] == [m.name for m in tiny_pair]


def test_hedge_off_keeps_weights_uniform(tiny_pair: list[Member]) -> None:
    third = tiny(tiny_pair[0], seed=7)
    result = SpecEMEnsemble([*tiny_pair, third], hedge=False, max_new_tokens=24, segment_length=4).generate("Hi")
    assert result.stats["rounds"] >= 2
    assert all(w == pytest.approx([1 / 3] * 3) for w in result.stats["weight_trajectory"])


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


# ----------------------------------------------------------------------------- real models
@pytest.mark.real
@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_inline_exact_on_real_models(which: str, request: pytest.FixtureRequest) -> None:
    member: Member = request.getfixturevalue(which)
    context = member.encode_prompt(member.render(PROMPT)) + member.tokenizer(" She sold", add_special_tokens=False)["input_ids"]
    texts = [" 72", " 48 + 24 = 72 clips.", " half of 48, which is 24, so in total she sold", ""]
    cands = [member.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert_inline_exact(member, context, cands, [False, True, False, True])


@pytest.mark.real
def test_inline_exact_on_gemma_past_its_sliding_window(gemma3: Member) -> None:
    words = " ".join(f"item{i}" for i in range(160))
    context = gemma3.encode_prompt(gemma3.render(f"Repeat: {words}"))
    assert len(context) > 512 + 10
    cands = [gemma3.tokenizer(t, add_special_tokens=False)["input_ids"] for t in (" item300", " The list ends here.")]
    assert_inline_exact(gemma3, context, cands, [False, True], kinds=("logprob",))


@pytest.mark.real
def test_useless_member_loses_hedge_weight(smollm2: Member) -> None:
    copy = Member(smollm2.model, smollm2.tokenizer, name="smollm2-copy")
    useless = tiny(smollm2, seed=0, name="random-weights")  # same tokenizer, random weights
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
    assert a.text == b.text and a.stats == {**b.stats, "seconds": a.stats["seconds"], "per_member": a.stats["per_member"]}
    assert a.text and "\ufffd" not in a.text and a.finish_reason in ("length", "eos")
    assert set(a.stats["chosen"]) == {0}  # identical candidates are scored once and tie: the first wins
    assert a.stats["final_weights"] == [0.5, 0.5]
    alone = SingleModel([smollm2], max_new_tokens=24).generate(PROMPT)
    assert alone.text.startswith(a.text.rsplit(" ", 1)[0])  # same greedy text, segment by segment


@pytest.mark.real
def test_real_pair_streams_what_it_generates(real_pair: list[Member]) -> None:
    method = SpecEMEnsemble(real_pair, max_new_tokens=24, reward="win-rate")
    result = method.generate(PROMPT)
    stream = method.stream(PROMPT)
    assert "".join(stream) == result.text == stream.result.text
    assert result.text and result.completion_tokens <= 24 and "\nUser:" not in result.text
    assert sum(result.stats["wins"]) == result.stats["rounds"] >= 2
    assert result.stats["boundary_fallbacks"] == 0
