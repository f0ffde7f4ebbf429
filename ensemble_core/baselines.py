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
