"""Ensemble distributions (UniTE, GaC) and sharpening, on the bundled models' real tokenizers.

Probability vectors are hand-made, so every expected value is known; the tokenizers are
the real ones (through the tiny members), so text keys, byte tokens and special tokens
behave as in production.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ensemble_core.bench.host_reads import HostReads
from ensemble_core.decoding.members import Member
from ensemble_core.errors import InvalidOptionError
from ensemble_core.text.distributions import (
    END,
    BackingTable,
    GaC,
    UniTE,
    backing_table,
    fusion_weights,
    gather_backed,
    geometric_mean,
    is_complete,
    make_distribution,
    member_table,
    prefix_merge,
    sharpen,
    token_bytes,
    union_vocabulary,
)
from ensemble_core.text.distributions import Candidates as C


def one_id(member: Member, text: str) -> int:
    ids = member.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == 1, (text, ids)
    return ids[0]


def dist(member: Member, masses: dict[int, float]) -> torch.Tensor:
    """A probability vector with the given masses and the rest spread evenly."""
    p = torch.full((member.vocab_size,), (1.0 - sum(masses.values())) / (member.vocab_size - len(masses)))
    for i, m in masses.items():
        p[i] = m
    return p


def prob_of(c: C, member: int, key: bytes | object) -> float:
    return float(c.member_probs[member, c.keys.index(key)])


# ============================================================================ token texts
def test_token_bytes_of_both_tokenizer_families(tiny_llama: Member, tiny_gemma: Member) -> None:
    smol = tiny_llama.tokenizer("Inc 東 😀", add_special_tokens=False)["input_ids"]
    assert b"".join(token_bytes(tiny_llama.tokenizer, smol)) == "Inc 東 😀".encode()
    pieces = token_bytes(tiny_llama.tokenizer, smol)
    assert not all(is_complete(p) for p in pieces)  # byte-level BPE splits the CJK character and the emoji
    gemma = tiny_gemma.tokenizer(" Incorrect\n\n", add_special_tokens=False)["input_ids"]
    assert token_bytes(tiny_gemma.tokenizer, gemma) == [b" Incorrect", b"\n\n"]
    byte_e6 = tiny_gemma.tokenizer.convert_tokens_to_ids("<0xE6>")
    assert token_bytes(tiny_gemma.tokenizer, [byte_e6]) == [b"\xe6"]
    # special tokens have no text
    assert token_bytes(tiny_llama.tokenizer, [1, 2]) == [None, None]


def test_union_vocabulary_merges_equal_texts_and_bytes(tiny_llama: Member, tiny_gemma: Member) -> None:
    union = union_vocabulary([member_table(tiny_llama), member_table(tiny_gemma)])
    smol_space = tiny_llama.tokenizer.convert_tokens_to_ids("Ġ")
    gemma_space = tiny_gemma.tokenizer.convert_tokens_to_ids("▁")
    assert int(union.maps[0][smol_space]) == int(union.maps[1][gemma_space])
    smol_e6 = tiny_llama.tokenizer.convert_tokens_to_ids("æ")  # the byte 0xE6 in GPT-2's byte alphabet
    gemma_e6 = tiny_gemma.tokenizer.convert_tokens_to_ids("<0xE6>")
    index = int(union.maps[0][smol_e6])
    assert index == int(union.maps[1][gemma_e6]) and union.keys[index] == b"\xe6"
    assert not bool(union.selectable[index])  # half a character is never a candidate
    assert int(union.maps[0][2]) == union.end and int(union.maps[1][1]) == union.end  # both EOS tokens
    assert union_vocabulary([member_table(tiny_llama), member_table(tiny_gemma)]) is union  # built once


# ============================================================================ fusion
@pytest.mark.parametrize("rule", [UniTE, GaC])
def test_identical_tokenizers_reduce_to_plain_averaging(tiny_llama: Member, rule: type) -> None:
    gen = torch.Generator().manual_seed(0)
    p1 = torch.softmax(torch.randn(tiny_llama.vocab_size, generator=gen) * 4, 0)
    p2 = torch.softmax(torch.randn(tiny_llama.vocab_size, generator=gen) * 4, 0)
    c = rule([tiny_llama, tiny_llama], top_k=10).fuse([p1, p2])
    table = member_table(tiny_llama)
    average = (p1 + p2) / 2
    for i, key in enumerate(c.keys):
        ids = list(table.eos_ids) if key is END else list(table.ids_of[key])
        assert float(c.fused[i]) == pytest.approx(float(average[ids].sum()), rel=1e-5)
    best = int(torch.argmax(average.masked_fill(~table.selectable, -1)))
    assert c.keys[int(torch.argmax(c.fused))] == table.keys[best]


def test_unite_counts_a_missing_string_by_its_first_token(tiny_llama: Member, tiny_gemma: Member) -> None:
    smol = dist(tiny_llama, {one_id(tiny_llama, " Inc"): 0.6, one_id(tiny_llama, " wrong"): 0.3})
    gemma = dist(tiny_gemma, {one_id(tiny_gemma, " Incorrect"): 0.7, one_id(tiny_gemma, " wrong"): 0.2})
    c = UniTE([tiny_llama, tiny_gemma], top_k=2).fuse([smol, gemma])
    assert set(c.keys) == {b" Inc", b" wrong", b" Incorrect"}
    assert prob_of(c, 0, b" Incorrect") == pytest.approx(0.6)  # SmolLM2 has no " Incorrect": its " Inc"
    assert prob_of(c, 1, b" wrong") == pytest.approx(0.2)
    assert prob_of(c, 1, b" Inc") < 1e-5  # Gemma's own " Inc" token, unlikely
    assert c.keys[int(torch.argmax(c.fused))] == b" Incorrect"
    assert float(c.fused[c.keys.index(b" Incorrect")]) == pytest.approx(0.65)
    assert c.drafter_top.tolist() == [k in (b" Inc", b" wrong") for k in c.keys]


def test_unite_once_counts_a_token_for_one_candidate_only(tiny_qwen: Member, tiny_llama: Member) -> None:
    """The agent-suite case (every-token, rewriting ``count_letters("encyclopedia")``): Qwen is sure of its
    token ``ency``, SmolLM2 writes ``encycl``, which Qwen has no token for (Qwen: ``ency`` + ``cl``). The
    published rule gives Qwen's 0.999 to ``encycl`` too, SmolLM2 breaks the tie and the longer string is
    appended (Qwen then wrote ``encyclod``); ``once`` keeps Qwen's mass on its own token."""
    qwen = dist(tiny_qwen, {one_id(tiny_qwen, "ency"): 0.999})
    smol = dist(tiny_llama, {one_id(tiny_llama, "encycl"): 0.13, one_id(tiny_llama, "ency"): 0.01})
    shared = UniTE([tiny_qwen, tiny_llama], top_k=2).fuse([qwen, smol])
    assert prob_of(shared, 0, b"encycl") == pytest.approx(0.999)  # Qwen's first sub-token, counted again
    assert shared.keys[int(torch.argmax(shared.fused))] == b"encycl" and not shared.exclusive
    once = make_distribution("unite", [tiny_qwen, tiny_llama], top_k=2, sub_tokens="once").fuse([qwen, smol])
    assert prob_of(once, 0, b"ency") == pytest.approx(0.999) and prob_of(once, 0, b"encycl") == 0.0
    assert prob_of(once, 1, b"encycl") == pytest.approx(0.13)  # SmolLM2's own tokens are untouched
    assert once.keys[int(torch.argmax(once.fused))] == b"ency" and once.exclusive
    # a string whose first sub-token is not itself a candidate still gets that token's mass
    gemma_like = dist(tiny_llama, {one_id(tiny_llama, " wrong"): 0.9})
    qwen_incorrect = dist(tiny_qwen, {one_id(tiny_qwen, " Incorrect"): 0.8})
    c = UniTE([tiny_llama, tiny_qwen], top_k=1, sub_tokens="once").fuse([gemma_like, qwen_incorrect])
    assert c.keys == (b" wrong", b" Incorrect")
    smol_inc = float(gemma_like[one_id(tiny_llama, " Inc")])  # SmolLM2: " Inc" + "orrect"
    assert prob_of(c, 0, b" Incorrect") == pytest.approx(smol_inc)


