"""Every-token ensembling: UniTE / GaC fusion at every token, with no stability check.

The slow, unstable baseline SAFE fixes, through the same distribution code as SAFE's
(:mod:`~ensemble_core.text.distributions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ensemble_core.decoding.generation import Chunk, EnsembleMethod, GenerationConfig
from ensemble_core.decoding.rows import next_row
from ensemble_core.decoding.stats import MemberStats, TokenLevelStats
from ensemble_core.decoding.view import MemberView, start_views
from ensemble_core.methods.reliability import Votes, check_weights, member_weights
from ensemble_core.methods.selection import finish_text
from ensemble_core.options import FusionOptions, ReliabilityOptions, check_int, sub_token_rule
from ensemble_core.text.alignment import DEFAULT_MARGIN
from ensemble_core.text.chat import Prompt
from ensemble_core.text.distributions import (
    Distribution,
    EndOfText,
    make_distribution,
    member_table,
    sharpen,
)


@dataclass(frozen=True)
class EveryTokenConfig(GenerationConfig, FusionOptions, ReliabilityOptions):
    """Every-token ensembling options: the fusion (:class:`~ensemble_core.options.FusionOptions`;
    ``sharpening`` ``"none"`` by default: the published baselines do not sharpen) and the
    ``margin`` of tokens re-encoded behind the end of the text. Each member's weight in the fusion:
    :class:`~ensemble_core.options.ReliabilityOptions` (``reliability="prior"`` by default, ``"none"``:
    the published uniform average; ``fusion_weights`` given wins)."""

    margin: int = DEFAULT_MARGIN

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("margin", self.margin, 0)


@dataclass
class _EveryTokenRequest:
    views: list[MemberView]
    config: EveryTokenConfig
    fusion: Distribution
    weights: torch.Tensor | None = None  # fusion weights per member (None: uniform)
    votes: Votes | None = None  # the members' weights and wins, for the stats
    text: str = ""
    ensembled: int = 0
    forced: int = 0  # the first member's tokens committed as forced text, without a fusion


def forced_text(view: MemberView, left: int) -> tuple[str, int]:
    """The text of the tokens the grammar forces next in the first member's vocabulary (a property name, the
    only tool's name; :meth:`~ensemble_core.decoding.pipeline.TokenPipeline.forced`), "" where nothing is
    forced or the tokens end inside a character.

    Why (#38): every member's grammar follows the same text, so where it forces bytes a fusion step could
    only choose where the string ends, at the cost of every member's pass and a read. The first member's
    forced tokens are where its own tokens end (the fused string is drafted from its distribution:
    ``drafter=0``), and the members feed them with the next step's pass. Returns the text and how many
    tokens spell it.
    """
    keys, tokens = member_table(view.member).keys, view.pipeline.forced(left)
    try:
        return b"".join(keys[t] or b"" for t in tokens).decode("utf-8"), len(tokens)
    except UnicodeDecodeError:
        return "", 0


class EveryTokenEnsemble(EnsembleMethod[EveryTokenConfig]):
    """UniTE / GaC at every step, with no stability check: the baseline SAFE fixes.

    Each step every member re-encodes the end of its text (its reply lead + the shared
    text), runs one forward pass over what changed, and the fused distribution picks the
    next string (:mod:`~ensemble_core.text.distributions`, the same code as SAFE's). Every
    member runs every step, and a member asked right after a boundary it would not have
    made (``Inc|orrect`` for a ``Incorrect`` tokenizer) contributes a poor distribution.
    ``max_new_tokens`` counts the first member's tokens: a fused string that would overshoot it
    (one token of another member can be several of the first's: a CJK word, an emoji) is cut
    to the budget at a character boundary (:func:`~ensemble_core.methods.selection.finish_text`)
    and ends the answer with ``finish_reason="length"``.
    """

    name = "every-token"
    config_class = EveryTokenConfig
    min_members = 2
    fuses = True

    def __init__(self, members: Any, config: EveryTokenConfig | None = None, **options: Any) -> None:
        super().__init__(members, config, **options)
        self._fusions: dict[tuple[str, int, str], Distribution] = {}

    def check(self, config: EveryTokenConfig) -> None:
        check_weights(self.members, config)

    def begin(self, prompt: Prompt, config: EveryTokenConfig) -> _EveryTokenRequest:
        key = (config.distribution, config.top_k, sub_token_rule(config))
        if key not in self._fusions:
            self._fusions[key] = make_distribution(config.distribution, self.members, config.top_k, key[2])
        weights = member_weights(self.members, config, prompt)  # fusion_weights, reliability_weights, the prior or uniform
        return _EveryTokenRequest(start_views(self.members, prompt, config), config, self._fusions[key],
                                  weights.tensor(), Votes.start(weights))

    def step(self, request: _EveryTokenRequest) -> Chunk:
        config = request.config
        at_start = not request.text
        first = request.views[0].continuation(request.views[0].own_text(request.text), config.margin)
        if len(first[1]) >= config.max_new_tokens:
            return Chunk("", done=True, finish_reason="length")
        left = config.max_new_tokens - len(first[1])
        forced, count = ("", 0) if at_start else forced_text(request.views[0], left)
        if forced:  # what the grammar forces is not voted on: it is fed with the next step's passes
            for view in request.views:
                view.pipeline.commit(forced)
            request.text += forced
            request.forced += count
            return Chunk(forced)
        encoded = [first] + [view.continuation(view.own_text(request.text), config.margin)
                             for view in request.views[1:]]
        probs = []
        for view, (keep, tokens) in zip(request.views, encoded):
            state = view.state
            state.crop(state.prompt_len + keep)  # also when nothing changed: trims sliding layers as before
            view.pipeline.set_budget(left)  # closing pressure near the end, under a grammar
            probs.append(view.pipeline.distribution(next_row(state, tokens.ids[keep:])))
            view.tokens = tokens
        prefixes = [view.lead.encode("utf-8") if at_start else b"" for view in request.views]
        candidates = request.fusion.fuse(probs, drafter=0, prefixes=prefixes, weights=request.weights)
        # the first member's pipeline: only fused strings its grammar accepts, chosen from the request's
        # one stream of choices (every member's pipeline shares the generator)
        pipeline = request.views[0].pipeline
        candidates = pipeline.merged_call_openers(pipeline.allowed_candidates(candidates) or candidates)
        chosen = pipeline.choose(sharpen(candidates, config.sharpening))
        if request.votes is not None:
            request.votes.count(candidates.member_probs, chosen)
        key = candidates.keys[chosen]
        if isinstance(key, EndOfText):
            return Chunk("", done=True, finish_reason="eos")
        piece, cut, _, _ = finish_text(request.views[0], request.text, key.decode("utf-8"), config.max_new_tokens)
        for view in request.views:
            view.pipeline.commit(piece)
        request.text += piece
        request.ensembled += 1
        return Chunk(piece, done=True, finish_reason="length") if cut else Chunk(piece)

    def stats(self, request: _EveryTokenRequest) -> TokenLevelStats:
        tokens = self.members[0].count_tokens(request.text) if request.text else 0
        # Every committed token but forced text comes out of a fusion step (E/T is 1 without a grammar). The
        # number of fusion steps (``rounds``) differs from ``tokens``: one fused string can span
        # several tokens of the first member, and a string of special tokens adds no text.
        return TokenLevelStats(
            method=self.name, tokens=tokens, rounds=request.ensembled,
            members=self._members_stats(request), reliability=request.votes.source if request.votes else None,
            distribution=request.config.distribution, sub_tokens=request.fusion.sub_tokens,
            ensembled=max(0, tokens - request.forced),
        )

    @staticmethod
    def _members_stats(request: _EveryTokenRequest) -> list[MemberStats]:
        members = [MemberStats.of(v.state, "member") for v in request.views]
        return request.votes.annotate(members) if request.votes else members
