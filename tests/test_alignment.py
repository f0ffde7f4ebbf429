"""Alignment on the three bundled real tokenizers over adversarial strings."""

from __future__ import annotations

import pytest

from ensemble_core.testing import bundled_tokenizer
from ensemble_core.text.alignment import (
    IncrementalDecoder,
    decode,
    decode_suffix,
    encode_continuation,
    is_common_boundary,
    tokenize,
    tokenize_open,
)

ADVERSARIAL = [
    "Sofia met Sofía in São Paulo.",
    " Incorrect",
    "The answer is 12,345.67 dollars, not -8.5 or 1e10.",
    "Crème brûlée, naïve façade, Ångström.",
    "東京は日本の首都です。北京和上海。",
    "Emoji: 😀👍🏽 and 🇫🇷 flags!",
    "def f(x):\n    if x:\n        return x  # comment\n\treturn None\n",
    "Spaces:   three,     five\n\n\n\nfour newlines\r\nand CRLF.",
    "Mixed 123abc456 and ½ ¼ ∑ ∫ ≠ symbols",
]


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m", "qwen2.5-coder-0.5b-instruct"])
def tok(request: pytest.FixtureRequest):
    return bundled_tokenizer(request.param)


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_boundaries_are_character_offsets(tok, text: str) -> None:
    t = tokenize(tok, text)
    assert decode(tok, t.ids) == text  # round trip
    assert list(t.ends) == sorted(t.ends) and t.ends[-1] == len(text)
    for i, (s, e, ok) in enumerate(zip(t.starts, t.ends, t.valid)):
        assert 0 <= s <= e <= len(text)
        if ok:  # the text of tokens up to a valid boundary decodes to exactly that prefix
            assert decode(tok, t.ids[: i + 1]) == text[:e]
        else:  # an invalid boundary is inside a character: the decoded prefix is broken
            assert decode(tok, t.ids[: i + 1]) != text[:e]
    assert t.is_boundary(0) and t.is_boundary(len(text))
    assert t.boundaries() == {0} | {e for e, ok in zip(t.ends, t.valid) if ok}


