"""Baselines kept in the same harness as the ensemble methods.

* :class:`SingleModel`: one member decoding alone through the member API (the reference
  every ensemble is compared with; its tokens equal ``model.generate``'s).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .alignment import IncrementalDecoder
from .chat import Prompt
from .generation import Chunk, EnsembleMethod, GenerationConfig, choose_token, make_generator
from .members import DecodeState


@dataclass
class _SingleRequest:
    states: list[DecodeState]
    config: GenerationConfig
    generator: torch.Generator | None
    decoder: IncrementalDecoder
    rounds: int = 0


class SingleModel(EnsembleMethod[GenerationConfig]):
    """The first member alone, one token per round, through its KV cache."""

    name = "single"
    config_class = GenerationConfig
    min_members = 1

    def begin(self, prompt: Prompt, config: GenerationConfig) -> _SingleRequest:
        member = self.members[0]
        return _SingleRequest([member.start(prompt, config.max_new_tokens)], config, make_generator(config),
                              IncrementalDecoder(member.tokenizer))

    def step(self, request: _SingleRequest) -> Chunk:
        state = request.states[0]
        member = state.member
        probs = torch.softmax(state.score()[-1], dim=-1)
        token = choose_token(probs, request.config, request.generator)
        request.rounds += 1
        if token in member.eos_token_ids:
            return Chunk("", done=True, finish_reason="eos")
        state.extend([token])
        delta = request.decoder.push([token])  # a token ending inside a character adds nothing yet
        if len(state.response_ids) >= request.config.max_new_tokens:
            return Chunk(delta + request.decoder.flush(), done=True, finish_reason="length")
        return Chunk(delta)

    def stats(self, request: _SingleRequest) -> dict[str, Any]:
        s = request.states[0].stats
        return {"method": self.name, "member": self.members[0].name, "tokens": len(request.states[0].response_ids),
                "forward_passes": s.forward_passes, "seconds": s.seconds}


# --------------------------------------------------------------------------- generate-then-select
# Appended block: its imports live here so that this baseline stays one self-contained edit.
import time  # noqa: E402
from dataclasses import field  # noqa: E402

from .members import Member  # noqa: E402
from .specem import (  # noqa: E402
    Candidate,
    SelectionConfig,
    Track,
    draft,
    finish_text,
    normalize_scores,
    resolve_roles,
    run_all,
    select_candidate,
    start_tracks,
    use_threads,
    verify,
)


@dataclass
class _SelectRequest:
    tracks: list[Track]
    config: SelectionConfig
    drafters: list[int]
    verifiers: list[int]
    stops: tuple[str, ...]
    parallel: bool
    answers: list[Candidate] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)
    chosen: int | None = None
    seconds: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "verify": 0.0})


class GenerateThenSelect(EnsembleMethod[SelectionConfig]):
    """Every member answers in full, the answers are cross-scored, the best one is returned.

    The MBR-like latency baseline SpecEM improves on: answers are drafted like SpecEM
    segments of ``max_new_tokens`` tokens (same EOS / stop-string handling, no word
    trimming), scored by every verifier with the same in-line scorer and normalisation
    as SpecEM (:mod:`ensemble_core.verify_inline`), and combined with uniform weights.
    Nothing is streamed before the whole answer is chosen, so the time to the first chunk
    is the total time.
    """

    name = "generate-then-select"
    config_class = SelectionConfig
    min_members = 2

    def __init__(self, members: list[Member], config: SelectionConfig | None = None, **options: Any) -> None:
        super().__init__(members, config, **options)
        resolve_roles(self.members, self.config)  # fail at construction, not at the first request

    def begin(self, prompt: Prompt, config: SelectionConfig) -> _SelectRequest:
        drafters, verifiers = resolve_roles(self.members, config)
        return _SelectRequest(start_tracks(self.members, prompt, config), config, drafters, verifiers,
                              self.stop_strings(config), use_threads(self.members, config))

    def prompt_tokens(self, request: _SelectRequest) -> int:
        return request.tracks[0].state.prompt_len

    def step(self, request: _SelectRequest) -> Chunk:
        cfg, tracks = request.config, request.tracks
        t0 = time.perf_counter()
        answers = run_all(lambda i: draft(tracks[i], i, cfg.max_new_tokens, cfg, request.stops, "", trim=False),
                          request.drafters, request.parallel)
        t1 = time.perf_counter()
        request.answers, request.seconds["draft"] = answers, t1 - t0
        if all(not a.text and not a.finished for a in answers):
            return Chunk("", done=True, finish_reason="eos")
        raw = run_all(lambda v: verify(tracks[v], "", answers, cfg.scoring)[0], request.verifiers, request.parallel)
        request.scores = [normalize_scores(r, cfg.normalization) for r in raw]
        request.seconds["verify"] = time.perf_counter() - t1
        best, _ = select_candidate([1.0 / len(raw)] * len(raw), request.scores)
        chosen = answers[best]
        request.chosen = chosen.member
        text, cut, _, _ = finish_text(tracks[0], "", chosen.text, cfg.max_new_tokens)
        return Chunk(text, done=True, finish_reason="length" if cut or not chosen.finished else chosen.end)

    def stats(self, request: _SelectRequest) -> dict[str, Any]:
        names = [m.name for m in self.members]
        return {"method": self.name, "members": names, "chosen": request.chosen,
                "answers": [{"member": names[a.member], "tokens": a.tokens, "chars": len(a.text), "end": a.end}
                            for a in request.answers],
                "scores": [[round(s, 6) for s in row] for row in request.scores],
                "verifiers": [names[i] for i in request.verifiers],
                "seconds": {k: round(v, 4) for k, v in request.seconds.items()}}
