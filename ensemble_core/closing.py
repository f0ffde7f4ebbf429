"""Closing pressure: constrained output near the end of its token budget is pushed to close.

Why: a grammar keeps every reply valid *while it is written*, but a reply the token budget
cuts is not valid JSON, and on the bundled pair that was every remaining parse failure of a
forced call or a schema (docs/agents.md): members that keep adding *new* list items or
keep writing a string. The loop penalty (:mod:`ensemble_core.repetition`) cannot see those
(nothing repeats), and the grammar cannot know that a list is long enough.

The rule: when ``left`` tokens of the budget remain and ``left <= margin``, every token
whose first visible byte closes something (``"`` ends a string, ``]`` a list, ``}`` an
object) gains ``2 ** ((margin - left) / 3)`` logits: 1 at the margin, 16 twelve tokens
later, 256 at the end. The grammar still decides what is legal (a ``}`` before the
required keys stays masked), so a boosted close is always a valid one, and the reply ends
inside the budget when the members can close it in the remaining tokens. The
pressure is a bonus, i.e. a negative entry in the per-byte penalties that the loop penalty
uses, so every member applies it in its own token space and SAFE's ensemble points apply it
to the fused candidates by their text, exactly as for the loop penalty.

``left`` counts the primary member's tokens (what ``max_new_tokens`` counts); other members
see the same number. Free text is never pushed: the rule acts only under a grammar.
"""

from __future__ import annotations

from .errors import InvalidOptionError

#: Bytes that close a JSON string, array or object.
CLOSERS = b'"]}'
#: Default margin: the pressure starts this many tokens before the budget ends.
DEFAULT_MARGIN = 24
#: Tokens per doubling of the bonus.
TOKENS_PER_STEP = 3


def check_margin(margin: object) -> int:
    """``close_margin`` as given, or a typed error (an integer >= 0; 0 turns the pressure off)."""
    if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
        raise InvalidOptionError("close_margin", margin, "an integer >= 0 (tokens before the budget's end where "
                                 "constrained output is pushed to close; 0 turns it off)")
    return margin


def closing_bonus(left: int | None, margin: int) -> float:
    """Logits added to closing tokens with ``left`` budget tokens remaining (0.0 outside the margin)."""
    if left is None or margin <= 0 or left > margin:
        return 0.0
    return 2.0 ** ((margin - max(left, 0)) / TOKENS_PER_STEP)


def closing_penalties(left: int | None, margin: int) -> dict[int, float]:
    """Per-byte penalties (negative: a bonus) for the closing bytes, in the loop penalty's form."""
    bonus = closing_bonus(left, margin)
    return {byte: -bonus for byte in CLOSERS} if bonus else {}


def merge_penalties(a: dict[int, float], b: dict[int, float]) -> dict[int, float]:
    """Per-byte penalties of two rules, summed byte by byte."""
    out = dict(a)
    for byte, value in b.items():
        out[byte] = out.get(byte, 0.0) + value
    return out
