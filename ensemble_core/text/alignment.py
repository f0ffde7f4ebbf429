"""Cross-tokenizer alignment: token boundaries as character offsets.

Members with different tokenizers share the response as *text*. This module answers,
for each member, where its tokens begin and end in that text, whether a character offset
is a token boundary for every member (SAFE's stability check), and how to extend a
member's tokenization when text is appended without re-encoding the whole response.

Offsets come from the fast tokenizers' ``offset_mapping``. A byte-level BPE tokenizer
splits multi-byte characters over several tokens that all carry the same character span
(SmolLM2: "東" is three tokens with offsets (k, k+1)); the boundary between such tokens
lies *inside* a character and is never a valid boundary.
"""

from __future__ import annotations

import bisect
import functools
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers.tokenization_utils_tokenizers import TokenizersBackend

#: One decoding convention everywhere: text round-trips and no special tokens leak.
DECODE_KWARGS: dict[str, bool] = {"skip_special_tokens": True, "clean_up_tokenization_spaces": False}
#: Tokens re-encoded behind the committed boundary when text is appended (published SAFE: 5).
DEFAULT_MARGIN = 5
#: Extra tokens a draft may take beyond its length so that it does not end inside a
#: character (a UTF-8 character is at most 4 bytes, so 4 byte tokens always finish one).
PARTIAL_CHAR_TOKENS = 4
REPLACEMENT_CHAR = "\ufffd"


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """Decode with the project-wide flags (see :data:`DECODE_KWARGS`).

    A fast tokenizer that keeps transformers' own decoding is asked through its Rust backend: the
    same text (transformers' ``_decode`` is that call when nothing is cleaned up) without its
    wrapper's argument checks, ~5 us of a decode's ~7 on a short window, and decodes run a few
    times per output token (the token pipeline's and SAFE's texts; #38's host work per token).
    """
    if not DECODE_KWARGS["clean_up_tokenization_spaces"] and _keeps_backend(type(tokenizer), "decode", "_decode"):
        return tokenizer.backend_tokenizer.decode(list(ids), skip_special_tokens=DECODE_KWARGS["skip_special_tokens"])
    return tokenizer.decode(list(ids), **DECODE_KWARGS)


def _backend_encoder(tokenizer: Any) -> Any | None:
    """``tokenizer``'s Rust backend when encoding through it gives transformers' ids and offsets, else None.

    Why: SAFE re-encodes a short window per verifier and round, and transformers' call around the backend's
    encode (its argument checks, the batch it makes of one text, ``BatchEncoding``) costs ~3x the encode
    itself (~75 us against ~20 on a 10-token window). Equal when the class keeps transformers' encoding and
    the backend is as that call leaves it: no truncation, no padding, special tokens split as the
    tokenizer says (transformers sets these on the backend per call; anything else takes the full call).
    """
    if not _keeps_backend(type(tokenizer), "__call__", "_encode_plus"):
        return None
    backend = tokenizer.backend_tokenizer
    if (backend.truncation is not None or backend.padding is not None
            or backend.encode_special_tokens != tokenizer.split_special_tokens):
        return None
    return backend


@functools.cache
def _keeps_backend(kind: type, *methods: str) -> bool:
    """Whether ``kind`` is a transformers fast tokenizer class that keeps transformers' own ``methods``
    (a subclass that changes them encodes or decodes its own way, so its backend alone would not do)."""
    return issubclass(kind, TokenizersBackend) and all(getattr(kind, m) is getattr(TokenizersBackend, m) for m in methods)


