"""Generate-then-select: every member answers fully, the answers are cross-scored, the best wins.

The MBR-like latency baseline SpecEM improves on, with SpecEM's drafting and scoring
(:mod:`~ensemble_core.methods.selection`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ensemble_core.decoding.generation import Chunk, EnsembleMethod
from ensemble_core.decoding.lookup import guesses_now
from ensemble_core.decoding.stats import GenerateThenSelectStats, MemberStats, roles
from ensemble_core.decoding.view import MemberView, start_views
from ensemble_core.methods.reliability import Votes, check_weights, member_weights
from ensemble_core.methods.selection import (
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
from ensemble_core.text.chat import Prompt


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
    text: str = ""  # the returned text: the chosen answer cut to the token budget
    seconds: dict[str, float] = field(default_factory=lambda: {"draft": 0.0, "verify": 0.0})
    votes: Votes | None = None  # the judges' weights (reliability) and the chosen answer's member


class GenerateThenSelect(EnsembleMethod[SelectionConfig]):
    """Every member answers in full, the answers are cross-scored, the best one is returned.

    The MBR-like latency baseline SpecEM improves on: answers are drafted like SpecEM
    segments of ``max_new_tokens`` tokens (same EOS / stop-string handling, no word
    trimming), scored by every verifier with the same in-line scorer and normalisation
    as SpecEM (:mod:`ensemble_core.decoding.verify_inline`), and combined with the judges' weights
    (:mod:`~ensemble_core.methods.reliability`: the prior by default, uniform with ``reliability="none"``,
    as published).
    Nothing is streamed before the whole answer is chosen, so the time to the first chunk
    is the total time.
    """

    name = "generate-then-select"
    config_class = SelectionConfig
    min_members = 2

    def check(self, config: SelectionConfig) -> None:
        resolve_roles(self.members, config)
        check_weights(self.members, config)

    def begin(self, prompt: Prompt, config: SelectionConfig) -> _SelectRequest:
        drafters, verifiers = resolve_roles(self.members, config)
        return _SelectRequest(start_views(self.members, prompt, config, seeded=True), config, drafters, verifiers,
                              self.stop_strings(config), use_threads(self.members, config),
                              votes=Votes.start(member_weights(self.members, config, prompt)))


    def step(self, request: _SelectRequest) -> Chunk:
        cfg, views = request.config, request.views
        t0 = time.perf_counter()
        lookup = guesses_now(cfg.prompt_lookup or 0, cfg.prompt_lookup_max_requests)  # None: 0, nothing measured faster
        answers = run_all(lambda i: draft(views[i], i, cfg.max_new_tokens, request.stops, "", trim=False,
                                             lookup=lookup),
                          request.drafters, request.parallel)
        t1 = time.perf_counter()
        request.answers, request.seconds["draft"] = answers, t1 - t0
        if all(not a.text and not a.finished for a in answers):
            return Chunk("", done=True, finish_reason="eos")
        raw = run_all(lambda v: verify(views[v], "", answers, cfg.scoring, v)[0], request.verifiers, request.parallel)
        request.scores = [normalize_scores(r, cfg.normalization) for r in raw]
        request.seconds["verify"] = time.perf_counter() - t1
        judges = request.votes.weights if request.votes else [1.0] * len(self.members)
        total = sum(judges[v] for v in request.verifiers)
        best, _ = select_candidate([judges[v] / total if total > 0 else 1.0 / len(raw) for v in request.verifiers],
                                   request.scores)
        chosen = answers[best]
        request.chosen = chosen.member
        if request.votes is not None:
            request.votes.win(chosen.member)
        text, cut, _, _ = finish_text(views[0], "", chosen.text, cfg.max_new_tokens)
        request.text = text
        return Chunk(text, done=True, finish_reason="length" if cut or not chosen.finished else chosen.end)

    def stats(self, request: _SelectRequest) -> GenerateThenSelectStats:
        names = [m.name for m in self.members]
        return GenerateThenSelectStats(  # tokens: the returned text's, in the primary member's tokenizer
            method=self.name, tokens=self.primary.count_tokens(request.text) if request.text else 0, rounds=1,
            members=self._members_stats(request), reliability=request.votes.source if request.votes else None,
            drafters=[names[i] for i in request.drafters], verifiers=[names[i] for i in request.verifiers],
            seconds={k: round(v, 4) for k, v in request.seconds.items()}, chosen=request.chosen,
            answers=[{"member": names[a.member], "tokens": a.tokens, "chars": len(a.text), "end": a.end}
                     for a in request.answers],
            scores=[[round(s, 6) for s in row] for row in request.scores],
        )

    @staticmethod
    def _members_stats(request: _SelectRequest) -> list[MemberStats]:
        members = [MemberStats.of(v.state, roles(i, request.drafters, request.verifiers))
                   for i, v in enumerate(request.views)]
        return request.votes.annotate(members) if request.votes else members