def test_one_candidate_per_token_prefers_the_exact_token_then_the_shortest_string() -> None:
    from ensemble_core.text.distributions import one_candidate_per_token

    # (candidate, first token): candidates 0 and 2 share token 7, candidate 1 starts with token 5, held exactly
    firsts = [(0, 7), (1, 5), (2, 7), (3, 9)]
    assert one_candidate_per_token(firsts, taken={5}, lengths=[6, 4, 5, 3]) == [(2, 7), (3, 9)]
    assert one_candidate_per_token(firsts, taken=set(), lengths=[5, 4, 5, 3]) == [(0, 7), (1, 5), (3, 9)]  # tie: earliest
    assert one_candidate_per_token([], taken={1}, lengths=[]) == []


def test_sub_tokens_option_defaults_and_checks() -> None:
    from ensemble_core.methods.every_token import EveryTokenConfig
    from ensemble_core.methods.safe import SafeConfig
    from ensemble_core.options import sub_token_rule

    assert sub_token_rule(SafeConfig()) == "once" and sub_token_rule(EveryTokenConfig()) == "once"
    assert sub_token_rule(SafeConfig(published=True)) == "shared"
    assert sub_token_rule(EveryTokenConfig(published=True, sub_tokens="once")) == "once"  # given wins
    with pytest.raises(InvalidOptionError, match="sub_tokens"):
        SafeConfig(sub_tokens="first")
    with pytest.raises(InvalidOptionError, match="sub_tokens"):
        make_distribution("unite", [], sub_tokens="both")


