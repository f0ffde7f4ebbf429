"""The client side of a Ray member: a :class:`Member` whose model runs in an actor.

:class:`RemoteMember` is a :class:`~ensemble_core.decoding.members.Member` with the tokenizer here
and the model in a :class:`~ensemble_core.remote.actor.MemberActor`: rendering the chat,
tokenizing, aligning texts, fusion tables and grammars stay local and unchanged.
:class:`RemoteDecodeState` is a :class:`~ensemble_core.decoding.members.DecodeState` by duck
typing: it mirrors the state's ids here (so the methods read ``ids``, ``prompt_len`` and
``stats`` as usual), queues ``crop`` / ``extend`` until the next call (they need no
model), and offers the fused operations of :mod:`ensemble_core.decoding.rows` (``draft_tokens``,
``window_probs``, ``draft_segment``, ``score_candidates_inline``, ``next_row``), each one
actor call. :class:`RemoteRows` answers the methods' questions about probability rows
from the summary the actor sent and fetches a whole row only when one is asked for.
"""

from __future__ import annotations

import itertools
import os
import threading
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ensemble_core.decoding.generation import GenerationConfig
from ensemble_core.decoding.members import DecodeStats, Member
from ensemble_core.errors import ConfigurationError, EnsembleError, InputError
from ensemble_core.models.loading import MemberSpec
from ensemble_core.remote.actor import generator_state
from ensemble_core.remote.cluster import Placed, acquire, release
from ensemble_core.remote.options import RayMemberSpec, RayOptions
from ensemble_core.text.chat import FALLBACK_STOPS

_STATE_IDS = itertools.count(1)
_TOKENIZERS: dict[tuple[str, bool], Any] = {}
_TOKENIZER_LOCK = threading.Lock()


def local_tokenizer(spec: MemberSpec) -> Any:
    """The member's tokenizer, loaded here the way a local member loads it (cached per process)."""
    from transformers import AutoTokenizer

    from ensemble_core.models.loading import _resolve_source, hub_reachable

    key = (str(spec.source), spec.trust_remote_code)
    with _TOKENIZER_LOCK:
        if key not in _TOKENIZERS:
            target, _, _ = _resolve_source(str(spec.source))
            offline = isinstance(target, Path) or os.environ.get("HF_HUB_OFFLINE") == "1" or not hub_reachable()
            _TOKENIZERS[key] = AutoTokenizer.from_pretrained(
                target, local_files_only=offline, trust_remote_code=spec.trust_remote_code
            )
        return _TOKENIZERS[key]


class _RemoteModel:
    """What the methods read off a member's model (its config), without the weights."""

    def __init__(self, config: Any, device: str, dtype: str) -> None:
        self.config, self.device_name, self.dtype_name = config, device, dtype


class RemoteMember(Member):
    """A member whose model runs in a Ray actor (see the module docstring)."""

    def __init__(
        self,
        placed: Placed,
        tokenizer: Any,
        name: str | None = None,
        chat_template: str | None = None,
        stop_strings: Sequence[str] | None = None,
    ) -> None:
        info = placed.info
        self.placed, self.link = placed, placed.link
        self.model = _RemoteModel(info["config"], info["device"], info["dtype"])
        self.tokenizer = tokenizer
        self.name = name or info["name"]
        self.chat_template = chat_template
        has_template = bool(chat_template or getattr(tokenizer, "chat_template", None))
        self.stop_strings = tuple(stop_strings) if stop_strings is not None else (() if has_template else FALLBACK_STOPS)
        self.eos_token_ids = frozenset(int(i) for i in info["eos_token_ids"])
        self.vocab_size = int(info["vocab_size"])
        self._window = int(info["context_window"])
        self._released = False

    @classmethod
    def load(cls, source: Any, options: RayOptions | dict | None = None, **member_options: Any) -> RemoteMember:  # type: ignore[override]
        """Place (or share) the actor for ``source`` and load its tokenizer here.

        ``source``: a :class:`RayMemberSpec`, or anything it accepts as ``member`` (then
        placed with ``options``' default resources).
        """
        placement = source if isinstance(source, RayMemberSpec) else RayMemberSpec(source)
        options = RayOptions.of(options)
        placed = acquire(placement, options, member_options)
        try:
            try:
                tokenizer = local_tokenizer(placed.spec)
            except (EnsembleError, OSError, ValueError):  # no copy of the files here: take the actor's
                tokenizer = placed.link.wait(placed.link.submit("tokenizer", what="its tokenizer"), "its tokenizer")
            spec = placed.spec
            name = spec.name or (placed.info["name"])
            return cls(placed, tokenizer, name=name, chat_template=spec.chat_template)
        except BaseException:
            release(placed.link)
            raise

    # ---------------------------------------------------------------- properties
    @property
    def device(self) -> str:  # type: ignore[override]
        """Where the model runs: ``ray:<node>/<device>`` (distinct per actor, so methods run members in threads)."""
        return f"ray:{self.link.node}/{self.model.device_name}/{id(self.link):x}"

    @property
    def context_window(self) -> int:
        return self._window

    def __repr__(self) -> str:
        return f"RemoteMember({self.name!r}, node={self.link.node}, device={self.model.device_name}, vocab={self.vocab_size})"

    # ---------------------------------------------------------------- decoding
    def start_from_ids(self, ids: Sequence[int]) -> RemoteDecodeState:
        self._check_live()
        if len(ids) == 0:
            raise InputError(f"Member {self.name!r} needs at least one prompt token to start decoding.")
        return RemoteDecodeState(self, list(ids))

    def _check_live(self) -> None:
        if self._released:
            raise ConfigurationError(
                f"Member {self.name!r} was released (Ensemble.close() / release()); its actor may be gone. "
                "Build a new Ensemble to use it again."
            )

    # ---------------------------------------------------------------- the actor
    def held_states(self) -> int:
        """Request states the actor holds (after every state freed here has reached it)."""
        return self.link.held()

    def actor_rss(self) -> int:
        """Resident memory of the actor's process, in bytes."""
        return self.link.rss()

    def release(self) -> None:
        """Give this member's share of its actor back (the last user's release kills the actor)."""
        if not self._released:
            self._released = True
            release(self.link)