@dataclass(frozen=True)
class Tokenized:
    """A text and one member's tokenization of it, with character spans per token.

    ``valid[i]`` says whether the offset ``ends[i]`` (just after token ``i``) is a real
    boundary: False when token ``i`` ends inside a character that the next token
    finishes.
    """

    text: str
    ids: tuple[int, ...]
    starts: tuple[int, ...]
    ends: tuple[int, ...]
    valid: tuple[bool, ...]

    def __len__(self) -> int:
        return len(self.ids)

    def boundaries(self) -> set[int]:
        """Every character offset that is a token boundary (0 included)."""
        return {0} | {e for e, ok in zip(self.ends, self.valid) if ok}

    def is_boundary(self, offset: int) -> bool:
        """Whether ``offset`` is a token boundary (binary search: O(log n))."""
        if offset == 0:
            return True
        i = bisect.bisect_right(self.ends, offset) - 1
        return i >= 0 and self.ends[i] == offset and self.valid[i]

    def tokens_before(self, offset: int) -> int:
        """Number of tokens up to the last valid boundary at or before ``offset``."""
        return self.last_boundary(bisect.bisect_right(self.ends, offset))

    def last_boundary(self, n: int) -> int:
        """The largest ``k <= n`` such that the first ``k`` tokens end on a valid boundary.

        Cutting a tokenization anywhere else would split a character between tokens;
        every cut (token budget, cache rollback, re-encoding margin) walks back with this.
        """
        n = min(n, len(self.ids))
        while n > 0 and not self.valid[n - 1]:
            n -= 1
        return n

    def end(self, n: int) -> int:
        """Character offset just after the first ``n`` tokens (0 for none)."""
        return self.ends[n - 1] if n else 0

    def prefix(self, n: int) -> Tokenized:
        """The first ``n`` tokens and the text up to their end."""
        return Tokenized(self.text[: self.end(n)], self.ids[:n], self.starts[:n], self.ends[:n], self.valid[:n])

    def extend(self, tail: Tokenized) -> Tokenized:
        """This tokenization followed by ``tail`` (whose spans are already absolute offsets)."""
        return Tokenized(self.text + tail.text, self.ids + tail.ids, self.starts + tail.starts,
                         self.ends + tail.ends, self.valid + tail.valid)

    def truncated(self, n: int) -> Tokenized:
        """The first ``n`` tokens, or fewer: never more than ``n``, never inside a character."""
        return self.prefix(self.last_boundary(n))


#: The tokenization of the empty text.
EMPTY = Tokenized("", (), (), (), ())


def _spans_from_decoding(tokenizer: Any, ids: Sequence[int]) -> list[tuple[int, int]]:
    """Character spans by cumulative decoding, for tokenizers without offset mapping."""
    spans, prev = [], 0
    for i in range(len(ids)):
        text = decode(tokenizer, ids[: i + 1])
        end = len(text.rstrip(REPLACEMENT_CHAR)) if text.endswith(REPLACEMENT_CHAR) else len(text)
        spans.append((min(prev, end), end))
        prev = end
    return spans


def tokenize(tokenizer: Any, text: str, offset: int = 0) -> Tokenized:
    """Tokenize ``text`` (no special tokens) with character spans shifted by ``offset``."""
    backend = _backend_encoder(tokenizer)
    if backend is not None:
        enc = backend.encode(text, add_special_tokens=False)
        ids, spans = enc.ids, enc.offsets
    elif getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        spans = [tuple(s) for s in enc["offset_mapping"]]
    else:
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        spans = _spans_from_decoding(tokenizer, ids)
    starts = [s + offset for s, _ in spans]
    ends = [e + offset for _, e in spans]
    valid = [ends[i] <= starts[i + 1] for i in range(len(ids) - 1)]
    if ids:
        valid.append(True)
    return Tokenized(text, tuple(ids), tuple(starts), tuple(ends), tuple(valid))


#: Text appended after a trailing whitespace run to see how the run splits once text follows it
#: (:func:`tokenize_open`); a letter, which no pre-tokenizer joins to a newline before it.
OPEN_END = "x"


def tokenize_open(tokenizer: Any, text: str, offset: int = 0) -> Tokenized:
    """Tokenize ``text``, the end of a reply that is still being written, as it will read once text follows.

    Why: byte-level BPE with GPT-2's pre-tokenizer (SmolLM2) encodes a whitespace run at the *end*
    of a text as one token (``"```\n\n"`` → ``` ```, ĊĊ ```) but splits it once text follows
    (``"```\n\nThis"`` → ``` ```, Ċ, Ċ, This ```). Re-encoding a reply after each committed piece
    (every-token, SAFE's appended text) put the members after ``ĊĊ``, a context they never meet
    mid-text: they wrote another newline, and the run grew to the token budget (two copies of
    SmolLM2 under every-token: ``"```\n\n\n\n..."`` where SmolLM2 alone wrote ``"```\n\nThis"``).
    So a trailing whitespace run is encoded with :data:`OPEN_END` after it, and the tokens that
    cover ``text`` exactly are kept; where the run would join the next text's first token (a
    trailing space before a word), the plain encoding stands.
    """
    if not text or not text[-1].isspace():
        return tokenize(tokenizer, text, offset)
    opened = tokenize(tokenizer, text + OPEN_END, offset)  # one encoding: the plain one only where this fails
    end = offset + len(text)
    n = bisect.bisect_right(opened.ends, end)
    if n == 0 or opened.ends[n - 1] != end or (n < len(opened) and opened.starts[n] < end):
        return tokenize(tokenizer, text, offset)
    return Tokenized(text, opened.ids[:n], opened.starts[:n], opened.ends[:n], opened.valid[:n])


