"""The single-model baseline: one member decoding alone through the member API.

The reference every ensemble is compared with; its greedy tokens equal ``model.generate``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from ensemble_core.decoding.generation import Chunk, EnsembleMethod, GenerationConfig
from ensemble_core.decoding.rows import next_row
from ensemble_core.decoding.stats import MemberStats, RequestStats
from ensemble_core.decoding.view import MemberView, start_views
from ensemble_core.text.alignment import IncrementalDecoder
from ensemble_core.text.chat import Prompt


@dataclass
class _SingleRequest:
    views: list[MemberView]
    config: GenerationConfig
    decoder: IncrementalDecoder
    rounds: int = 0


class SingleModel(EnsembleMethod[GenerationConfig]):
    """The first member alone, one token per round, through its KV cache."""

    name = "single"
    config_class = GenerationConfig
    min_members = 1

    def begin(self, prompt: Prompt, config: GenerationConfig) -> _SingleRequest:
        member = self.members[0]
        return _SingleRequest(start_views([member], prompt, config), config, IncrementalDecoder(member.tokenizer))

    def step(self, request: _SingleRequest) -> Chunk:
        view = request.views[0]
        state, member = view.state, view.member
        token, _ = view.pipeline.next_token(next_row(state))
        request.rounds += 1
        if token in member.eos_token_ids:
            return Chunk("", done=True, finish_reason="eos")
        view.pipeline.accept(token)
        state.extend([token])
        delta = request.decoder.push([token])  # a token ending inside a character adds nothing yet
        if len(state.response_ids) >= request.config.max_new_tokens:
            return Chunk(delta + request.decoder.flush(), done=True, finish_reason="length")
        return Chunk(delta)

    def stats(self, request: _SingleRequest) -> RequestStats:
        state = request.views[0].state
        return RequestStats(self.name, len(state.response_ids), request.rounds, [MemberStats.of(state, "member")])