@pytest.mark.parametrize("text", ADVERSARIAL)
def test_continuation_equals_full_encoding(tok, text: str) -> None:
    """Appending text piece by piece reuses all but the re-encoded margin and ends equal."""
    cut_points = sorted({len(text) * k // 5 for k in range(1, 5)} | {len(text)})
    prev = tokenize(tok, text[: cut_points[0]])
    for cut in cut_points[1:]:
        keep, cont = encode_continuation(tok, text[:cut], prev, margin=5)
        full = tokenize(tok, text[:cut])
        assert cont.ids == full.ids and cont.ends == full.ends and cont.valid == full.valid
        assert cont.ids[:keep] == prev.ids[:keep]
        assert keep >= len(prev) - 5 - 3 or keep == cont.ids.__len__()  # only the margin (+ a char) is redone
        prev = cont


def test_continuation_after_divergence(tok) -> None:
    """When the tail of the old text is replaced (a draft rejected), the kept ids stop before it."""
    old = tokenize(tok, "The result is Incorrect because")
    keep, new = encode_continuation(tok, "The result is Inconsistent", old)
    assert new.ids == tokenize(tok, "The result is Inconsistent").ids
    assert decode(tok, new.ids[:keep]) == decode(tok, old.ids[:keep])
    assert len(decode(tok, new.ids[:keep])) <= len("The result is Inc")


def test_incorrect_is_not_a_common_boundary() -> None:
    smol, gemma = bundled_tokenizer("smollm2-135m-instruct"), bundled_tokenizer("gemma3-270m")
    a, b = tokenize(smol, " Incorrect"), tokenize(gemma, " Incorrect")
    assert [decode(smol, [i]) for i in a.ids] == [" Inc", "orrect"]
    assert len(b.ids) == 1
    assert a.is_boundary(4) and not b.is_boundary(4)
    assert not is_common_boundary(4, [a, b])
    assert is_common_boundary(0, [a, b]) and is_common_boundary(10, [a, b])


def test_split_characters_are_not_boundaries() -> None:
    smol = bundled_tokenizer("smollm2-135m-instruct")
    t = tokenize(smol, "東京 😀")
    assert len(t.ids) > 4  # byte-level pieces
    assert not t.is_boundary(len("東京 😀") - 1) or t.is_boundary(3)
    inside = [e for e, ok in zip(t.ends, t.valid) if not ok]
    assert inside, "byte-level BPE must produce in-character token ends"
    assert all(decode(smol, t.ids[: i + 1]).endswith("\ufffd") for i, ok in enumerate(t.valid) if not ok)


def test_incremental_decoder_never_emits_partial_characters(tok) -> None:
    text = "Emoji 😀 and 東京, done."
    t = tokenize(tok, text)
    ids = list(t.ids)
    dec, out = IncrementalDecoder(tok), []
    for i in ids:
        delta = dec.push([i])
        assert "\ufffd" not in delta
        out.append(delta)
    assert "".join(out) + dec.flush() == text
    for k in range(1, len(ids)):
        suffix = decode_suffix(tok, ids[:k], ids[k:])
        # after a valid boundary: exactly the rest; inside a character: the rest from that character
        if t.valid[k - 1]:
            assert suffix == text[t.ends[k - 1]:]
        else:
            assert text.endswith(suffix) and len(suffix) > len(text) - t.ends[k - 1]


def test_decode_is_the_tokenizers_own_decode(tok) -> None:
    """The backend fast path gives transformers' text: special tokens dropped, nothing cleaned up,
    a character cut in two left as U+FFFD, ids at the vocabulary's ends included."""
    ids = [i for text in ADVERSARIAL for i in tok(text, add_special_tokens=False)["input_ids"]]
    special = [i for i in tok.all_special_ids if i is not None]
    windows = [ids[a:a + n] for n in (1, 2, 3, 7) for a in range(0, len(ids) - n, 5)]
    windows += [special + ids[:6], ids[:4] + special, [0, len(tok) - 1], []]
    for window in windows:
        assert decode(tok, window) == tok.decode(window, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def test_decode_keeps_a_subclass_own_decoding() -> None:
    """A tokenizer class that changes ``decode`` is decoded its own way, not through the backend."""
    base = bundled_tokenizer("smollm2-135m-instruct")

    class Shouting(type(base)):  # type: ignore[misc]
        def decode(self, token_ids, **kwargs):  # type: ignore[no-untyped-def]
            return super().decode(token_ids, **kwargs).upper()

    loud = Shouting.__new__(Shouting)
    loud.__dict__.update(base.__dict__)
    ids = base("Hello there", add_special_tokens=False)["input_ids"]
    assert decode(loud, ids) == "HELLO THERE"


def test_tokenize_is_the_tokenizers_own_encoding(tok) -> None:
    """The backend fast path gives transformers' ids and offsets, special-token text included."""
    from ensemble_core.text import alignment

    assert alignment._backend_encoder(tok) is tok.backend_tokenizer  # the bundled tokenizers take the fast path
    eos = tok.convert_ids_to_tokens(tok.eos_token_id)
    for text in [*ADVERSARIAL, f"one{eos}two", ""]:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        got = tokenize(tok, text, offset=3)
        assert list(got.ids) == enc["input_ids"]
        assert [(s - 3, e - 3) for s, e in zip(got.starts, got.ends)] == [tuple(s) for s in enc["offset_mapping"]]


def test_tokenize_takes_transformers_call_when_the_backend_is_set_otherwise() -> None:
    """A backend left truncating (or splitting special tokens unlike its tokenizer) is not asked directly:
    the result is transformers' call, which sets the backend per call."""
    import copy

    tok = copy.deepcopy(bundled_tokenizer("smollm2-135m-instruct"))
    text = ADVERSARIAL[2]
    full = tok(text, add_special_tokens=False)["input_ids"]
    tok.backend_tokenizer.enable_truncation(3)
    assert list(tokenize(tok, text).ids) == full and len(full) > 3
    eos = tok.convert_ids_to_tokens(tok.eos_token_id)
    tok.backend_tokenizer.encode_special_tokens = True  # the tokenizer says: keep special tokens whole
    assert tokenize(tok, f"a{eos}b").ids == tuple(tok(f"a{eos}b", add_special_tokens=False)["input_ids"])
    assert tok.eos_token_id in tokenize(tok, f"a{eos}b").ids


@pytest.mark.parametrize("text", ["```\n\n", "a\n\n\n", "Hi.\n", "word  ", "x\t\n", "no space", "", "北京\n\n"])
def test_an_open_end_splits_a_trailing_whitespace_run_as_text_after_it_would(tok, text: str) -> None:
    """tokenize_open(text) is the encoding of text + more, cut at text's end, where that covers text exactly."""
    opened = tokenize_open(tok, text, offset=3)
    assert opened.text == text and decode(tok, list(opened.ids)) == text
    assert opened.ends[-1:] in ((), (3 + len(text),)) and all(opened.valid[-1:])
    after = tokenize(tok, text + "This", offset=3)
    n = len(opened)
    if opened.ids != tokenize(tok, text, offset=3).ids:  # split: then exactly as text after it reads
        assert after.ids[:n] == opened.ids and after.starts[n] == 3 + len(text)


def test_smollm2_keeps_newlines_apart_before_the_next_text() -> None:
    tok = bundled_tokenizer("smollm2-135m-instruct")
    names = tok.convert_ids_to_tokens
    assert names(list(tokenize(tok, "```\n\n").ids)) == ["```", "ĊĊ"]  # the tokenizer at a text's end
    assert names(list(tokenize_open(tok, "```\n\n").ids)) == ["```", "Ċ", "Ċ"]  # and once text follows
    previous = tokenize(tok, "```\n")
    _, merged = encode_continuation(tok, "```\n\n", previous, open_end=True)
    assert names(list(merged.ids)) == ["```", "Ċ", "Ċ"]
    assert names(list(encode_continuation(tok, "```\n\n", previous)[1].ids)) == ["```", "ĊĊ"]  # published

