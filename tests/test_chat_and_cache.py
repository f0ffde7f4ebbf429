"""Chat formatting per member, and exact KV-cache cropping around sliding windows."""

from __future__ import annotations

import pytest
import torch

from ensemble_core import InputError, Member, normalize_messages
from ensemble_core.chat import FALLBACK_TEMPLATE, render_chat
from ensemble_core.testing import tiny_member


def test_normalize_merges_roles_and_systems() -> None:
    msgs = normalize_messages([
        {"role": "system", "content": "A"}, {"role": "user", "content": "q1"}, {"role": "user", "content": "q2"},
        {"role": "system", "content": "B"}, {"role": "assistant", "content": "a"}, {"role": "user", "content": "q3"},
    ])
    assert msgs == [{"role": "system", "content": "A\n\nB"}, {"role": "user", "content": "q1\n\nq2"},
                    {"role": "assistant", "content": "a"}, {"role": "user", "content": "q3"}]
    assert normalize_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("bad", [[], [{"role": "robot", "content": "x"}], [{"role": "user"}],
                                 [{"role": "system", "content": "only"}], [{"role": "user", "content": 3}]])
def test_bad_messages(bad) -> None:
    with pytest.raises(InputError):
        normalize_messages(bad)


def test_each_member_uses_its_own_format(tiny_llama: Member, tiny_gemma: Member) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    smol = tiny_llama.render(msgs)
    assert smol.startswith("<|im_start|>system\nBe brief.<|im_end|>") and smol.endswith("<|im_start|>assistant\n")
    gemma = tiny_gemma.render(msgs)
    assert gemma == "Be brief.\n\nUser: Hi?\nAssistant:"
    ids = tiny_gemma.encode_prompt(gemma)
    assert ids[0] == tiny_gemma.tokenizer.bos_token_id and ids[1] != tiny_gemma.tokenizer.bos_token_id
    assert tiny_llama.encode_prompt(smol)[0] != tiny_llama.tokenizer.bos_token_id or smol.startswith("<|im_start|>")


def test_template_rejecting_system_role_gets_it_folded(tiny_llama: Member) -> None:
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
              "{% endif %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]")
    text = render_chat(tiny_llama.tokenizer, normalize_messages([{"role": "system", "content": "S"},
                                                                {"role": "user", "content": "U"}]), strict)
    assert text == "[user] S\n\nU\n[assistant]"
    assert "Assistant:" in render_chat(tiny_llama.tokenizer, [{"role": "user", "content": "x"}], FALLBACK_TEMPLATE)


def _full_logits(member: Member, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return member.model(input_ids=torch.tensor([ids])).logits[0, -1].float()


@pytest.mark.parametrize("window", [8, 512])
def test_crop_and_continue_matches_full_forward(window: int) -> None:
    """Rounds of draft-then-rollback past a tiny sliding window stay exact (or re-prefill)."""
    member = tiny_member("gemma3-270m", seed=1, layers=3, sliding_window=window,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    state = member.start_from_ids(list(range(100, 120)))
    gen = torch.Generator().manual_seed(0)
    for round_ in range(12):
        draft = torch.randint(200, 5000, (5,), generator=gen).tolist()
        rows = state.score(draft)
        assert torch.allclose(rows[-1], _full_logits(member, state.ids), atol=1e-4)
        keep = len(state.ids) - (round_ % 4)  # roll back 0..3 tokens
        state.crop(keep)
        assert torch.allclose(state.score()[-1], _full_logits(member, state.ids), atol=1e-4)
    # long rollback past the window: inexact crop → automatic re-prefill, still correct
    state.crop(len(state.ids) - 15)
    assert torch.allclose(state.score()[-1], _full_logits(member, state.ids), atol=1e-4)
    assert state.stats.reprefills == (1 if window == 8 else 0)
