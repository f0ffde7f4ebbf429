"""Probability rows and fused decoding operations, wherever the decoding state lives.

The methods read a member's next-token distributions in a few fixed ways: the
probability of one token (the drafted one, the verifier's next one), the mass of the
EOS tokens, the argmax, and now and then a whole row (to fuse distributions at an
ensemble point). :class:`TensorRows` answers these from tensors in this process. A member
whose model runs elsewhere (:mod:`ensemble_core.remote`, a Ray actor) answers the
frequent questions from a small summary computed next to the model and ships a whole row
only when one is asked for: a row of Gemma-3's 262k vocabulary is 1 MiB of float32, the
summary a few bytes per position.

For the same reason the loops that feed the model token by token (SAFE's draft, a
SpecEM segment, verify-in-line's packed pass) are *operations on a state*: module
functions that take the state first, run here for a local
:class:`~ensemble_core.decoding.members.DecodeState`, and are handed to the state itself when it
offers a method of the same name (:func:`delegate`), which runs the very same function
where the cache lives. The methods never ask which kind of state they hold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


def delegate(state: Any, operation: str) -> Callable[..., Any] | None:
    """``state``'s own implementation of ``operation`` (a remote state runs it by its model), or None.

    A local :class:`~ensemble_core.decoding.members.DecodeState` has none: the caller then runs the
    operation here, on the state's cache.
    """
    return getattr(state, operation, None)


class TensorRows:
    """Probability rows held in this process: a ``[n, V]`` tensor or a list of ``[V]`` tensors.

    Every accessor is the expression the methods used on the tensors directly, so local
    results are unchanged bit for bit.
    """

    def __init__(self, rows: torch.Tensor | Sequence[torch.Tensor]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def prob(self, r: int, token: int) -> float:
        """Probability of ``token`` in row ``r``."""
        return float(self.rows[r][token])

    def mass(self, r: int, ids: torch.Tensor) -> float:
        """Total probability of ``ids`` (an index tensor, e.g. the member's EOS ids) in row ``r``."""
        return float(self.rows[r][ids].sum())

    def row(self, r: int) -> torch.Tensor:
        """The whole row ``r``."""
        return self.rows[r]

    def argmax(self) -> list[int]:
        """The most likely token of every row."""
        rows = self.rows if isinstance(self.rows, torch.Tensor) else torch.stack(list(self.rows))
        return rows.argmax(dim=-1).tolist()


def next_row(state: Any, new_ids: Sequence[int] = ()) -> torch.Tensor:
    """Next-token logits after appending ``new_ids`` (``state.score(new_ids)[-1]``, one row shipped remotely)."""
    own = delegate(state, "next_row")
    if own is not None:
        return own(new_ids)
    return state.score(new_ids)[-1]


def window_probs(state: Any, new_ids: Sequence[int], skip: int) -> Any:
    """Feed ``new_ids`` and return the softmax rows from row ``skip`` on (SAFE's verification window)."""
    own = delegate(state, "window_probs")
    if own is not None:
        return own(new_ids, skip)
    rows = state.score(new_ids)[skip:]
    return TensorRows(torch.softmax(rows.float(), dim=-1))
