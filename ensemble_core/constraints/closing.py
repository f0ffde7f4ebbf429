"""Closing pressure: constrained output near the end of its token budget is pushed to close.

Why: a grammar keeps every reply valid *while it is written*, but a reply the token budget
cuts is not valid JSON, and on the bundled pair that was every remaining parse failure of a
forced call or a schema (docs/agents.md): members that keep adding *new* list items or
keep writing a string. The loop penalty (:mod:`ensemble_core.constraints.repetition`) cannot see those
(nothing repeats), and the grammar cannot know that a list is long enough.

The rule: when ``left`` tokens of the budget remain and ``left <= margin``, every token
that only closes (inside a string: ``"``, ``"]``, ``"}``, ...; outside: ``]``, ``}``, ``]}``,
..., JSON whitespace aside; :func:`closes_only`) gains ``2 ** ((margin - left) /
3)`` logits: 1 at the margin, 16 twelve tokens later, 256 twenty-four tokens later. The
margin is a quarter of the budget, at least 24 tokens (:func:`resolve_margin`). A token that closes
and goes on (``",``, ``", "``: close a string, then start the next item) gains nothing:
those are how a list keeps growing (seen on the bundled pair with a first-byte rule:
``"11 5555-010", "", "", …`` to the cut). The grammar still decides what is legal (a
``}`` before the required keys stays masked), so a boosted close is always a valid one, and
the reply ends inside the budget when the members can close it in the remaining tokens.
Whitespace-only tokens lose the same amount: JSON allows up to 20 characters of whitespace
between tokens, and a member whose next byte is forced but penalized by the loop penalty
(the ``:`` after a key it repeats) otherwise spends the rest of the budget on newlines
(seen on the bundled pair: ``"unit"\n    \n      : ``). Each member applies this in its
own token space (:func:`closing_signs` of its vocabulary), and SAFE's ensemble points to
the fused candidates by their text (:func:`closing_factors`), as for the loop penalty.

``left`` counts the primary member's tokens (what ``max_new_tokens`` counts); other members
see the same number. Free text is never pushed: the rule acts only under a grammar.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ensemble_core.constraints.repetition import JSON_WHITESPACE
from ensemble_core.options import check_int

#: Bytes that close a JSON array or object (outside a string); a quote closes a string.
STRUCTURE_CLOSERS = b"]}"
#: The automatic margin (``close_margin=None``): a quarter of the budget, at least this many tokens.
MIN_MARGIN = 24
#: The automatic margin's share of the budget.
BUDGET_SHARE = 4
#: Tokens per doubling of the bonus.
TOKENS_PER_STEP = 3


def check_margin(margin: object) -> int | None:
    """``close_margin`` as given, or a typed error (None: automatic; an integer >= 0; 0 turns it off)."""
    return check_int("close_margin", margin, 0, optional=True, expected=(
        "None (a quarter of the budget, at least 24 tokens) or an integer >= 0 (tokens before the budget's end "
        "where constrained output is pushed to close; 0 turns it off)"))


def resolve_margin(margin: int | None, max_new_tokens: int) -> int:
    """The margin in tokens: ``margin`` itself, or for None ``max(24, max_new_tokens // 4)``.

    Measured on the bundled pair at a 160-token budget (docs/agents.md): 24 tokens let 13 of
    the 18 replies that the budget used to cut finish (SAFE), 40 tokens (a quarter) the rest:
    nested objects in a list still have keys to write after the list closes.
    """
    return max(MIN_MARGIN, max_new_tokens // BUDGET_SHARE) if margin is None else margin


def closing_bonus(left: int | None, margin: int) -> float:
    """Logits added to tokens that only close, ``left`` budget tokens before the end (0.0 outside the margin)."""
    if left is None or margin <= 0 or left > margin:
        return 0.0
    return 2.0 ** ((margin - max(left, 0)) / TOKENS_PER_STEP)


def in_string(text: bytes) -> bool:
    """Whether JSON ``text`` ends inside a string (an odd number of unescaped quotes)."""
    inside = escaped = False
    for byte in text:
        if not inside:
            inside = byte == 0x22
        elif escaped:
            escaped = False
        elif byte == 0x5C:
            escaped = True
        elif byte == 0x22:
            inside = False
    return inside


def closes_only(text: bytes | None, inside: bool = False) -> bool:
    """Whether ``text`` only closes, where the output is ``inside`` a string or not.

    Inside a string only a quote closes (``]`` and ``}`` are ordinary characters there), so
    the text must start with ``"`` and go on with ``]`` / ``}`` / whitespace only (``"``,
    ``"]``, ``"}``); outside, it is made of ``]`` / ``}`` and whitespace (a ``"`` there
    would open a string).
    """
    if not text:
        return False
    if inside:
        if text[:1] != b'"':
            return False
        text = text[1:]
        if not text:
            return True
    visible = text.translate(None, JSON_WHITESPACE)
    return bool(visible) and not visible.translate(None, STRUCTURE_CLOSERS)


def is_blank(text: bytes | None) -> bool:
    """Whether ``text`` is JSON whitespace only (and not empty)."""
    return bool(text) and not text.translate(None, JSON_WHITESPACE)  # type: ignore[union-attr]


def closing_signs(keys: Sequence[bytes | None], inside: bool) -> torch.Tensor:
    """Int8 ``[len(keys)]``: +1 for tokens that only close (:func:`closes_only`), -1 for blank ones, 0 else."""
    return torch.tensor([1 if closes_only(k, inside) else -1 if is_blank(k) else 0 for k in keys], dtype=torch.int8)


def closing_factors(bonus: float, texts: Sequence[bytes | None], inside: bool) -> torch.Tensor:
    """Per candidate text: ``exp(bonus)`` when it only closes, ``exp(-bonus)`` when blank, 1 otherwise
    (None: the end of the text)."""
    return torch.tensor([math.exp(bonus) if closes_only(t, inside) else math.exp(-bonus) if is_blank(t) else 1.0
                         for t in texts])
