"""Baselines kept in the same harness as the ensemble methods.

* :class:`SingleModel`: one member decoding alone through the member API (the reference
  every ensemble is compared with; its tokens equal ``model.generate``'s).
* :class:`GenerateThenSelect`: every member answers fully, the answers are cross-scored with
  SpecEM's scorer and the best is returned (the latency baseline SpecEM improves on).
* :class:`EveryTokenEnsemble`: UniTE / GaC fusion at *every* token with no stability check,
  through the same distribution code as SAFE (the slow, unstable baseline SAFE fixes).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from .alignment import DEFAULT_MARGIN, IncrementalDecoder
from .chat import Prompt
from .distributions import (
    Distribution,
    EndOfText,
    check_fusion_options,
    fusion_weights,
    grammar_allows,
    make_distribution,
    sharpen,
)
from .errors import InvalidOptionError
from .generation import Chunk, EnsembleMethod, GenerationConfig, choose_token, make_generator
from .lookup import guesses_now
from .members import Member
from .rows import next_row
from .selection import (
    Candidate,
    SelectionConfig,
    draft,
    finish_text,
    normalize_scores,
    resolve_roles,
    run_all,
    select_candidate,
    use_threads,
    verify,
)
from .stats import GenerateThenSelectStats, MemberStats, RequestStats, TokenLevelStats, roles
from .view import MemberView, start_views


@dataclass
class _SingleRequest:
    views: list[MemberView]
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
        return _SingleRequest(start_views([member], prompt, config), config, make_generator(config),
                              IncrementalDecoder(member.tokenizer))

    def step(self, request: _SingleRequest) -> Chunk:
        view = request.views[0]
        state, member = view.state, view.member
        row = next_row(state)
        if view.constraint is not None:  # a forced tool call / a schema: only tokens that keep the output valid
            row = view.constraint.mask_logits(row)
        probs = torch.softmax(row, dim=-1)
        token = choose_token(probs, request.config, request.generator)
        request.rounds += 1
        if token in member.eos_token_ids:
            return Chunk("", done=True, finish_reason="eos")
        if view.constraint is not None:
            view.constraint.accept_token(token)
        state.extend([token])
        delta = request.decoder.push([token])  # a token ending inside a character adds nothing yet
        if len(state.response_ids) >= request.config.max_new_tokens:
            return Chunk(delta + request.decoder.flush(), done=True, finish_reason="length")
        return Chunk(delta)

    def stats(self, request: _SingleRequest) -> RequestStats:
        state = request.views[0].state
        return RequestStats(self.name, len(state.response_ids), request.rounds, [MemberStats.of(state, "member")])


# --------------------------------------------------------------------------- generate-then-select

@dataclass
class _SelectRequest:
    views: list[MemberView]
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
        return _SelectRequest(start_views(self.members, prompt, config, seeded=True), config, drafters, verifiers,
                              self.stop_strings(config), use_threads(self.members, config))


    def step(self, request: _SelectRequest) -> Chunk:
        cfg, views = request.config, request.views
        t0 = time.perf_counter()
        lookup = guesses_now(cfg.prompt_lookup, cfg.prompt_lookup_max_requests)
        answers = run_all(lambda i: draft(views[i], i, cfg.max_new_tokens, cfg, request.stops, "", trim=False,
                                             lookup=lookup),
                          request.drafters, request.parallel)
        t1 = time.perf_counter()
        request.answers, request.seconds["draft"] = answers, t1 - t0
        if all(not a.text and not a.finished for a in answers):
            return Chunk("", done=True, finish_reason="eos")
        raw = run_all(lambda v: verify(views[v], "", answers, cfg.scoring, v)[0], request.verifiers, request.parallel)
        request.scores = [normalize_scores(r, cfg.normalization) for r in raw]
        request.seconds["verify"] = time.perf_counter() - t1
        best, _ = select_candidate([1.0 / len(raw)] * len(raw), request.scores)
        chosen = answers[best]
        request.chosen = chosen.member
        text, cut, _, _ = finish_text(views[0], "", chosen.text, cfg.max_new_tokens)
        return Chunk(text, done=True, finish_reason="length" if cut or not chosen.finished else chosen.end)

    def stats(self, request: _SelectRequest) -> GenerateThenSelectStats:
        names = [m.name for m in self.members]
        chosen = request.answers[request.chosen].text if request.chosen is not None else ""
        return GenerateThenSelectStats(
            method=self.name, tokens=self.primary.count_tokens(chosen) if chosen else 0, rounds=1,
            members=[MemberStats.of(v.state, roles(i, request.drafters, request.verifiers))
                     for i, v in enumerate(request.views)],
            drafters=[names[i] for i in request.drafters], verifiers=[names[i] for i in request.verifiers],
            seconds={k: round(v, 4) for k, v in request.seconds.items()}, chosen=request.chosen,
            answers=[{"member": names[a.member], "tokens": a.tokens, "chars": len(a.text), "end": a.end}
                     for a in request.answers],
            scores=[[round(s, 6) for s in row] for row in request.scores],
        )


# --------------------------------------------------------------------------- every-token ensemble
@dataclass(frozen=True)
class EveryTokenConfig(GenerationConfig):
    """Every-token ensembling options: the fusion rule (``"unite"`` or ``"gac"``), its
    ``top_k``, ``sharpening`` (``"none"`` by default: the published baselines do not
    sharpen), the ``margin`` of tokens re-encoded behind the end of the text and
    per-member ``fusion_weights`` (None: uniform; see :class:`~ensemble_core.safe.SafeConfig`)."""

    distribution: str = "unite"
    top_k: int = 10
    sharpening: str = "none"
    margin: int = DEFAULT_MARGIN
    fusion_weights: Any = None

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "fusion_weights", check_fusion_options(
            self.distribution, self.top_k, self.sharpening, self.fusion_weights))
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise InvalidOptionError("margin", self.margin, "an integer >= 0")


@dataclass
class _EveryTokenRequest:
    views: list[MemberView]
    config: EveryTokenConfig
    fusion: Distribution
    generator: torch.Generator | None
    weights: torch.Tensor | None = None  # fusion weights per member (None: uniform)
    text: str = ""
    ensembled: int = 0


class EveryTokenEnsemble(EnsembleMethod[EveryTokenConfig]):
    """UniTE / GaC at every step, with no stability check: the baseline SAFE fixes.

    Each step every member re-encodes the end of its text (its reply lead + the shared
    text), runs one forward pass over what changed, and the fused distribution picks the
    next string (:mod:`~ensemble_core.distributions`, the same code as SAFE's). Every
    member runs every step, and a member asked right after a boundary it would not have
    made (``Inc|orrect`` for a ``Incorrect`` tokenizer) contributes a poor distribution.
    ``max_new_tokens`` counts the first member's tokens; the last string may overshoot it
    by the few extra tokens it spans.
    """

    name = "every-token"
    config_class = EveryTokenConfig
    min_members = 2

    def __init__(self, members: Any, config: EveryTokenConfig | None = None, **options: Any) -> None:
        super().__init__(members, config, **options)
        self._fusions: dict[tuple[str, int], Distribution] = {}

    def begin(self, prompt: Prompt, config: EveryTokenConfig) -> _EveryTokenRequest:
        key = (config.distribution, config.top_k)
        if key not in self._fusions:
            self._fusions[key] = make_distribution(config.distribution, self.members, config.top_k)
        weights = fusion_weights(config.fusion_weights, [m.name for m in self.members])
        return _EveryTokenRequest(start_views(self.members, prompt, config), config, self._fusions[key],
                                  make_generator(config), weights)


    def step(self, request: _EveryTokenRequest) -> Chunk:
        config = request.config
        at_start = not request.text
        encoded = [view.continuation(view.own_text(request.text), config.margin) for view in request.views]
        if len(encoded[0][1]) >= config.max_new_tokens:
            return Chunk("", done=True, finish_reason="length")
        probs = []
        left = config.max_new_tokens - len(encoded[0][1])
        for view, (keep, tokens) in zip(request.views, encoded):
            state = view.state
            state.crop(state.prompt_len + keep)  # also when nothing changed: trims sliding layers as before
            row = next_row(state, tokens.ids[keep:])
            if view.constraint is not None:  # each member under its own token mask
                view.constraint.set_budget(left)  # closing pressure near the end (ensemble_core.closing)
                row = view.constraint.mask_logits(row)
            probs.append(torch.softmax(row.float(), dim=-1))
            view.tokens = tokens
        prefixes = [view.lead.encode("utf-8") if at_start else b"" for view in request.views]
        candidates = request.fusion.fuse(probs, drafter=0, prefixes=prefixes, weights=request.weights)
        grammar = request.views[0].constraint
        if grammar is not None:  # and only fused strings the grammar accepts
            candidates = candidates.subset([grammar_allows(grammar, "", k) for k in candidates.keys]) or candidates
        key = candidates.keys[choose_token(sharpen(candidates, config.sharpening), config, request.generator)]
        if isinstance(key, EndOfText):
            return Chunk("", done=True, finish_reason="eos")
        piece = key.decode("utf-8")
        for view in request.views:
            if view.constraint is not None:
                view.constraint.accept_text(piece)
        request.text += piece
        request.ensembled += 1
        return Chunk(piece)

    def stats(self, request: _EveryTokenRequest) -> TokenLevelStats:
        tokens = self.members[0].count_tokens(request.text) if request.text else 0
        # Every committed token comes out of a fusion step, so E/T is 1 by construction. The
        # number of fusion steps (``rounds``) differs from ``tokens``: one fused string can span
        # several tokens of the first member, and a string of special tokens adds no text.
        return TokenLevelStats(
            method=self.name, tokens=tokens, rounds=request.ensembled,
            members=[MemberStats.of(v.state, "member") for v in request.views],
            distribution=request.config.distribution, ensembled=tokens,
        )
