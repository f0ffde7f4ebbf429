"""Loop penalty: constrained output that repeats itself is pushed to stop repeating.

Why: under a grammar a weak member cannot write invalid JSON, but it can write valid JSON
forever. On the bundled pair every forced tool call or schema reply that failed to parse
was a repetition the token budget cut: ``"attendees": ["Léa", "Léa", "Léa", …``, a string
that says ``"The review was very positive. The review was very positive. …``, a float
whose digits never end. The grammar keeps every alternative legal (``]``, a closing
quote), so a penalty on *continuing the repetition* is enough to end the value.

The rule works on the committed bytes, so it is the same for every member whatever its
tokenizer, and each member applies it in its own token space:

1. Look at the last :attr:`LoopPenalty.window` bytes of the output, whitespace removed
   (:data:`JSON_WHITESPACE`; a token counts by its first other byte). For every period
   ``p`` up to :attr:`~LoopPenalty.max_period`, ``run_p`` is how many trailing bytes
   equal the byte ``p`` places earlier (the output ends with a unit written once and then
   ``run_p`` more bytes of it again).
2. Where ``run_p`` reaches :attr:`~LoopPenalty.allowed`, the byte that would continue the
   period (``text[-p]``) is penalized by ``multiplier * base ** ((run_p - allowed) /
   bytes_per_step)`` logits: a member's tokens that start with that byte lose that much.
   The largest penalty per byte counts.
3. The penalty grows with every repeated byte, so a loop ends where the member is least
   sure about going on: between two list items (``,`` against ``]``), not inside a word.

This is the idea of the DRY sampler (llama.cpp ``--dry-multiplier``, an exponential penalty on
tokens that extend a repeated sequence), restricted to *adjacent* repeats and measured in bytes:
JSON repeats its keys between list items, and a DRY match over any earlier occurrence would
penalize the value after every repeated key. Between two list items a different value breaks
the run; the same value written again and again does not.

It acts only on constrained output (a forced tool call, a response format); free text is left
to the members (their golden outputs stay as they are).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ensemble_core.errors import InvalidOptionError
from ensemble_core.options import check_int, check_number

#: Bytes the rule does not see: JSON whitespace between tokens is the model's choice, and a
#: member pushed off a repeat must not escape it by changing the indentation (seen on the
#: bundled pair: ``"quantity":2`` after ``"quantity": 2``).
JSON_WHITESPACE = b" \t\n\r"


@dataclass(frozen=True)
class LoopPenalty:
    """How hard constrained output is pushed out of a loop (defaults measured on the bundled pair).

    With the defaults a repeat of 24 bytes is free (the keys and indentation between two
    values of consecutive list items, a number's zeros), then the penalty starts at 1 logit
    and doubles every 4 more repeated bytes: 16 logits after 40 bytes, more than the greedy
    margin the bundled members show inside a loop. Units up to 128 bytes (a pretty-printed
    object in a list) are looked for.
    """

    #: Penalty (logits) when the repeat reaches ``allowed`` bytes; 0 turns the rule off.
    multiplier: float = 1.0
    #: Growth factor per ``bytes_per_step`` further repeated bytes.
    base: float = 2.0
    #: Repeated bytes that cost nothing.
    allowed: int = 24
    #: Repeated bytes per growth step (about one token of text).
    bytes_per_step: int = 4
    #: The longest repeated unit looked for, in bytes.
    max_period: int = 128
    #: Trailing bytes examined.
    window: int = 256

    def __post_init__(self) -> None:
        check_number("loop_penalty", self.multiplier, 0, expected="a number >= 0 (0 turns the loop penalty off)")
        check_number("LoopPenalty.base", self.base, 1)
        for name in ("allowed", "bytes_per_step", "max_period", "window"):
            check_int(f"LoopPenalty.{name}", getattr(self, name), 1)
        if self.window < 2 * self.max_period:
            raise InvalidOptionError("LoopPenalty.window", self.window, f"at least 2 * max_period ({2 * self.max_period})")

    @property
    def active(self) -> bool:
        return self.multiplier > 0


def loop_penalties(text: bytes, rule: LoopPenalty) -> dict[int, float]:
    """Penalty (logits) per next byte that would continue a repeat at the end of ``text`` (steps 1-2)."""
    text = text[-2 * rule.window:].translate(None, JSON_WHITESPACE)[-rule.window:]
    if not rule.active or len(text) <= rule.allowed:
        return {}
    a = np.frombuffer(text, dtype=np.uint8)
    n = len(a)
    out: dict[int, float] = {}
    for p in range(1, min(rule.max_period, n // 2) + 1):
        same = a[p:] == a[:-p]
        if not same[-1]:
            continue
        breaks = np.flatnonzero(~same)
        run = len(same) - (int(breaks[-1]) + 1 if len(breaks) else 0)
        if run < rule.allowed:
            continue
        byte = int(a[n - p])
        penalty = rule.multiplier * rule.base ** ((run - rule.allowed) / rule.bytes_per_step)
        out[byte] = max(out.get(byte, 0.0), penalty)
    return out


def first_visible_bytes(keys: Sequence[bytes | None]) -> torch.Tensor:
    """Int16 ``[len(keys)]``: each token's first byte after JSON whitespace, -1 for none (EOS, whitespace).

    ``keys`` are the token texts of a member's vocabulary
    (:func:`ensemble_core.text.distributions.token_table`, already built for the fusion).
    """
    visible = [k.lstrip(JSON_WHITESPACE) if k else b"" for k in keys]
    return torch.tensor([v[0] if v else -1 for v in visible], dtype=torch.int16)


def penalty_vector(penalties: dict[int, float], firsts: torch.Tensor) -> torch.Tensor | None:
    """Float ``[V]``: each token's penalty from its first byte (step 2), or None when nothing is penalized."""
    if not penalties:
        return None
    vec = torch.zeros(firsts.shape[0], dtype=torch.float32)
    for byte, value in penalties.items():
        vec.masked_fill_(firsts == byte, value)
    return vec


def text_factors(penalties: dict[int, float], texts: list[bytes | None]) -> torch.Tensor:
    """``exp(-penalty)`` per candidate text (None: the end of the text, never penalized).

    For a choice among fused text candidates (an ensemble point), where no member's token
    space applies: a candidate whose first non-whitespace byte is penalized is down-weighted
    as a token starting with it would be.
    """
    firsts = [(t or b"").lstrip(JSON_WHITESPACE)[:1] for t in texts]
    return torch.tensor([math.exp(-penalties.get(f[0], 0.0)) if f else 1.0 for f in firsts])