@pytest.mark.parametrize("method", ["safe", "every-token"])
def test_stats_report_the_sub_token_rule_a_request_ran_with(method: str, tiny_llama: Member, tiny_qwen: Member) -> None:
    from ensemble_core import Ensemble

    ensemble = Ensemble([tiny_llama, tiny_qwen], method=method, max_new_tokens=4)
    assert ensemble.generate("Hi").stats["sub_tokens"] == "once"
    assert ensemble.generate("Hi", published=True).stats["sub_tokens"] == "shared"
    assert ensemble.generate("Hi", distribution="gac").stats["sub_tokens"] == ""  # GaC has no such choice


@pytest.mark.parametrize("rule", [UniTE, GaC])
def test_fusion_weights_let_a_strong_member_outvote_two_weak_ones(tiny_llama: Member, tiny_gemma: Member,
                                                                 rule: type) -> None:
    # two weak members agree on " wrong"; the third (stronger) member is sure of " right"
    weak = dist(tiny_llama, {one_id(tiny_llama, " wrong"): 0.7, one_id(tiny_llama, " right"): 0.1})
    strong = dist(tiny_gemma, {one_id(tiny_gemma, " right"): 0.8, one_id(tiny_gemma, " wrong"): 0.1})
    fusion = rule([tiny_llama, tiny_llama, tiny_gemma], top_k=3)
    uniform = fusion.fuse([weak, weak, strong])
    assert uniform.keys[int(torch.argmax(uniform.fused))] == b" wrong"  # (0.7 + 0.7 + 0.1) / 3 > (0.1 + 0.1 + 0.8) / 3
    weights = fusion_weights({"strong": 2.0}, ["weak-a", "weak-b", "strong"])
    assert weights.tolist() == pytest.approx([0.25, 0.25, 0.5])
    weighted = fusion.fuse([weak, weak, strong], weights=weights)
    assert weighted.keys[int(torch.argmax(weighted.fused))] == b" right"
    i = weighted.keys.index(b" right")
    assert float(weighted.fused[i]) == pytest.approx(0.25 * 0.1 * 2 + 0.5 * 0.8, abs=1e-4)
    assert weighted.weights is weights and weighted.subset([True] * len(weighted)).weights is weights
    assert float(weighted.fused.sum()) <= 1.0 + 1e-5  # still probabilities
    # the geometric mean is weighted the same way: p_weak^0.5 * p_strong^0.5 here
    assert float(geometric_mean(weighted.member_probs, weights)[i]) == pytest.approx((0.1 * 0.8) ** 0.5, rel=1e-4)
    with pytest.raises(InvalidOptionError, match="one weight per member"):
        fusion.fuse([weak, weak, strong], weights=torch.tensor([0.5, 0.5]))


