"""Chat formatting per member, and exact KV-cache cropping around sliding windows."""

from __future__ import annotations

import pytest
import torch

from ensemble_core import InputError, Member, UnsupportedContentError, normalize_messages
from ensemble_core.testing import tiny_member
from ensemble_core.text.chat import FALLBACK_TEMPLATE, render_chat


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


def test_a_refusal_part_is_text_and_an_unknown_part_is_named() -> None:
    """OpenAI returns an assistant's refusal as a ``refusal`` content part, and its clients send the history
    back: that is text (it was refused as a non-text medium). A part type nobody knows is refused by name,
    not described as an image."""
    history = [{"role": "user", "content": "Tell me a secret."},
               {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't share that."}]},
               {"role": "user", "content": "Then a joke."}]
    assert normalize_messages(history)[1] == {"role": "assistant", "content": "I can't share that."}
    with pytest.raises(UnsupportedContentError, match="'weird', which the ensemble does not know"):
        normalize_messages([{"role": "user", "content": [{"type": "weird", "x": 1}]}])
    with pytest.raises(UnsupportedContentError, match="'input_audio' content part; the ensemble members are text-only"):
        normalize_messages([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}])
    with pytest.raises(InputError, match="'refusal' part whose 'refusal' is NoneType"):
        normalize_messages([{"role": "assistant", "content": [{"type": "refusal"}]}, {"role": "user", "content": "x"}])


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


def test_roomy_layer_appends_in_place_and_stays_exact() -> None:
    """Full-attention layers append into spare room (no copy of the whole cache per pass):
    crops, cache branches, growth past the room and a ``keys`` replaced from outside all keep
    the states a plain ``DynamicLayer`` would hold, and decoding matches a cache-free pass."""
    from transformers.cache_utils import DynamicLayer

    from ensemble_core.decoding.cache import RoomyLayer, new_cache
    from ensemble_core.decoding.verify_inline import branch_feed, cache_branch

    gen = torch.Generator().manual_seed(0)
    roomy, plain = RoomyLayer(room=4), DynamicLayer()
    for step, n in enumerate([3, 1, 1, 2, 5, 1, 9, 1]):
        k, v = torch.randn(1, 2, n, 8, generator=gen), torch.randn(1, 2, n, 8, generator=gen)
        got, want = roomy.update(k, v), plain.update(k, v)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
        if step == 3:
            buffer = roomy._k
        if step == 4:  # grew past the room: new buffers
            assert roomy._k is not buffer
        if step in (2, 5):
            roomy.crop(-2), plain.crop(-2)
        if step == 6:  # replaced from outside (e.g. a batch select): adopted again on the next update
            roomy.keys, roomy.values = roomy.keys.clone(), roomy.values.clone()
            assert roomy.held() is None and roomy.get_seq_length() == plain.get_seq_length()  # held as given
        else:  # a prefix of the buffer: held as its length, a view made when read
            assert roomy.held() == roomy.get_seq_length() == plain.get_seq_length()
    assert roomy.keys.data_ptr() == roomy._k.data_ptr() and roomy._k.shape[-2] > roomy.keys.shape[-2]

    member = tiny_member("smollm2-135m-instruct", seed=2)
    assert all(type(layer) is RoomyLayer for layer in new_cache(member.model).layers)
    state = member.start_from_ids(list(range(100, 130)))
    for round_ in range(6):
        state.score()
        with cache_branch(state):
            branch_feed(state, [777])  # states written into the room, then rewound
        rows = state.score(torch.randint(200, 5000, (4,), generator=gen).tolist())
        assert torch.allclose(rows[-1], _full_logits(member, state.ids), atol=1e-4)
        state.crop(len(state.ids) - round_ % 3)
        assert torch.allclose(state.score()[-1], _full_logits(member, state.ids), atol=1e-4)


@pytest.mark.parametrize("passes", ["eager", "static"])
def test_last_row_is_the_last_scored_row_from_a_pass_that_keeps_one_position(passes: str) -> None:
    """``last_row`` (what every-token's step and a remote member's ``next_row`` take) equals ``score(...)[-1]``
    after new ids, with ids pending before them, and with nothing new; its pass keeps one position (#38:
    ``score`` put the cached row before the new rows, a copy and a concatenation on the device only to
    take the last)."""
    base = tiny_member("smollm2-135m-instruct", seed=4, layers=2)
    member = Member(base.model, base.tokenizer, name=f"smol-{passes}", passes=passes, max_cache_len=64)
    prompt = [5, 17, 300, 42, 9]
    a, b = member.start_from_ids(prompt), member.start_from_ids(prompt)
    a.score()
    b.score()
    kept: list[int] = []
    job = a._job
    a._job = lambda pending, keep, unread=None: (kept.append(keep), job(pending, keep, unread))[1]  # type: ignore[method-assign]
    for new in ([7, 8, 9], [], [11]):
        passes_before = a.stats.forward_passes
        got, want = a.last_row(new), b.score(new)[-1]
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6), new
        assert a.stats.forward_passes == passes_before + (1 if new else 0)
    a.ids.extend([12, 13])  # pending ids (as a crop-and-refeed leaves them), then one more
    b.ids.extend([12, 13])
    assert torch.allclose(a.last_row([14]), b.score([14])[-1], atol=1e-6)
    assert kept == [1, 1, 1] and a.ids == b.ids