def _tensor(array: Any) -> torch.Tensor:
    """A tensor of an answer's array; a read-only one (zero-copy from Ray's object store) is copied, which
    also unpins it from the store."""
    array = np.asarray(array)
    return torch.from_numpy(array if array.flags.writeable else array.copy())


def _sampling(config: GenerationConfig) -> tuple[bool, float, float]:
    return (bool(config.do_sample), float(config.temperature), float(config.top_p))


class RemoteDecodeState:
    """A :class:`~ensemble_core.decoding.members.DecodeState` whose cache lives in the member's actor.

    ``ids`` mirrors the actor's ids exactly: every operation changes both the same way.
    ``close()`` (or dropping the object) frees the actor's state.
    """

    def __init__(self, member: RemoteMember, prompt_ids: list[int]) -> None:
        self.member = member
        self.ids: list[int] = [int(i) for i in prompt_ids]
        self.prompt_len = len(self.ids)
        self.stats = DecodeStats()
        self.sid = next(_STATE_IDS)
        self._changes: list[tuple[str, Any]] = [("start", list(self.ids))]
        self._close = weakref.finalize(self, member.link.forget, self.sid)

    @property
    def response_ids(self) -> list[int]:
        return self.ids[self.prompt_len :]

    def __len__(self) -> int:
        return len(self.ids)

    def close(self) -> None:
        """Free the actor's state now (idempotent; also done when this object is dropped)."""
        self._close()

    # ---------------------------------------------------------------- bookkeeping (no round trip)
    def crop(self, n: int) -> None:
        """Keep the first ``n`` ids (``DecodeState.crop``; sent with the next call)."""
        if n < 1 or n > len(self.ids):
            raise InputError(f"Cannot crop member {self.member.name!r} to {n} tokens (has {len(self.ids)}).")
        del self.ids[n:]
        self._changes.append(("crop", n))

    def extend(self, new_ids: Sequence[int]) -> None:
        """Append ids without running the model (``DecodeState.extend``; sent with the next call)."""
        ids = [int(i) for i in new_ids]
        self.ids.extend(ids)
        if self._changes and self._changes[-1][0] == "extend":
            self._changes[-1] = ("extend", self._changes[-1][1] + ids)
        elif ids:
            self._changes.append(("extend", ids))

    def _call(self, op: str, *args: Any) -> Any:
        changes, self._changes = self._changes, []  # applied by the actor before the operation, even if it fails
        answer, stats = self.member.link.call(self.sid, changes, op, args)
        self.stats = DecodeStats(*stats)
        return answer

    # ---------------------------------------------------------------- operations (one call each)
    #: ``DecodeState.chosen``: never read here (the actor's passes are its own), so the caller chooses
    chosen: int | None = None

    def score(self, new_ids: Sequence[int] = (), greedy: bool = False) -> torch.Tensor:
        """``DecodeState.score``: every row, shipped (prefer the fused operations)."""
        ids = [int(i) for i in new_ids]
        rows = self._call("score", ids)
        self.ids.extend(ids)
        return _tensor(rows)

    def next_row(self, new_ids: Sequence[int] = ()) -> torch.Tensor:
        ids = [int(i) for i in new_ids]
        row = self._call("next_row", ids)
        self.ids.extend(ids)
        return _tensor(row)

    def draft_tokens(
        self, limit: int, budget: int, config: GenerationConfig, generator: torch.Generator | None,
        confidence: float = 0.0, lookup: int = 0,
    ) -> tuple[list[int], RemoteRows]:
        """:func:`ensemble_core.decoding.drafting.draft_tokens` in the actor: ids, their probabilities, the rows kept there."""
        ids, probs, masses, version, gen = self._call(
            "draft_tokens", limit, budget, _sampling(config), generator_state(generator), confidence, lookup
        )
        if generator is not None:
            generator.set_state(torch.frombuffer(bytearray(gen), dtype=torch.uint8))
        self.ids.extend(ids[:-1])  # the last drafted token is not fed
        known = {(j, t): p for j, (t, p) in enumerate(zip(ids, probs))}
        return ids, RemoteRows(self, "draft", version, len(ids), known, masses)

    def window_probs(self, new_ids: Sequence[int], skip: int) -> RemoteRows:
        """:func:`ensemble_core.decoding.rows.window_probs` in the actor (SAFE's verification window)."""
        ids = [int(i) for i in new_ids]
        argmax, probs, masses, version = self._call("window_probs", ids, skip)
        self.ids.extend(ids)
        known = {(r, t): p for r, (t, p) in enumerate(zip(ids[skip:], probs))}
        return RemoteRows(self, "window", version, len(argmax), known, dict(enumerate(masses)), argmax)

    def draft_segment(
        self,
        length: int,
        config: GenerationConfig,
        generator: torch.Generator | None,
        stops: Sequence[str],
        tail: str,
        grammar: Any = None,
        lookup: int = 0,
    ) -> tuple[list[int], str | None, str, Any]:
        """:func:`ensemble_core.decoding.drafting.draft_segment` in the actor (a SpecEM segment, on a cache branch)."""
        if grammar is not None:
            raise ConfigurationError(
                f"Member {self.member.name!r} runs on Ray, and a constrained segment (tools / response_format) is "
                "drafted under a grammar that lives in this process, token by token on a cache branch of the member. "
                "Use SAFE or every-token for constrained output with Ray members, or local members for SpecEM."
            )
        ids, end, text, gen, scores = self._call(
            "draft_segment", length, _sampling(config), generator_state(generator), list(stops), tail, lookup
        )
        if generator is not None:
            generator.set_state(torch.frombuffer(bytearray(gen), dtype=torch.uint8))
        return ids, end, text, scores

    def score_candidates_inline(
        self, candidates: Sequence[Sequence[int]], kind: str = "logprob", terminal: Sequence[bool] | None = None
    ) -> list[torch.Tensor]:
        """:func:`ensemble_core.decoding.verify_inline.score_candidates_inline` in the actor: per-token scores only."""
        packed = [[int(t) for t in c] for c in candidates]
        values = self._call("score_candidates_inline", packed, kind, None if terminal is None else [bool(t) for t in terminal])
        return [_tensor(v) for v in values]

    def rows(self, kind: str, version: int, index: Sequence[int]) -> torch.Tensor:
        """Whole probability rows the actor kept from an operation (float32, as computed there)."""
        return _tensor(self._call("rows", kind, version, list(index)))