def test_fusion_weights_are_checked_and_normalised() -> None:
    names = ["smollm2", "gemma3"]
    assert fusion_weights(None, names) is None
    assert fusion_weights([1, 3], names).tolist() == pytest.approx([0.25, 0.75])
    assert fusion_weights({"gemma3": 0}, names).tolist() == [1.0, 0.0]  # left-out members weigh 1
    for bad, says in [([1, 2, 3], "2 weights, one per member in order: smollm2, gemma3"),
                      ({"qwen": 2}, "unknown: qwen"), ([-1, 1], ">= 0"), ([0, 0], "at least one weight > 0"),
                      ({"smollm2": 0, "gemma3": 0}, "at least one weight > 0"), ([float("nan"), 1], ">= 0"),
                      ("1,2", "a list"), ([True, 1], ">= 0")]:
        with pytest.raises(InvalidOptionError, match="fusion_weights") as info:
            fusion_weights(bad, names)
        assert says in str(info.value), (bad, str(info.value))


def _step_probs(members: list[Member], tables: list, step: int, generator: torch.Generator) -> list[torch.Tensor]:
    """Peaked random vectors: odd steps lift strings every member may share (so the exact-text backing
    is used), every seventh the end of the text, the rest stay random (so first sub-tokens are)."""
    shared = random.Random(step).sample(sorted(k for k in tables[0].ids_of if k.isascii()), 8)
    out = []
    for member, table in zip(members, tables):
        x = torch.randn(member.vocab_size, generator=generator) * 3
        if step % 2:
            for key in shared:
                for i in table.ids_of.get(key, ()):
                    x[i] += 12 + float(torch.rand(1, generator=generator))
        if step % 7 == 0:
            x[list(table.eos_ids)] += 14
        out.append(torch.softmax(x, 0))
    return out


@pytest.mark.parametrize("sub_tokens", ["shared", "once"])
def test_unite_fuses_on_the_device_as_by_text_in_one_read(sub_tokens: str, tiny_qwen: Member, tiny_llama: Member,
                                                          tiny_gemma: Member) -> None:
    """#38: the fusion gathers every member's probability of every candidate where the probabilities are
    (:class:`BackingTable`) and reads the top-k ids with them: the same candidates and probabilities as
    matching the strings on the host (two reads and a tokenizer call per step), in one read once each
    string's first sub-tokens are known."""
    members = [tiny_qwen, tiny_llama, tiny_gemma]  # three tokenizers: byte-level BPE twice, SentencePiece
    rule = UniTE(members, top_k=5, sub_tokens=sub_tokens)
    generator = torch.Generator().manual_seed(0)
    rule.fuse(_step_probs(members, rule.tables, 99, generator))  # first use: the tables are built
    for step in range(24):
        probs = _step_probs(members, rule.tables, step, generator)
        drafter = step % 3
        with HostReads() as reads:
            got = rule.fuse(probs, drafter=drafter)
        assert reads.total <= 2, reads.counts  # the fusion, and the first sub-tokens of strings new to a member
        want = rule._fuse_by_text(probs, drafter, [b""] * 3, None)
        assert got.keys == want.keys and torch.equal(got.drafter_top, want.drafter_top), step
        assert torch.allclose(got.member_probs, want.member_probs, rtol=1e-6, atol=0), step
        assert torch.equal(got.fused, got.member_probs.mean(0)) and got.exclusive == (sub_tokens == "once")
        with HostReads() as reads:
            again = rule.fuse(probs, drafter=drafter)
        assert reads.total == 1, reads.counts  # every string known now: the one read
        assert torch.equal(again.member_probs, got.member_probs)


def test_a_backing_table_says_what_a_queued_gather_holds(tiny_qwen: Member, tiny_llama: Member) -> None:
    """A first sub-token learned by another thread after this thread queued its gather was not in it:
    ``known`` answers by the fill count the gather saw, so the value is read, not taken as zero."""
    rule = UniTE([tiny_qwen, tiny_llama])
    union = rule.union
    assert backing_table(union, 1, rule.tables[1]) is backing_table(union, 1, rule.tables[1])  # built once
    qwen = backing_table(union, 0, rule.tables[0])
    backing = BackingTable(union, 1, rule.tables[1])  # a fresh one: nothing learned yet
    missing = next(k for k in rule.tables[0].ids_of if k not in rule.tables[1].ids_of and k.isascii() and len(k) > 6)
    u = union.index[missing]
    first = tiny_llama.tokenizer(missing.decode(), add_special_tokens=False)["input_ids"][0]
    q = torch.softmax(torch.randn(tiny_qwen.vocab_size), 0)
    p = torch.softmax(torch.randn(tiny_llama.vocab_size), 0)
    at = torch.tensor([u, union.index[b" the"]])
    seen = backing.fills
    before = gather_backed([qwen, backing], [q, p], at)  # queued before the first sub-token is known
    assert not backing.learned(u) and not backing.known(u, seen)
    backing.learn([(u, first)])  # as another thread would, before this one reads its gather
    assert float(before[1, 0]) == 0.0 and not backing.known(u, seen)
    assert backing.known(u, backing.fills) and backing.first(u) == first and backing.exact(union.index[b" the"])
    after = gather_backed([qwen, backing], [q, p], at)
    assert float(after[1, 0]) == float(p[first]) and float(after[1, 1]) == float(p[one_id(tiny_llama, " the")])
    assert float(after[0, 0]) == float(q[rule.tables[0].ids_of[missing]].sum())  # Qwen's own token
    assert torch.equal(after[0], before[0])


