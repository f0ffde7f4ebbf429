"""The model side of a Ray member: one process holding one model and the decoding states it serves.

:class:`MemberActor` is a plain class (Ray wraps it with ``ray.remote`` when a member is
placed, so this module imports without Ray). It loads its member exactly as a local one
(:meth:`Member.load`: alias, path, GGUF or hub id) and keeps one real
:class:`~ensemble_core.decoding.members.DecodeState` per request state id. Every call carries the
state's pending bookkeeping (``start`` / ``crop`` / ``extend``, which need no model and
so never cost a round trip of their own) and one *operation*: the same module functions
the methods run on a local state (:func:`~ensemble_core.decoding.drafting.draft_tokens`,
:func:`~ensemble_core.decoding.drafting.draft_segment`,
:func:`~ensemble_core.decoding.rows.window_probs`,
:func:`~ensemble_core.decoding.verify_inline.score_candidates_inline`), so results are those of a
local member. What goes back is only what the methods read: drafted ids, a few
probabilities, argmaxes, scores; whole probability rows stay here until one is asked
for (:meth:`MemberActor._op_rows`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import astuple
from typing import Any

import numpy as np
import torch

from ensemble_core.decoding.drafting import draft_segment, draft_tokens
from ensemble_core.decoding.generation import GenerationConfig
from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.decoding.pipeline import TokenPipeline
from ensemble_core.decoding.rows import TensorRows, next_row, window_probs
from ensemble_core.decoding.verify_inline import score_candidates_inline
from ensemble_core.errors import InputError, StateLostError
from ensemble_core.models.loading import MemberSpec

#: A change of a state's ids that needs no model: applied in order before the call's operation.
Change = tuple[str, Any]


def sampling_config(do_sample: bool, temperature: float, top_p: float) -> GenerationConfig:
    """The part of a request's config that choosing a token reads (all that crosses the wire)."""
    return GenerationConfig(do_sample=do_sample, temperature=temperature, top_p=top_p)


def restore_generator(state: bytes | None) -> torch.Generator | None:
    """A CPU generator at the caller's position (sampling draws the same numbers on both sides)."""
    if state is None:
        return None
    generator = torch.Generator()
    generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
    return generator


def generator_state(generator: torch.Generator | None) -> bytes | None:
    return None if generator is None else generator.get_state().numpy().tobytes()


def resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc``; peak RSS elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


