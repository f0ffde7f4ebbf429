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

from ensemble_core.transfer import HOST, read_together, to_device


def delegate(state: Any, operation: str) -> Callable[..., Any] | None:
    """``state``'s own implementation of ``operation`` (a remote state runs it by its model), or None.

    A local :class:`~ensemble_core.decoding.members.DecodeState` has none: the caller then runs the
    operation here, on the state's cache.
    """
    return getattr(state, operation, None)


class TensorRows:
    """Probability rows held in this process: a ``[n, V]`` tensor or a list of ``[V]`` tensors.

    Every accessor is the expression the methods used on the tensors directly, so local
    results are unchanged bit for bit. After :meth:`read_ahead` the frequent questions (a
    target token's probability, the EOS mass, the argmax) are answered from values read in
    one transfer, as :class:`~ensemble_core.remote.member.RemoteRows` answers them from its
    actor's summary.
    """

    def __init__(self, rows: torch.Tensor | Sequence[torch.Tensor]) -> None:
        self.rows = rows
        self.targets: list[int] = []  # what :meth:`read_ahead` read the probabilities of
        self.known: dict[tuple[int, int], float] = {}
        self.masses: dict[int, float] = {}
        self._eos: torch.Tensor | None = None
        self._argmax: list[int] | None = None

    def __len__(self) -> int:
        return len(self.rows)

    def _stacked(self) -> torch.Tensor:
        return self.rows if isinstance(self.rows, torch.Tensor) else torch.stack(list(self.rows))

    def read_ahead(self, targets: Sequence[int] | torch.Tensor, eos: torch.Tensor, argmax: bool = True) -> TensorRows:
        """Read, in one transfer, what a round asks of these rows: the probability of ``targets[r]`` in row
        ``r`` (the drafted token, the verifier's next token), every row's mass of the ``eos`` ids and,
        with ``argmax``, every row's most likely token. ``targets`` may be a tensor the host has not read
        yet (a draft's ids, kept on the device): they are read in the same transfer (:attr:`targets`).
        Returns ``self``.

        Why (#38): SAFE's scan asked these per point and per verifier, each a read that waits for
        the device (measured on the bundled Qwen + SmolLM2 pair: 2.0 of SAFE's 5.8 reads per output
        token); now a round reads each member's rows once.
        """
        n = len(self.rows)
        if n == 0:
            return self
        rows = self._stacked()
        unread = isinstance(targets, torch.Tensor)
        k = min(len(targets), n)
        host = [] if unread else [int(t) for t in targets[:k]]
        at = targets.reshape(-1)[:k].to(rows.device) if unread else to_device(host, rows.device)  # type: ignore[union-attr]
        parts = [rows[torch.arange(k, device=rows.device), at], rows[:, to_device(eos, rows.device)].sum(dim=-1)]
        if argmax:
            parts.append(rows.argmax(dim=-1))
        if unread:
            parts.append(at)
        values = read_together(parts)
        self.targets = values[-1] if unread else host
        self.known = {(r, t): p for r, (t, p) in enumerate(zip(self.targets, values[0]))}
        self.masses, self._eos = dict(enumerate(values[1])), eos
        if argmax:
            self._argmax = values[2]
        return self

    def head(self, n: int) -> TensorRows:
        """The first ``n`` rows, with what was read ahead of them (a draft cut behind its end of text)."""
        out = TensorRows(self.rows[:n])
        out.targets = self.targets[:n]
        out.known = {key: p for key, p in self.known.items() if key[0] < n}
        out.masses = {r: m for r, m in self.masses.items() if r < n}
        out._eos = self._eos
        out._argmax = self._argmax[:n] if self._argmax is not None else None
        return out

    def prob(self, r: int, token: int) -> float:
        """Probability of ``token`` in row ``r``."""
        hit = self.known.get((r, int(token)))
        return hit if hit is not None else float(self.rows[r][token])

    def mass(self, r: int, ids: torch.Tensor) -> float:
        """Total probability of ``ids`` (an index tensor, e.g. the member's EOS ids) in row ``r``."""
        known = self._eos
        if r in self.masses and known is not None and (ids is known or (  # compared on the host: no read
                ids.device == known.device == HOST and torch.equal(ids, known))):
            return self.masses[r]
        return float(self.rows[r][ids].sum())

    def row(self, r: int) -> torch.Tensor:
        """The whole row ``r``."""
        return self.rows[r]

    def argmax(self) -> list[int]:
        """The most likely token of every row."""
        if self._argmax is None:
            self._argmax = self._stacked().argmax(dim=-1).tolist()
        return self._argmax


def next_row(state: Any, new_ids: Sequence[int] = ()) -> torch.Tensor:
    """Next-token logits after appending ``new_ids`` (``state.score(new_ids)[-1]``, one row shipped remotely)."""
    own = delegate(state, "next_row")
    if own is not None:
        return own(new_ids)
    return state.last_row(new_ids)


def window_probs(state: Any, new_ids: Sequence[int], skip: int) -> Any:
    """Feed ``new_ids`` and return the softmax rows from row ``skip`` on (SAFE's verification window), with
    what the scan asks of them read ahead in one transfer (:meth:`TensorRows.read_ahead`)."""
    own = delegate(state, "window_probs")
    if own is not None:
        return own(new_ids, skip)
    rows = state.score(new_ids)[skip:]
    targets = [int(t) for t in new_ids[skip:]]  # row r predicts new_ids[skip + r]
    return TensorRows(torch.softmax(rows.float(), dim=-1)).read_ahead(targets, state.member.eos_id_tensor)