def test_one_fusion_step_launches_few_kernels_whatever_the_members(tiny_qwen: Member, tiny_llama: Member,
                                                                    tiny_gemma: Member) -> None:
    """#38: on a GPU each tensor op of a fusion step is a kernel launched from the host (~22 us each on the
    H200 box), paid at every ensembled token. With every string known, a UniTE step makes per member a
    top-k (its barred ids masked: the inverted mask is kept per device) and its strings' positions; then one
    gather over the members' vectors laid end to end and the one read. It made 30 kernel-like ops for two
    members and 42 for three (per member an inverted mask, and a six-op gather of its own, then a stack)."""
    members = [tiny_qwen, tiny_llama, tiny_gemma]
    generator = torch.Generator().manual_seed(3)
    counts = []
    for n in (2, 3):
        rule = UniTE(members[:n], top_k=5)
        probs = _step_probs(members[:n], rule.tables, 5, generator)
        rule.fuse(probs)
        want = rule._fuse_by_text(probs, 0, [b""] * n, None)
        with _KernelOps() as ops:
            got = rule.fuse(probs)
        assert got.keys == want.keys and torch.allclose(got.member_probs, want.member_probs, rtol=1e-6, atol=0)
        counts.append(ops.count)
    assert counts[0] <= 19 and counts[1] - counts[0] <= 5, counts


