"""Verify in line: many candidates scored in ONE packed pass equal separate and cache-free scoring."""

from __future__ import annotations

import pytest
import torch

from ensemble_core import Ensemble, Member, UnsupportedAttentionError
from ensemble_core.decoding.verify_inline import (
    branch_feed,
    branch_feed_steps,
    cache_branch,
    score_candidates_inline,
    score_candidates_separately,
)
from ensemble_core.methods.specem import SpecEMEnsemble
from ensemble_core.testing import random_ids, reference_last_row, tiny_member

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
    # a cached one-row step against one cache-free pass over the whole context: their products
    # sum in other orders (oneDNN, products.py): 1.2e-4 apart on Gemma-3's logits after 34
    # tokens, 4e-4 on logits of magnitude ~57 after 520 (MKL's were under 1e-4); a wrong cache
    # would be off by whole units
    assert torch.allclose(state.score([77])[-1], reference_last_row(member, context + [77]), atol=3e-4, rtol=1e-5)


# ----------------------------------------------------------------------------- verify in line (tiny)
@pytest.mark.parametrize("context_len", [6, 30])
def test_inline_exact_on_tiny_sliding_window(context_len: int, tiny_gemma: Member) -> None:
    """Window 8: contexts and candidates longer than the window still score exactly."""
    member = tiny_member("gemma3-270m", seed=1, layers=3, sliding_window=8,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    cands = [random_ids(n, seed=n) for n in (1, 3, 7, 12, 0)]
    assert_inline_exact(member, random_ids(context_len, 0), cands, [False, True, False, True, True])


def test_inline_exact_on_tiny_llama(tiny_llama: Member) -> None:
    assert_inline_exact(tiny_llama, random_ids(9, 3), [random_ids(n, 10 + n) for n in (5, 2, 9)], [False, False, True])


def test_inline_after_rollbacks_keeps_decode_state_exact(tiny_gemma: Member) -> None:
    """Branches must not trim sliding layers behind DecodeState's back (it may still crop later)."""
    member = tiny_member("gemma3-270m", seed=2, layers=2, sliding_window=8,
                         layer_types=["sliding_attention", "full_attention"])
    state = member.start_from_ids(random_ids(20, 1))
    state.score()
    cands = [random_ids(4, 5), random_ids(6, 6)]
    for i in range(4):
        state.score(random_ids(3, 20 + i))  # 3 fed since the last crop
        score_candidates_inline(state, cands)
        state.crop(len(state.ids) - 2)  # still exact (no re-prefill) because the branch restored everything
        assert torch.allclose(state.score()[-1], reference_last_row(member, state.ids), atol=1e-4)
    assert state.stats.reprefills == 0


def test_flash_attention_verifier_is_refused(tiny_llama: Member, tiny_gemma: Member) -> None:
    fa = tiny_member("smollm2-135m-instruct", seed=3, name="fa2")
    fa.model.config._attn_implementation = "flash_attention_2"
    other = tiny_gemma
    with pytest.raises(UnsupportedAttentionError, match="sdpa"):
        SpecEMEnsemble([fa, other])
    with pytest.raises(UnsupportedAttentionError):
        Ensemble([fa, other], method="generate-then-select")
    SpecEMEnsemble([fa, other], verifiers=[1])  # as a drafter only it is fine



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




@pytest.mark.parametrize("passes", ["eager", "static"])
@pytest.mark.parametrize("sampled", [False, True])
def test_steps_on_a_branch_feed_each_rows_choice_and_leave_the_state_as_it_was(passes: str, sampled: bool) -> None:
    """``branch_feed_steps`` (#38: a segment's chunk as one job of several steps): the rows and ids of as many
    ``branch_feed`` calls each fed the id chosen from the last row (its argmax, or a seeded draw made in the
    same order), counted as that many passes, and the branch's end leaves the state where it was."""
    base = tiny_member("smollm2-135m-instruct", seed=0, initializer_range=0.2)
    member = Member(base.model, base.tokenizer, name=f"m-{passes}", passes=passes, max_cache_len=256)
    a, b = (member.start_from_ids(random_ids(11, 2)) for _ in range(2))

    def drawer():  # type: ignore[no-untyped-def]
        generator = torch.Generator().manual_seed(7)
        return lambda row: torch.multinomial(torch.softmax(row, -1), 1, generator=generator)[0]

    choose = drawer() if sampled else None
    first = a.score()[-1].argmax()
    assert int(first) == int(b.score()[-1].argmax())
    with cache_branch(a):
        rows, ids = branch_feed_steps(a, first, 6, choose)
        grown = a.cache.get_seq_length()
    with cache_branch(b):
        again = drawer() if sampled else (lambda row: row.argmax())
        loop_rows, loop_ids, token = [], [], int(first)
        for _ in range(6):
            loop_rows.append(branch_feed(b, [token])[-1])
            loop_ids.append(int(again(loop_rows[-1])))
            token = loop_ids[-1]
        assert grown == b.cache.get_seq_length() == len(b.ids) + 6
    assert ids.tolist() == loop_ids
    assert torch.allclose(rows, torch.stack(loop_rows), atol=1e-5)
    assert a.stats.forward_passes == b.stats.forward_passes and a.cache.get_seq_length() == len(a.ids)