def is_common_boundary(offset: int, tokenizations: Iterable[Tokenized]) -> bool:
    """True when ``offset`` is a token boundary in every given tokenization.

    This is SAFE's stability (OOV-like) check: a verifier's next-token distribution is
    only meaningful right after one of its own token boundaries.
    """
    return all(t.is_boundary(offset) for t in tokenizations)


def _common_prefix_len(a: str, b: str) -> int:
    if b.startswith(a):
        return len(a)
    return len(os.path.commonprefix([a, b]))


def encode_continuation(
    tokenizer: Any, text: str, previous: Tokenized, margin: int = DEFAULT_MARGIN, open_end: bool = False
) -> tuple[int, Tokenized]:
    """Tokenize ``text`` reusing ``previous`` (a tokenization of an earlier version).

    The last ``margin`` tokens behind the point where the texts diverge are re-encoded
    together with the new text, because appending text can change how the last few
    tokens merge (" Inc" + "orrect"). Work is proportional to the margin plus the new
    text, not to the whole response.

    Returns ``(keep, tokenized)``: the new tokenization of ``text`` and how many of its
    leading token ids equal ``previous``'s (a KV cache may be kept up to ``keep``).
    ``open_end``: ``text`` is a reply still being written, whose trailing whitespace run is
    encoded as it will be once text follows (:func:`tokenize_open`).
    """
    common = _common_prefix_len(previous.text, text)
    split = previous.last_boundary(min(previous.tokens_before(common), max(len(previous) - margin, 0)))
    start = previous.end(split)
    tail = (tokenize_open if open_end else tokenize)(tokenizer, text[start:], offset=start)
    merged = previous.prefix(split).extend(tail)  # the texts agree up to ``start`` (<= the common prefix)
    keep = split
    for a, b in zip(tail.ids, previous.ids[split:]):
        if a != b:
            break
        keep += 1
    return keep, merged


#: Tokens of left context used when decoding new ids, so that decoders which strip a
#: leading space or merge bytes across tokens see what precedes the new ids.
DECODE_CONTEXT = 4


def decode_suffix(tokenizer: Any, context_ids: Sequence[int], new_ids: Sequence[int]) -> str:
    """Text that ``new_ids`` add after ``context_ids`` (only the last few context ids are decoded).

    The result may end in U+FFFD when the last id stops inside a multi-byte character.
    """
    ctx = list(context_ids[-DECODE_CONTEXT:]) if DECODE_CONTEXT else []
    head = decode(tokenizer, ctx)
    full = decode(tokenizer, ctx + list(new_ids))
    return full[len(head):] if full.startswith(head) else full[len(head.rstrip(REPLACEMENT_CHAR)):]


class IncrementalDecoder:
    """Text of a growing list of ids, in work proportional to the new ids.

    Ids whose text ends inside a character are held until the character completes, so
    the text returned by :meth:`push` is final and never retracted.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.read = 0  # ids whose text has been returned
        self.text = ""

    def push(self, new_ids: Sequence[int]) -> str:
        self.ids.extend(int(i) for i in new_ids)
        delta = decode_suffix(self.tokenizer, self._context(), self.ids[self.read:])
        if delta.endswith(REPLACEMENT_CHAR):
            return ""
        self.read = len(self.ids)
        self.text += delta
        return delta

    def _context(self) -> list[int]:
        """The ids before the unread ones that :func:`decode_suffix` reads (a copy of the whole list per token
        made a reply's detokenisation quadratic in its length)."""
        return self.ids[max(self.read - DECODE_CONTEXT, 0):self.read]

    def flush(self) -> str:
        """Whatever is pending, even an unfinished character (end of generation)."""
        delta = decode_suffix(self.tokenizer, self._context(), self.ids[self.read:])
        self.read = len(self.ids)
        self.text += delta
        return delta
