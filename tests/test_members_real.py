"""Bundled real models: offline loading and incremental decoding through the member API.

Incremental greedy decoding (prefill, step, crop, continue) must reproduce
``model.generate(do_sample=False)`` token for token, also after cropping the cache back
by k tokens and re-decoding, and past Gemma-3's 512-token sliding window.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ensemble_core import Member
from ensemble_core.models.bundled import cache_dir
from ensemble_core.testing import greedy_decode, reference_greedy

pytestmark = pytest.mark.real

PROMPTS = [
    "What is the capital of France?",
    "Sofia has 12,345.67 dollars. She spends 345 dollars. How much is left?",
    "Écris une phrase sur le café. 東京 😀",
    "Write a Python function that returns the square of x.",
]


def test_loads_offline_from_conversion_cache(smollm2: Member, gemma3: Member) -> None:
    """Both bundled models come from the safetensors conversion cache, offline, once per process."""
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
    root = cache_dir() / "converted"
    for m in (smollm2, gemma3):
        path = Path(m.model.config.name_or_path)
        assert path.parent == root and any(path.glob("*.safetensors")), path
    assert Member.load("gemma3-270m").model is gemma3.model  # weights shared, not reloaded
    assert smollm2.tokenizer.chat_template and not getattr(gemma3.tokenizer, "chat_template", None)
    assert gemma3.stop_strings == ("\nUser:",) and smollm2.stop_strings == ()
    assert smollm2.eos_token_ids and gemma3.eos_token_ids


@pytest.mark.parametrize("which", ["smollm2", "gemma3"])
def test_incremental_greedy_equals_generate(which: str, request: pytest.FixtureRequest) -> None:
    member: Member = request.getfixturevalue(which)
    for prompt in PROMPTS[:3]:
        state = member.start(prompt)
        want = reference_greedy(member, state.ids[: state.prompt_len], 16)
        got = greedy_decode(state, 16)
        assert got == want[: len(got)] and (len(got) == len(want) or got[-1] in member.eos_token_ids), prompt
        # Crop back k tokens and decode them again: the same tokens must come out.
        k = min(6, len(state.response_ids) - 1)
        if k > 0:
            keep = state.response_ids[:-k]
            state.crop(state.prompt_len + len(keep))
            again = keep + greedy_decode(state, len(got) - len(keep))
            assert again == got, prompt
        assert state.stats.forward_passes > 0 and state.stats.reprefills == 0


def test_gemma_crop_past_sliding_window(gemma3: Member) -> None:
    """A prompt longer than the 512-token window: decode, crop back, continue == generate."""
    text = " ".join(f"Item {i} costs {i * 3} dollars." for i in range(90))
    state = gemma3.start(text + "\nWhat does item 7 cost?")
    assert state.prompt_len > 600
    want = reference_greedy(gemma3, state.ids[: state.prompt_len], 10)
    got = greedy_decode(state, 10)
    assert got == want[: len(got)]
    state.crop(len(state.ids) - 4)
    again = state.response_ids + greedy_decode(state, len(got) - len(state.response_ids))
    assert again == got
    assert state.stats.reprefills == 0  # the crop stayed within what past recording keeps


def test_clearing_unreferenced_models_keeps_the_held_ones_shared(smollm2: Member) -> None:
    """``clear_loaded(unreferenced_only=True)`` forgets a model nothing holds (its memory goes) and keeps a held
    one cached, so that loading it again shares it instead of making a second copy."""
    import gc
    import weakref

    from ensemble_core.models.loading import clear_loaded

    spare = Member.load("smollm2-135m-instruct", dtype="bfloat16")  # its own cache entry (another dtype)
    spare_model = weakref.ref(spare.model)
    assert Member.load("smollm2-135m-instruct", dtype="bfloat16").model is spare.model  # cached while held
    del spare
    gc.collect()
    assert spare_model() is not None  # the cache alone still holds it
    clear_loaded(unreferenced_only=True)
    assert spare_model() is None  # freed
    assert Member.load("smollm2-135m-instruct").model is smollm2.model  # the held one is still shared


def test_a_character_the_budget_cuts_in_half_is_not_returned(smollm2: Member) -> None:
    """SmolLM2 spells most CJK characters in 2-3 byte tokens: a budget that ends inside one left U+FFFD at
    the end of ``single``'s answer ('北�', '北京是�'); the other methods already dropped the half character."""
    from ensemble_core import Ensemble

    prompt = "请用中文回答：北京是哪个国家的首都？"
    full = Ensemble([smollm2], method="single", max_new_tokens=24).generate(prompt).text
    assert full.startswith("北京是")
    for budget in (3, 6):
        stream = Ensemble([smollm2], method="single", max_new_tokens=budget).stream(prompt)
        pieces = list(stream)
        result = stream.result
        assert result.finish_reason == "length" and "\ufffd" not in result.text, (budget, result.text)
        assert "".join(pieces) == result.text and full.startswith(result.text) and result.text, budget
