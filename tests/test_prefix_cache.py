"""Prefix caching (:mod:`ensemble_core.decoding.prefix_cache`): a request that starts like a recent prompt
prefills only its new tail, and decodes as a fresh prefill would.

Tiny random-weight members with the real tokenizers check the bookkeeping and the logits against a
cache-free forward; the bundled SmolLM2 and Gemma-3 check a real conversation's next turn and a restore
past Gemma-3's 512-token sliding window. Passes and tokens are counted, never timed.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from ensemble_core import Ensemble, Member, MemberSpec
from ensemble_core.bench import BenchOptions
from ensemble_core.bench.throughput import ThroughputOptions
from ensemble_core.cli import build_parser
from ensemble_core.constraints.structured import StructuredRequest
from ensemble_core.decoding.prefix_cache import MIN_REUSE, PrefixCache, common_prefix
from ensemble_core.decoding.static import StaticCache
from ensemble_core.errors import InvalidOptionError
from ensemble_core.flags import TIMED_PREFIX_CACHE, add_load_flags, member_options
from ensemble_core.testing import greedy_decode, random_ids, reference_greedy, reference_last_row, tiny_member


@pytest.fixture(scope="module")
def llama() -> Member:
    return tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)


@pytest.fixture(scope="module")
def gemma() -> Member:
    """Gemma-3-shaped with a sliding window of 8 (five sliding layers, then a full one), so that short prompts
    already pass the window."""
    return tiny_member("gemma3-270m", seed=0, initializer_range=0.2, sliding_window=8, layers=6)


TOOL = {"name": "multiply", "description": "Multiply two numbers.",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                       "required": ["a", "b"]}}


def uncached(member: Member) -> Member:
    """The same weights with prefix caching off (the reference for outputs)."""
    return Member(member.model, member.tokenizer, name=member.name + "-uncached", prefix_cache=0)


def test_a_prompt_that_extends_a_stored_one_prefills_only_its_tail(llama: Member) -> None:
    llama.prefix_cache.clear()
    first = random_ids(40, 1)
    state = llama.start_from_ids(first)
    state.score()
    assert state.stats.prefix_reused == 0 and state.stats.tokens_fed == 40
    assert len(llama.prefix_cache) == 1 and llama.prefix_cache.tokens == 40

    longer = first + random_ids(12, 2)
    state = llama.start_from_ids(longer)
    rows = state.score([7, 8])
    assert state.stats.prefix_reused == 40 and state.stats.tokens_fed == 12 + 2
    assert torch.allclose(rows[0], reference_last_row(llama, longer), atol=1e-5)
    assert torch.allclose(rows[-1], reference_last_row(llama, [*longer, 7, 8]), atol=1e-5)
    # the longer prompt replaced the one it extends: one entry, the longer one's tokens
    assert len(llama.prefix_cache) == 1 and llama.prefix_cache.tokens == 52

    # the same prompt again: all but its last id come from the cache (a pass needs one id to give a row)
    again = llama.start_from_ids(longer)
    assert greedy_decode(again, 8) == reference_greedy(llama, longer, 8)
    assert again.stats.prefix_reused == 51 and llama.prefix_cache.hits >= 2


def test_sliding_layers_restore_exactly_past_their_window(gemma: Member) -> None:
    gemma.prefix_cache.clear()
    prompt = random_ids(30, 3)
    gemma.start_from_ids(prompt).score()  # 30 states per layer: past the window of 8
    longer = prompt + random_ids(6, 4)
    state = gemma.start_from_ids(longer)
    assert greedy_decode(state, 10) == reference_greedy(gemma, longer, 10)
    assert state.stats.prefix_reused == 30


def test_a_rebuild_after_an_inexact_crop_restores_the_stored_prompt(gemma: Member) -> None:
    """A crop that sliding layers cannot undo rebuilds the cache: from the stored prompt, not from scratch."""
    gemma.prefix_cache.clear()
    prompt = random_ids(30, 5)
    state = gemma.start_from_ids(prompt)
    state.score(random_ids(4, 6))
    state.crop(len(state.ids))  # trims the sliding layers to their window
    state.score(random_ids(2, 7))
    state.crop(len(prompt) - 5)  # 10 back: more than was fed since the trim
    assert state.stats.reprefills == 1 and state.cached == len(prompt) - 6
    row = state.score()[-1]
    assert torch.allclose(row, reference_last_row(gemma, prompt[:-5]), atol=1e-5)


def test_the_budget_keeps_the_most_recently_used_prompts() -> None:
    store = PrefixCache(capacity=100)
    member = tiny_member("smollm2-135m-instruct", seed=1)
    states = {}
    for seed in (10, 11, 12):
        ids = random_ids(40, seed)
        states[seed] = ids
        state = Member(member.model, member.tokenizer, prefix_cache=0).start_from_ids(ids)
        state.score()
        assert store.store(ids, state.cache)
        if seed == 11:
            assert store.longest(states[10], 40)[0] == 40  # touches 10: 11 is now the least recently used
    assert store.tokens == 80 and len(store) == 2  # 3 x 40 > 100: one evicted
    assert store.longest(states[11], 40)[1] is None and store.longest(states[10], 40)[0] == 40
    assert store.store(states[12][:20], state.cache)  # a prefix of a stored prompt: held already, not copied
    assert store.tokens == 80
    assert not store.store(random_ids(MIN_REUSE - 1, 13), state.cache)  # too short to be worth a copy
    assert not store.store(random_ids(101, 14), state.cache)  # longer than the whole budget
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2 and common_prefix([], [1]) == 0


@pytest.mark.parametrize("name", ["llama", "gemma"])
def test_static_slots_load_a_stored_prompt_and_store_their_own(name: str, request: pytest.FixtureRequest) -> None:
    """A static member's request copies a stored prompt into its slot and prefills only the tail; the states it
    stores from its slot (every state, Gemma's sliding layers too: the window is in the masks) are the ones an
    eager prefill computes."""
    base = request.getfixturevalue(name)
    static = Member(base.model, base.tokenizer, passes="static", max_cache_len=128)
    assert static.prefix_cache is not None
    prompt = random_ids(30, 20)
    first = static.start_from_ids(prompt)
    first.score()
    assert isinstance(first.cache, StaticCache) and first.stats.prefix_reused == 0
    assert len(static.prefix_cache) == 1 and static.prefix_cache.tokens == 30
    longer = prompt + random_ids(6, 21)
    state = static.start_from_ids(longer)
    assert isinstance(state.cache, StaticCache) and state.stats.prefix_reused == 30
    assert greedy_decode(state, 10) == reference_greedy(base, longer, 10)
    assert state.stats.tokens_fed == 6 + 10 and state.stats.static_passes == state.stats.forward_passes
    eager = uncached(base).start_from_ids(prompt)
    eager.score()
    _, entry = static.prefix_cache.longest(prompt, 30)
    assert entry is not None and len(entry.keys) == len(eager.cache.layers)
    for stored, layer in zip(entry.keys, eager.cache.layers):
        assert torch.allclose(stored[:, :, :30], layer.keys[:, :, :30], atol=1e-5)


def test_prompts_stored_before_the_model_is_cast_are_forgotten() -> None:
    """``model.to(dtype)`` after a request: the next request prefills in full in the new dtype (its stored states
    would meet the cast weights in a pass), and the cache fills again from there."""
    member = tiny_member("smollm2-135m-instruct", seed=4)
    prompt = random_ids(30, 30)
    member.start_from_ids(prompt).score()
    assert len(member.prefix_cache) == 1
    member.model.to(torch.float64)
    state = member.start_from_ids(prompt)
    assert greedy_decode(state, 6) == reference_greedy(member, prompt, 6)
    assert state.stats.prefix_reused == 0 and state.cache.layers[0].keys.dtype == torch.float64
    again = member.start_from_ids(prompt)
    assert again.stats.prefix_reused == 29 and again.cache.layers[0].keys.dtype == torch.float64


def test_off_and_bad_budgets() -> None:
    member = tiny_member("smollm2-135m-instruct", seed=2)
    assert uncached(member).prefix_cache is None
    for bad in (-1, 1.5, True, "4096"):
        with pytest.raises(InvalidOptionError, match="prefix_cache"):
            MemberSpec("smollm2-135m-instruct", prefix_cache=bad)
        with pytest.raises(InvalidOptionError, match="prefix_cache"):
            Member(member.model, member.tokenizer, prefix_cache=bad)


def test_the_prefix_cache_flag_reaches_every_members_load_options() -> None:
    parser = argparse.ArgumentParser()
    add_load_flags(parser)
    assert [o.get("prefix_cache") for o in member_options(parser.parse_args(["--prefix-cache", "0"]), 2)] == [0, 0]
    assert all("prefix_cache" not in o for o in member_options(parser.parse_args([]), 2))  # the spec's default
    with pytest.raises(InvalidOptionError, match="prefix_cache"):
        member_options(parser.parse_args(["--prefix-cache", "-1"]), 1)
    # the commands that time rows of shared members against each other run without it unless asked
    cli = build_parser()
    for argv in (["demo"], ["bench"], ["generate", "--prompt", "x"]):
        got = member_options(cli.parse_args(argv), 1)[0].get("prefix_cache")
        assert got == (None if argv[0] == "generate" else TIMED_PREFIX_CACHE), argv
    assert TIMED_PREFIX_CACHE == 0
    assert member_options(cli.parse_args(["bench", "--prefix-cache", "512"]), 1)[0]["prefix_cache"] == 512
    assert BenchOptions().prefix_cache == ThroughputOptions().prefix_cache == 0


@pytest.mark.parametrize("method", ["single", "safe", "specem"])
def test_a_conversations_next_turn_reuses_it_and_decodes_the_same(method: str, llama: Member, gemma: Member) -> None:
    """Concurrent requests (batched passes) and an agent-like next turn: the same texts as without the cache."""
    members = [llama] if method == "single" else [llama, gemma]
    options = {"max_new_tokens": 10, **({} if method == "single" else {"published": True})}
    system = {"role": "system", "content": "You answer questions about the sea, briefly and exactly. " * 3}
    prompts = [[system, {"role": "user", "content": q}] for q in ("Why is it salty?", "How deep is it?", "Is it blue?")]
    for m in members:
        m.prefix_cache.clear()
    cached = Ensemble(members, method=method, **options)
    plain = Ensemble([uncached(m) for m in members], method=method, **options)
    first = cached.batch(prompts)
    assert [r.text for r in first] == [r.text for r in plain.batch(prompts)]
    turn = [*prompts[0], {"role": "assistant", "content": first[0].text}, {"role": "user", "content": "And then?"}]
    again = cached.generate(turn)
    assert again.text == plain.generate(turn).text
    reused = [s.prefix_reused for s in again.stats.members]
    assert all(n >= MIN_REUSE for n in reused), reused


@pytest.mark.parametrize("alias", ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma3-270m"])
def test_an_agents_call_after_a_tool_result_starts_with_its_previous_prompt(alias: str) -> None:
    """With the real tokenizers and chat formats: the answer instructions after a tool result come after the
    conversation, so the second call's prompt starts with the whole first one (a prefix cache skips it). They
    used to join the first system message: Qwen's second prompt then shared 3 tokens with its first."""
    member = tiny_member(alias)
    request = StructuredRequest(tools=(TOOL,), choice="auto")
    first = [{"role": "user", "content": "What is 6 times 7?"}]
    call = {"id": "c1", "type": "function", "function": {"name": "multiply", "arguments": '{"a": 6, "b": 7}'}}
    second = [*first, {"role": "assistant", "content": "", "tool_calls": [call]},
              {"role": "tool", "tool_call_id": "c1", "content": "42"}]
    a, b = (member.prompt_ids(member.messages(m, request), request) for m in (first, second))
    assert len(b) > len(a) and common_prefix(a, b) == len(a)


# ----------------------------------------------------------------------------- real members
@pytest.mark.real
def test_real_chat_turns_reuse_the_conversation(smollm2: Member) -> None:
    plain = uncached(smollm2)
    cached = Member(smollm2.model, smollm2.tokenizer, name="smollm2-cached")
    turn = [{"role": "user", "content": "Name a planet."}]
    for _ in range(2):
        ours = Ensemble([cached], method="single", max_new_tokens=12).generate(turn)
        assert ours.text == Ensemble([plain], method="single", max_new_tokens=12).generate(turn).text
        turn = [*turn, {"role": "assistant", "content": ours.text}, {"role": "user", "content": "Another one?"}]
    reused = ours.stats.members[0].prefix_reused
    assert reused >= 20 and reused < ours.prompt_tokens, (reused, ours.prompt_tokens)


@pytest.mark.real
def test_real_gemma_restores_past_its_sliding_window(gemma3: Member) -> None:
    """Gemma-3-270m's sliding layers (window 512) restored from a 600-token prompt: the greedy tokens of a
    fresh prefill (``model.generate``)."""
    cached = Member(gemma3.model, gemma3.tokenizer, name="gemma3-cached")
    words = gemma3.encode_prompt("The river runs past the mill and the old stone bridge. " * 50)
    assert len(words) > 560
    prompt = words[:560]
    cached.start_from_ids(prompt).score()
    longer = prompt + gemma3.encode_prompt(" What runs past the mill?")[1:]
    state = cached.start_from_ids(longer)
    assert greedy_decode(state, 6) == reference_greedy(gemma3, longer, 6)
    assert state.stats.prefix_reused == 560