class MemberActor:
    """One member's model and the decoding states of the requests it serves (see the module docstring)."""

    def __init__(self, spec: MemberSpec, torch_threads: int | None = None) -> None:
        if torch_threads:
            torch.set_num_threads(torch_threads)
        self.member = Member.load(spec)
        self.states: dict[int, DecodeState] = {}
        #: Rows an answer summarised, per state and kind ("draft" / "window"): (version, rows).
        self.kept: dict[tuple[int, str], tuple[int, TensorRows]] = {}
        self.version = 0

    # ------------------------------------------------------------------ housekeeping
    def info(self) -> dict[str, Any]:
        """What the client-side member needs to stand in for this one (sent once)."""
        m = self.member
        try:
            import ray

            node = ray.get_runtime_context().get_node_id()
        except Exception:  # pragma: no cover - outside Ray
            node = "local"
        return {
            "name": m.name,
            "vocab_size": m.vocab_size,
            "eos_token_ids": sorted(m.eos_token_ids),
            "context_window": m.context_window,
            "config": m.model.config,
            "device": str(m.device),
            "dtype": str(m.model.dtype),
            "node_id": node,
            "host": socket.gethostname(),
            "pid": os.getpid(),
        }

    def tokenizer(self) -> Any:
        """The member's tokenizer, for a client that has no copy of its files."""
        return self.member.tokenizer

    def held(self) -> int:
        """How many request states this actor holds."""
        return len(self.states)

    def free(self, sids: Sequence[int]) -> None:
        """Drop the states ``sids`` and their kept rows (unknown ids are ignored)."""
        for sid in sids:
            self.states.pop(sid, None)
            self.kept.pop((sid, "draft"), None)
            self.kept.pop((sid, "window"), None)

    def rss(self) -> int:
        return resident_bytes()

    def exit(self) -> None:
        """End this process at once, as a crash would (fault drills and tests)."""
        os._exit(1)

    # ------------------------------------------------------------------ calls
    def call(self, sid: int, changes: Sequence[Change], op: str, args: Sequence[Any]) -> tuple[Any, tuple]:
        """Apply ``changes`` to state ``sid``, run operation ``op``; returns ``(answer, state stats)``."""
        state = self._apply(sid, changes)
        answer = getattr(self, "_op_" + op)(sid, state, *args)
        return answer, astuple(state.stats)

    def _apply(self, sid: int, changes: Sequence[Change]) -> DecodeState:
        state = self.states.get(sid)
        for kind, value in changes:
            if kind == "start":
                state = self.states[sid] = self.member.start_from_ids(value)
            elif state is None:
                break
            elif kind == "crop":
                state.crop(value)
            else:
                state.extend(value)
        if state is None:
            raise StateLostError(f"Member {self.member.name!r} holds no decoding state {sid} (its actor was restarted).")
        return state

    def _keep(self, sid: int, kind: str, rows: TensorRows) -> int:
        self.version += 1
        self.kept[(sid, kind)] = (self.version, rows)
        return self.version

    # ------------------------------------------------------------------ operations
    def _op_score(self, sid: int, state: DecodeState, new_ids: list[int]) -> np.ndarray:
        return state.score(new_ids).cpu().numpy()

    def _op_next_row(self, sid: int, state: DecodeState, new_ids: list[int]) -> np.ndarray:
        return next_row(state, new_ids).cpu().numpy()

    def _op_draft_tokens(
        self, sid: int, state: DecodeState, limit: int, budget: int, sampling: tuple, generator: bytes | None,
        confidence: float = 0.0, lookup: int = 0,
    ) -> tuple:
        gen = restore_generator(generator)
        ids, rows = draft_tokens(state, limit, budget, TokenPipeline(sampling_config(*sampling), gen),
                                 confidence=confidence, lookup=lookup)
        eos = self.member.eos_id_tensor
        probs = [rows.prob(j, t) for j, t in enumerate(ids)]
        last = len(ids) - 1
        masses = {last: rows.mass(last, eos)} if ids[last] in self.member.eos_token_ids else {}
        return ids, probs, masses, self._keep(sid, "draft", rows), generator_state(gen)

    def _op_window_probs(self, sid: int, state: DecodeState, new_ids: list[int], skip: int) -> tuple:
        rows = window_probs(state, new_ids, skip)
        eos = self.member.eos_id_tensor
        targets = new_ids[skip:]
        probs = [rows.prob(r, t) for r, t in enumerate(targets)]
        masses = [rows.mass(r, eos) for r in range(len(rows))]
        return rows.argmax(), probs, masses, self._keep(sid, "window", rows)

    def _op_draft_segment(
        self, sid: int, state: DecodeState, length: int, sampling: tuple, generator: bytes | None, stops: Sequence[str],
        tail: str, lookup: int = 0,
    ) -> tuple:
        gen = restore_generator(generator)
        ids, end, text, scores = draft_segment(state, length, TokenPipeline(sampling_config(*sampling), gen), stops,
                                               tail, lookup=lookup)
        return ids, end, text, generator_state(gen), scores

    def _op_score_candidates_inline(
        self, sid: int, state: DecodeState, candidates: list[list[int]], kind: str, terminal: list[bool] | None
    ) -> list[np.ndarray]:
        return [v.cpu().numpy() for v in score_candidates_inline(state, candidates, kind, terminal)]

    def _op_rows(self, sid: int, state: DecodeState, kind: str, version: int, index: Sequence[int]) -> np.ndarray:
        kept = self.kept.get((sid, kind))
        if kept is None or kept[0] != version:
            raise InputError(f"Member {self.member.name!r} no longer holds those {kind} rows (a later call replaced them).")
        rows = kept[1]
        return torch.stack([rows.row(r) for r in index]).cpu().numpy()
