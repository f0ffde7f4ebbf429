"""The single-model baseline: one member decoding alone through the member API.

The reference every ensemble is compared with; its greedy tokens equal ``model.generate``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ensemble_core.decoding.drafting import draft_tokens, unread_drafting
from ensemble_core.decoding.generation import Chunk, EnsembleMethod, GenerationConfig
from ensemble_core.decoding.pipeline import TokenPipeline
from ensemble_core.decoding.stats import MemberStats, RequestStats
from ensemble_core.decoding.view import MemberView, start_views
from ensemble_core.options import check_int
from ensemble_core.text.alignment import IncrementalDecoder
from ensemble_core.text.chat import Prompt

#: The most steps a request queues before a read (a reply's bursts stay short; the steps past its end, few).
MAX_STEPS_PER_READ = 64


@dataclass(frozen=True)
class SingleConfig(GenerationConfig):
    """Single-model options.

    ``steps_per_read``: unconstrained decoding (greedy or sampled) queues up to this many steps on the
    device before it reads their tokens (vLLM's multi-step scheduling; #38). Why: each read waits for every kernel
    queued before it, so a loop that reads each token before it queues the next step leaves a GPU idle
    while the host does its per-token work, which a graph-captured step makes the larger share. The
    tokens are the same; what changes: the text arrives in bursts (the first read after one step, then
    2, 4, ... up to ``steps_per_read``, so the first token is not delayed), and up to
    ``steps_per_read - 1`` steps behind an end of text are computed and dropped. 1 (the default until a
    lent GPU measures the gain): one read per token. A grammar reads per token; with tools
    (``tool_choice="auto"``) the free text is read in bursts, a call per token.
    """

    steps_per_read: int = 1

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("steps_per_read", self.steps_per_read, 1, MAX_STEPS_PER_READ)


def round_tokens(state: Any, pipeline: TokenPipeline, left: int) -> list[int]:
    """A round that reads its tokens as they are chosen: the next token and, under a grammar, in the same
    pass the tokens the grammar forces after it (:meth:`TokenPipeline.forced`: a property name, the only
    tool's name) as guesses, each kept while the member chooses it anyway (and then the token after them,
    from the pass's last row). The same tokens as one token per round (each is chosen from its own row),
    in fewer passes (#38). The last token is left unfed (the next round feeds it); at most ``left`` tokens."""
    forced = pipeline.forced(left - 1)
    base = len(state.ids)
    tokens: list[int] = []
    # the pending token, then the forced ones: one pass; the last row's argmax read by a batched pass when
    # the choice is one (greedy from the raw logits; scheduler.greedy_choices says why)
    rows = state.score(forced, greedy=not forced and not pipeline.config.do_sample and pipeline.unmasked)
    for j in range(len(rows)):
        last = j == len(rows) - 1
        # greedy: the logits' argmax (a sample normalises)
        token = state.chosen if last and state.chosen is not None else pipeline.next_token(rows[j], keep_probs=False)[0]
        tokens.append(token)
        if token in state.member.eos_token_ids:
            break
        pipeline.accept(token)
        if j == len(forced) or token != forced[j]:
            break
    if len(state.ids) > base + len(tokens) - 1:  # forced tokens fed past the one that was not chosen
        state.crop(base + len(tokens) - 1)
    return tokens


@dataclass
class _SingleRequest:
    views: list[MemberView]
    config: SingleConfig
    decoder: IncrementalDecoder
    rounds: int = 0
    steps: int = 1  # the steps the next round may queue before its read (doubles up to steps_per_read)


class SingleModel(EnsembleMethod[SingleConfig]):
    """The first member alone, through its KV cache: one token per round, or a burst read at once."""

    name = "single"
    config_class = SingleConfig
    min_members = 1

    def begin(self, prompt: Prompt, config: SingleConfig) -> _SingleRequest:
        member = self.members[0]
        return _SingleRequest(start_views([member], prompt, config), config, IncrementalDecoder(member.tokenizer))

    def step(self, request: _SingleRequest) -> Chunk:
        view = request.views[0]
        state, member = view.state, view.member
        left = request.config.max_new_tokens - len(state.response_ids)
        steps = min(request.steps, left)
        request.steps = min(2 * request.steps, request.config.steps_per_read)
        request.rounds += 1
        if steps > 1 and unread_drafting(state, view.pipeline, follow_calls=True):
            # the steps queued with their ids left on the device, read once (drafting._draft_unread:
            # the pipeline follows them; a call that starts in the burst is drafted on under its grammar); the
            # last token is fed by the next round, as round_tokens leaves its last one
            tokens, _ = draft_tokens(state, steps, left, view.pipeline)
        else:
            tokens = round_tokens(state, view.pipeline, left)
        # the state holds every token but the last (the end of the text, or the next round's first to feed)
        if tokens[-1] in member.eos_token_ids:
            return Chunk(request.decoder.push(tokens[:-1]), done=True, finish_reason="eos")
        state.extend(tokens[-1:])
        delta = request.decoder.push(tokens)  # a token ending inside a character adds nothing yet
        if len(state.response_ids) >= request.config.max_new_tokens:
            return Chunk(delta + request.decoder.flush(), done=True, finish_reason="length")
        return Chunk(delta)

    def stats(self, request: _SingleRequest) -> RequestStats:
        state = request.views[0].state
        return RequestStats(self.name, len(state.response_ids), request.rounds, [MemberStats.of(state, "member")])