class RemoteRows:
    """Probability rows kept in a member's actor (the :class:`~ensemble_core.decoding.rows.TensorRows` interface).

    ``known[(r, token)]`` and ``masses[r]`` (the EOS mass) are what the actor sent along;
    anything else fetches row ``r`` once (float32, exactly the actor's values) and answers
    from it with the same expressions as :class:`TensorRows`.
    """

    def __init__(
        self,
        state: RemoteDecodeState,
        kind: str,
        version: int,
        n: int,
        known: dict[tuple[int, int], float],
        masses: dict[int, float],
        argmax: list[int] | None = None,
    ) -> None:
        self.state, self.kind, self.version, self.n = state, kind, version, n
        self.known, self.masses, self._argmax = known, masses, argmax
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.n

    def row(self, r: int) -> torch.Tensor:
        if r < 0:
            r += self.n
        if r not in self._rows:
            self._rows[r] = self.state.rows(self.kind, self.version, [r])[0]
        return self._rows[r]

    def prob(self, r: int, token: int) -> float:
        hit = self.known.get((r, int(token)))
        return hit if hit is not None else float(self.row(r)[token])

    def mass(self, r: int, ids: torch.Tensor) -> float:
        if r in self.masses and torch.equal(ids.cpu(), self.state.member.eos_id_tensor):
            return self.masses[r]
        return float(self.row(r)[ids].sum())

    def argmax(self) -> list[int]:
        if self._argmax is None:
            self._argmax = [int(self.row(r).argmax()) for r in range(self.n)]
        return self._argmax