class _KernelOps(TorchDispatchMode):
    """Counts the tensor ops dispatched in its block that compute something (not views, not constants)."""

    METADATA = frozenset({"view", "select", "slice", "detach", "detach_", "alias", "lift_fresh", "unsqueeze",
                          "squeeze", "expand", "t", "transpose", "_reshape_alias", "_unsafe_view", "as_strided",
                          "split", "split_with_sizes", "unbind"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += func.overloadpacket.__name__ not in self.METADATA
        return func(*args, **(kwargs or {}))


def test_gac_reads_its_candidates_once(tiny_llama: Member, tiny_gemma: Member) -> None:
    smol = dist(tiny_llama, {one_id(tiny_llama, " wrong"): 0.5, one_id(tiny_llama, " Inc"): 0.4})
    gemma = dist(tiny_gemma, {one_id(tiny_gemma, " wrong"): 0.5, one_id(tiny_gemma, " Incorrect"): 0.45})
    rule = GaC([tiny_llama, tiny_gemma], top_k=3)
    rule.fuse([smol, gemma])
    with HostReads() as reads:
        c = rule.fuse([smol, gemma], drafter=1)
    assert reads.total == 1, reads.counts  # the top ids and their entries together (#38; were two reads)
    assert c.keys[0] == b" wrong" and bool(c.drafter_top[0]) and len(set(c.keys)) == len(c.keys)
    assert int(c.drafter_top.sum()) == 3  # the drafter's (Gemma's) top three come first, each once


def test_gac_averages_over_the_union_vocabulary(tiny_llama: Member, tiny_gemma: Member) -> None:
    smol = dist(tiny_llama, {one_id(tiny_llama, " wrong"): 0.5, one_id(tiny_llama, " Inc"): 0.4})
    gemma = dist(tiny_gemma, {one_id(tiny_gemma, " wrong"): 0.5, one_id(tiny_gemma, " Incorrect"): 0.45})
    c = GaC([tiny_llama, tiny_gemma], top_k=3).fuse([smol, gemma])
    assert c.keys[0] == b" wrong" and float(c.fused[0]) == pytest.approx(0.5, abs=1e-4)
    assert float(c.fused[c.keys.index(b" Incorrect")]) == pytest.approx(0.225, abs=1e-4)
    assert prob_of(c, 0, b" Incorrect") < 1e-4  # GaC has no first-token fallback: strings must match
    assert len(c) <= 3 * 2 + 3


@pytest.mark.parametrize("rule", [UniTE, GaC])
def test_end_of_text_and_special_tokens(tiny_llama: Member, tiny_gemma: Member, rule: type) -> None:
    smol = dist(tiny_llama, {2: 0.6, 1: 0.3})  # <|im_end|> (EOS) and <|im_start|> (special)
    gemma = dist(tiny_gemma, {1: 0.5})  # <eos>
    c = rule([tiny_llama, tiny_gemma], top_k=5).fuse([smol, gemma])
    assert c.keys[int(torch.argmax(c.fused))] is END
    assert float(c.fused[c.keys.index(END)]) == pytest.approx(0.55, abs=1e-4)
    assert all(k is END or (isinstance(k, bytes) and is_complete(k) and k) for k in c.keys)


@pytest.mark.parametrize("rule", [UniTE, GaC])
def test_prefixes_align_a_transcript_member_at_the_start_of_a_reply(tiny_llama: Member, tiny_gemma: Member,
                                                                    rule: type) -> None:
    smol = dist(tiny_llama, {one_id(tiny_llama, "Paris"): 0.7})
    gemma = dist(tiny_gemma, {one_id(tiny_gemma, " Paris"): 0.8, one_id(tiny_gemma, "\n"): 0.1})
    c = rule([tiny_llama, tiny_gemma], top_k=3).fuse([smol, gemma], prefixes=[b"", b" "])
    assert b" Paris" not in c.keys and b"\n" not in c.keys  # Gemma's candidates lose its lead " "
    assert prob_of(c, 1, b"Paris") == pytest.approx(0.8)
    assert c.keys[int(torch.argmax(c.fused))] == b"Paris"
    assert float(c.fused[c.keys.index(b"Paris")]) == pytest.approx(0.75, abs=1e-4)


def test_fusion_rejects_bad_input(tiny_llama: Member, tiny_gemma: Member) -> None:
    with pytest.raises(InvalidOptionError):
        make_distribution("average", [tiny_llama])
    with pytest.raises(InvalidOptionError):
        UniTE([tiny_llama], top_k=0)
    rule = UniTE([tiny_llama, tiny_gemma])
    p = torch.full((tiny_llama.vocab_size,), 1.0 / tiny_llama.vocab_size)
    with pytest.raises(InvalidOptionError):
        rule.fuse([p])  # one vector for two members
    with pytest.raises(InvalidOptionError):
        rule.fuse([p, p])  # the second has the wrong vocabulary size
    with pytest.raises(InvalidOptionError):
        rule.fuse([p, torch.zeros(tiny_gemma.vocab_size)], drafter=2)


# ============================================================================ sharpening
def hand_made(keys: list, fused: list[float], drafter_top: list[bool] | None = None,
              member_probs: list[list[float]] | None = None) -> C:
    probs = torch.tensor(member_probs) if member_probs else torch.tensor([fused, fused])
    top = torch.tensor(drafter_top if drafter_top is not None else [True] * len(keys))
    return C(tuple(keys), probs, torch.tensor(fused), top)


def test_prefix_merge_picks_the_prefix_the_members_share() -> None:
    c = hand_made([b"So", b"Sof", b"Sofia", b" the"], [0.3, 0.1, 0.25, 0.35])
    scores = prefix_merge(c.keys, c.fused, c.drafter_top)
    assert scores.tolist() == pytest.approx([0.65, 0.1, 0.25, 0.35])
    assert c.keys[int(torch.argmax(sharpen(c, "heuristic")))] == b"So"
    assert c.keys[int(torch.argmax(sharpen(c, "none")))] == b" the"


def test_prefix_merge_rules_out_whitespace_unlikely_and_foreign_prefixes() -> None:
    blank = hand_made([b" ", b" the", b" a"], [0.3, 0.36, 0.34])
    assert blank.keys[int(torch.argmax(sharpen(blank, "heuristic")))] == b" the"
    rare = hand_made([b"So", b"Sofia", b"Hi"], [0.09, 0.4, 0.45])  # "So" <= 0.1
    assert rare.keys[int(torch.argmax(sharpen(rare, "heuristic")))] == b"Hi"
    foreign = hand_made([b"So", b"Sofia", b"Hi"], [0.3, 0.3, 0.4], drafter_top=[False, True, True])
    assert foreign.keys[int(torch.argmax(sharpen(foreign, "heuristic")))] == b"Hi"


def test_geometric_mean_vetoes_a_token_one_member_finds_unlikely() -> None:
    c = hand_made([b"A", b"B"], [0.36, 0.30], member_probs=[[0.70, 0.30], [0.02, 0.30]])
    assert geometric_mean(c.member_probs).tolist() == pytest.approx([(0.70 * 0.02) ** 0.5, 0.30])
    assert int(torch.argmax(sharpen(c, "geometric"))) == 1
    assert int(torch.argmax(sharpen(c, "none"))) == 0


def test_sharpening_only_when_the_fused_maximum_is_below_one_half() -> None:
    c = hand_made([b"So", b"Sofia", b"Hi"], [0.2, 0.25, 0.55])
    assert sharpen(c, "heuristic").tolist() == pytest.approx([0.2, 0.25, 0.55])
    assert float(sharpen(hand_made([b"So", b"Sofia"], [0.3, 0.3]), "heuristic").sum()) == pytest.approx(1.0)
    with pytest.raises(InvalidOptionError):
        sharpen(c, "arithmetic")


def test_warm_up_builds_the_token_tables_the_first_request_would(monkeypatch: pytest.MonkeyPatch,
                                                                    tiny_llama: Member, tiny_gemma: Member) -> None:
    """``Ensemble.warm_up`` (called by ``ensemble serve`` and ``ensemble bench`` after loading) builds every
    member's table, so a request that reaches a point where the members disagree builds none."""
    from ensemble_core import Ensemble
    from ensemble_core.text import distributions

    monkeypatch.setattr(distributions, "_TABLES", {})  # as in a fresh process
    built: list[int] = []
    build = distributions._build_table

    def counted(tokenizer: object, size: int, eos: tuple[int, ...]) -> distributions.TokenTable:
        built.append(size)
        return build(tokenizer, size, eos)

    monkeypatch.setattr(distributions, "_build_table", counted)
    monkeypatch.setattr(distributions, "_UNIONS", {})
    monkeypatch.setattr(distributions, "_BACKINGS", {})
    Ensemble([tiny_llama, tiny_gemma], method="single").warm_up()
    assert built == []  # one member answers: nothing to map
    Ensemble([tiny_llama, tiny_gemma], method="specem").warm_up()  # selects, never fuses: tables, no union
    assert sorted(built) == sorted([tiny_llama.vocab_size, tiny_gemma.vocab_size]) and not distributions._UNIONS
    ensemble = Ensemble([tiny_llama, tiny_gemma], method="safe", max_new_tokens=12)
    ensemble.warm_up()
    assert len(distributions._UNIONS) == 1 and len(distributions._BACKINGS) == 2  # the fusion's union, on the device
    result = ensemble.generate("Tell me a story about a dragon.")
    assert result.stats["ensembled"] > 0, result.stats  # random members disagree: the tables were used
    assert len(built) == 2 and len(distributions._UNIONS) == 1 and len(distributions._BACKINGS) == 2


def test_concurrent_first_requests_build_a_token_table_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eight threads asking for the same new table at once: one builds it, the others wait for it
    (they each built Gemma-3's 262k-token table under the GIL in a batched SAFE run)."""
    import threading

    from ensemble_core.testing import bundled_tokenizer
    from ensemble_core.text import distributions

    tokenizer = bundled_tokenizer("smollm2-135m-instruct")
    size = len(tokenizer) + 11  # a size no other test asks for: a table not built yet
    built = []
    build = distributions._build_table

    def counted(*args: object) -> distributions.TokenTable:
        built.append(threading.get_ident())
        return build(*args)

    monkeypatch.setattr(distributions, "_build_table", counted)
    start = threading.Barrier(8)
    tables: list[distributions.TokenTable] = []

    def ask() -> None:
        start.wait()
        tables.append(distributions.token_table(tokenizer, size, [2]))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(tables) == 8 and all(t is tables[0] for t in tables)
    assert len(built) == 1
    assert tables[0].size == size and tables[0].keys[len(tokenizer):] == (None,) * 11
