"""SAFE: selective token-level ensembling with a drafter and verifiers.

"When to Ensemble: Identifying Token-Level Points for Stable and Fast LLM Ensembling"
(ICLR 2026). Ensembling every token is slow (every member runs every step) and unstable
(a member's distribution right after a token boundary it would not have made is
garbage). SAFE lets one member draft and ensembles only where it is safe and useful.

One round (:meth:`SafeEnsemble.step`):

1. **Draft**: the drafter decodes ``lookahead`` tokens through its KV cache, keeping its
   distribution at each (a few more if the last one stops inside a character).
2. **Verify**: each verifier re-encodes only the end of its tokenization plus the drafted
   text (:func:`~ensemble_core.text.alignment.encode_continuation`, ``margin`` tokens behind the
   change), crops its cache to the unchanged ids and runs ONE forward pass over the rest,
   which yields its distribution at every one of its positions in the window.
3. **First ensemble point** ``j`` (before drafter token ``j``):

   * *stability*: the character offset must be a token boundary for every verifier and not
     inside a character for the drafter, else the point is OOV-like and skipped;
   * *consensus*: skipped when every verifier's argmax is its own next token of the
     drafted text (agreement judged in each verifier's tokenization, so ``Inc|orrect``
     versus ``Incorrect`` is not a disagreement), or when the average over members of the
     probability of continuing as drafted is ``>= consensus_threshold``; with the GaC
     distribution also when the drafter's own probability is ``>= 0.5``.

   Tokens before ``j`` are accepted; if no point qualifies the whole draft is.
4. **Ensemble** at ``j``: fuse the members' distributions
   (:mod:`~ensemble_core.text.distributions`), sharpen, choose (greedy, or sampled under the
   seed); append the chosen string, which may be several drafter tokens (encoded for the
   drafter in context), and discard the rest of the draft.
5. **Caches**: the drafter is cropped to its committed ids at once. A verifier is cropped
   lazily at the start of the next round, when it re-encodes the new window anyway: one
   crop instead of two, and removal then only touches tokens fed since the last crop, so
   sliding-window caches (Gemma-3) stay exact instead of being re-prefilled.

Reply lead: a base-model transcript ends its prompt with ``"Assistant:"`` and continues
with ``" The"``, a chat template ends with ``"assistant\n"`` and continues with ``"The"``.
Each member sees the shared text after its own *lead* (:meth:`Member.response_lead`, read off
its template), and at the very start of the reply a member's candidates are compared
after stripping its lead (``prefixes`` of :meth:`Distribution.fuse`); otherwise the
first point would be a vote on whitespace.

End of text: a drafted EOS is a point like any other, with the candidate "end of text"
(each member's probability of any of its EOS tokens). If the members agree, or its
average probability passes the threshold, generation ends ("eos"); otherwise the
ensemble decides, and may overrule the drafter (continue) or stop. A verifier's EOS can
end generation only through an ensemble point. ``max_new_tokens`` counts the drafter's
tokens. Text is never committed inside a character: a draft that ends in an unfinished
character is cut back, and one that never completes a character forces an ensemble
point, whose candidates are always whole strings.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from ensemble_core.decoding.drafting import draft_tokens
from ensemble_core.decoding.generation import Chunk, EnsembleMethod, GenerationConfig
from ensemble_core.decoding.lookup import guesses_now
from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.decoding.rows import window_probs
from ensemble_core.decoding.stats import MemberStats, SafeStats
from ensemble_core.decoding.view import MemberView, start_views
from ensemble_core.errors import InvalidOptionError
from ensemble_core.methods.reliability import Votes, Weights, check_weights, member_weights
from ensemble_core.options import (
    FusionOptions,
    PromptLookupOptions,
    ReliabilityOptions,
    check_int,
    check_number,
    device_default,
    sub_token_rule,
)
from ensemble_core.text.alignment import (
    DECODE_CONTEXT,
    DEFAULT_MARGIN,
    REPLACEMENT_CHAR,
    Tokenized,
    decode_suffix,
)
from ensemble_core.text.chat import Prompt
from ensemble_core.text.distributions import (
    Distribution,
    EndOfText,
    make_distribution,
    member_table,
    sharpen,
)

#: The GaC variant only ensembles where the drafter itself is unsure.
GAC_DRAFTER_CONFIDENT = 0.5
#: SAFE's drafting levers per device type where they measured faster than the published settings
#: without costing accuracy (``prompt_lookup``, ``draft_confidence``; docs/configuration.md): SAFE on
#: the Qwen pair with its default drafter (Qwen) on a 2-core CPU 0.63x Qwen alone per character with
#: both, 2.09x without, the same text on 15 of 15 GSM8K questions (docs/benchmarks.md, "SAFE out of
#: the box"). A GPU keeps the published 0 / 0 until a lent GPU measures them.
MEASURED_LEVERS: dict[str, dict[str, Any]] = {"prompt_lookup": {"cpu": 4}, "draft_confidence": {"cpu": 0.5}}


@dataclass(frozen=True)
class SafeConfig(GenerationConfig, FusionOptions, PromptLookupOptions, ReliabilityOptions):
    """SAFE options (defaults of the published code).

    ``drafter``: index of the drafting member; None (default): the member with the largest
    reliability weight (the published default, "the strongest member"; ties and
    ``reliability="none"``: the first member). The drafter writes the text and the verifiers
    only veto its uncertain tokens, so a weak drafter's reasoning survives wherever the strong
    verifier finds its tokens plausible (measured: docs/choosing.md); a fast member drafting
    (``drafter=<index>``) trades that for speed. ``lookahead``: tokens drafted per round
    (n). ``consensus_threshold``: skip a point when the members' average probability of the
    drafted continuation is at least this (0 never ensembles except to finish a broken
    character; 1 ensembles wherever a verifier disagrees). ``margin``: verifier tokens
    re-encoded behind the committed boundary. The fusion at a point (``distribution``,
    ``top_k``, ``sharpening``, default ``"heuristic"`` here, UniTE's ``sub_tokens``, and
    ``fusion_weights``, which also weigh the consensus average) is :class:`~ensemble_core.options.FusionOptions`; the
    drafter's prompt lookup (``prompt_lookup``, ``prompt_lookup_max_requests``) is
    :class:`~ensemble_core.options.PromptLookupOptions`. How much each member's vote counts at a
    point and in the consensus average (``reliability``, default ``"prior"``: by body size, a
    member without a chat template a quarter of that; ``"none"``: uniform, as published) is
    :class:`~ensemble_core.options.ReliabilityOptions`; ``fusion_weights`` given wins.
    ``draft_confidence``: end a draft early, after a token the drafter gives less than this
    probability (0: always ``lookahead`` tokens, as published); what transformers' assisted
    generation calls ``assistant_confidence_threshold``. Such a token is where the members
    tend to disagree, and the tokens drafted after an ensemble point are thrown away. It pays
    where a verify pass is cheap next to the drafting it saves: 0.5 made SmolLM2 drafting for
    Qwen2.5-0.5B 10-12 % faster per token on a CPU (docs/benchmarks.md, "Early-ending drafts").
    ``prompt_lookup`` and ``draft_confidence`` left at None take the drafter's device's
    measured-best (:data:`MEASURED_LEVERS`: on a CPU 4 and 0.5; elsewhere, until measured, the
    published 0 and 0); ``published=True`` takes the published values (docs/configuration.md).
    """

    drafter: int | None = None
    lookahead: int = 5
    consensus_threshold: float = 0.5
    sharpening: str = "heuristic"
    margin: int = DEFAULT_MARGIN
    draft_confidence: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("drafter", self.drafter, 0, optional=True,
                  expected="a member index >= 0, or None for the member with the largest reliability weight")
        check_number("draft_confidence", self.draft_confidence, 0, 1, below=True, optional=True,
                     expected="a number in [0, 1) (0: drafts of lookahead tokens), or None for the measured default")
        check_int("lookahead", self.lookahead, 1)
        check_int("margin", self.margin, 0)
        check_number("consensus_threshold", self.consensus_threshold, 0, 1)


def drafting_levers(config: SafeConfig, device: Any) -> tuple[int, float]:
    """``(prompt_lookup, draft_confidence)`` for a request whose drafter runs on ``device``."""
    return (device_default(config.prompt_lookup, 0, MEASURED_LEVERS["prompt_lookup"], device, config.published),
            device_default(config.draft_confidence, 0.0, MEASURED_LEVERS["draft_confidence"], device, config.published))


@dataclass
class SafeRequest:
    config: SafeConfig
    views: list[MemberView]
    drafter: int
    fusion: Distribution
    weights: torch.Tensor | None = None  # fusion weights per member (None: uniform)
    votes: Votes | None = None  # the members' weights and wins, for the stats
    lookup: int = 0  # prompt-lookup guesses per drafter pass (the config's, or its device's default)
    confidence: float = 0.0  # draft_confidence (the config's, or its device's default)
    text: str = ""
    counters: SafeStats = field(default_factory=lambda: SafeStats("safe"))  # counted as the request runs
    spent: int = 0  # generation steps: accepted drafter tokens + >= 1 per ensemble-chosen string
    shares: list[float] | None = None  # ``weights`` as host floats, read once per request (the scan's averages)

    def __post_init__(self) -> None:
        if self.weights is not None and self.shares is None:
            self.shares = self.weights.tolist()

    def used(self) -> int:
        """Budget used against ``max_new_tokens``: the drafter's tokens of the text, or the
        steps taken if more (re-encoding can merge pieces: Gemma writes 31 newlines as one
        token), so that the number of rounds stays bounded by ``max_new_tokens``."""
        return max(len(self.views[self.drafter].tokens), self.spent)


@dataclass
class _Draft:
    """The drafter's proposal for one round.

    ``bounds[i]`` is the offset in the shared text, relative to the committed text, after
    the first ``i`` text tokens, or None where no ensemble point or cut may be (inside a
    character, or inside the drafter's lead at the start of the reply); ``complete`` is
    the number of text tokens up to the last valid boundary. ``text`` is the drafter's own
    text of those tokens (its lead included at the start), ``shift`` the lead length
    therein (``text[shift:]`` is shared text).
    """

    ids: list[int]
    probs: Any  # one distribution per drafted token (rows.TensorRows, or a remote member's rows)
    eos: bool
    text: str
    shift: int
    bounds: list[int | None]
    complete: int
    budget_cut: bool
    mark: Any = None  # the drafter's grammar position before the draft (constrained requests)

    @property
    def shared_text(self) -> str:
        return self.text[self.shift:]

    @property
    def text_ids(self) -> list[int]:
        return self.ids[:-1] if self.eos else self.ids

    def next_valid(self, i: int) -> int | None:
        """The first index > ``i`` with a valid boundary, if any."""
        for k in range(i + 1, len(self.bounds)):
            if self.bounds[k] is not None:
                return k
        return None


@dataclass
class _Decision:
    """What a round commits: ``accept`` drafted text tokens, then ``piece`` (ensemble-chosen
    text) if any; ``eos`` ends the generation, ``eos_drafted`` when it was the drafter's EOS."""

    accept: int
    piece: str | None
    eos: bool = False
    eos_drafted: bool = False


@dataclass
class _Window:
    """A verifier's distributions over the window: row ``r`` of ``probs`` follows ``first + r`` tokens."""

    index: int
    tokens: Tokenized
    first: int
    probs: Any  # rows.TensorRows, or a remote member's rows
    argmax: list[int]


class SafeEnsemble(EnsembleMethod[SafeConfig]):
    """SAFE over two or more members (see the module docstring)."""

    name = "safe"
    config_class = SafeConfig
    min_members = 2
    fuses = True

    def __init__(self, members: Any, config: SafeConfig | None = None, **options: Any) -> None:
        super().__init__(members, config, **options)
        self._fusions: dict[tuple[str, int, str], Distribution] = {}

    def check(self, config: SafeConfig) -> None:
        if config.drafter is not None and config.drafter >= len(self.members):
            raise InvalidOptionError("drafter", config.drafter, f"a member index in 0..{len(self.members) - 1}")
        check_weights(self.members, config)

    def drafter_index(self, config: SafeConfig, weights: Weights | None = None) -> int:
        """``config.drafter``, or (None) the member with the largest reliability weight (the first on a tie;
        ``weights``: a request's, else ``config``'s)."""
        if config.drafter is not None:
            return config.drafter
        values = (weights or member_weights(self.members, config)).values
        return max(range(len(values)), key=lambda i: (values[i], -i))

    @property
    def primary(self) -> Member:
        """The drafter: max_new_tokens and completion tokens count its tokens."""
        return self.members[self.drafter_index(self.config)]

    def primary_state(self, request: SafeRequest) -> DecodeState:
        return request.views[request.drafter].state

    def fusion(self, name: str, top_k: int, sub_tokens: str = "shared") -> Distribution:
        """The fusion rule (kept per method: its token tables and union vocabulary are reused)."""
        key = (name, top_k, sub_tokens)
        if key not in self._fusions:
            self._fusions[key] = make_distribution(name, self.members, top_k, sub_tokens)
        return self._fusions[key]

    # ------------------------------------------------------------------ request
    def begin(self, prompt: Prompt, config: SafeConfig) -> SafeRequest:
        self.check(config)
        fusion = self.fusion(config.distribution, config.top_k, sub_token_rule(config))
        weights = member_weights(self.members, config, prompt)  # fusion_weights, reliability_weights, the prior or uniform
        drafter = self.drafter_index(config, weights)
        lookup, confidence = drafting_levers(config, self.members[drafter].device)
        return SafeRequest(config, start_views(self.members, prompt, config), drafter, fusion, weights.tensor(),
                           Votes.start(weights), lookup=lookup, confidence=confidence)

    def step(self, request: SafeRequest) -> Chunk:
        request.counters.rounds += 1
        before = request.text
        draft = self._draft(request)
        windows = self._verify(request, draft)
        finish = self._commit(request, draft, self._scan(request, draft, windows))
        if finish is None and request.used() >= request.config.max_new_tokens:
            finish = "length"
        if finish == "length":
            self._truncate(request, len(before))
        delta = request.text[len(before):]
        pipeline = request.views[request.drafter].pipeline
        pipeline.restore(draft.mark)  # the grammar follows the committed text, not the draft
        pipeline.commit(delta)
        return Chunk(delta, done=finish is not None, finish_reason=finish)

    # ------------------------------------------------------------------ 1. draft
    def _draft(self, request: SafeRequest) -> _Draft:
        config, view = request.config, request.views[request.drafter]
        state, member = view.state, view.member
        budget = config.max_new_tokens - request.used()
        limit = min(config.lookahead, budget)
        base = len(state.ids)
        context = state.ids[max(0, base - DECODE_CONTEXT):base]
        mark = view.pipeline.checkpoint()  # a constrained request: the drafter drafts under its own grammar
        view.pipeline.set_budget(budget)  # closing pressure near the end
        ids, probs = draft_tokens(state, limit, budget, view.pipeline, request.confidence,
                                  guesses_now(request.lookup, config.prompt_lookup_max_requests))
        eos = ids[-1] in member.eos_token_ids
        text_ids = ids[:-1] if eos else ids
        pieces: list[str | None] = []
        text = ""
        for i in range(1, len(text_ids) + 1):
            piece = decode_suffix(member.tokenizer, context, text_ids[:i])
            if piece.endswith(REPLACEMENT_CHAR) or not piece.startswith(text):
                pieces.append(None)
            else:
                text = piece
                pieces.append(piece)
        at_start = len(view.tokens) == 0
        if at_start and not text.startswith(view.lead):
            view.lead = ""  # the drafter opened its reply differently: its text is the shared text
        shift = len(view.lead) if at_start else 0
        bounds: list[int | None] = [0]
        complete = 0
        for i, piece in enumerate(pieces, start=1):
            if piece is None or (shift and len(piece) <= shift):
                bounds.append(None)
            else:
                bounds.append(len(piece) - shift)
                complete = i
        kept = pieces[complete - 1] if complete else ""
        request.counters.drafted += len(ids)
        return _Draft(ids, probs, eos, kept or "", shift, bounds, complete,
                      budget_cut=len(ids) >= budget and not eos, mark=mark)

    # ------------------------------------------------------------------ 2. verify
    def _verify(self, request: SafeRequest, draft: _Draft) -> list[_Window]:
        shared = request.text + draft.shared_text
        windows = []
        for index, view in enumerate(request.views):
            if index == request.drafter:
                continue
            keep, tokens = view.continuation(view.lead + shared, request.config.margin)
            first = tokens.tokens_before(view.offset(len(request.text)))
            start = min(keep, first)
            view.state.crop(view.state.prompt_len + start)
            probs = window_probs(view.state, tokens.ids[start:], first - start)
            view.tokens = tokens
            windows.append(_Window(index, tokens, first, probs, probs.argmax()))
        return windows

    # ------------------------------------------------------------------ 3./4. ensemble points
    def _scan(self, request: SafeRequest, draft: _Draft, windows: list[_Window]) -> _Decision:
        """Walk the draft's points in order and decide what this round commits.

        At the first point that passes both checks the members' distributions are fused.
        If the ensemble picks the drafter's own token, nothing changes for the text nor for
        any member's state, so the scan goes on with the rest of the draft (a greedy redraft
        would produce the same tokens; this saves it). Any other choice ends the round.
        """
        config, counters = request.config, request.counters
        drafter_eos = request.views[request.drafter].member.eos_id_tensor
        drafter_keys = member_table(request.views[request.drafter].member).keys
        n_members = len(request.views)
        share = request.shares
        for j in range(len(draft.ids)):
            is_eos = draft.eos and j == len(draft.ids) - 1
            if draft.bounds[j] is None:  # inside a character (or the lead) for the drafter
                counters.skipped_oov += 1
                continue
            if not is_eos and draft.next_valid(j) is None:
                break  # token j ends in an unfinished character: not decidable this round
            offset = len(request.text) + draft.bounds[j]
            supports = self._verifier_support(request, windows, offset, is_eos)
            if supports is None:
                counters.skipped_oov += 1
                continue
            p_draft = draft.probs.mass(j, drafter_eos) if is_eos else draft.probs.prob(j, draft.ids[j])
            average = ((p_draft + sum(p for p, _ in supports)) / n_members if share is None else
                       share[request.drafter] * p_draft + sum(share[w.index] * p for w, (p, _) in zip(windows, supports)))
            if (all(agree for _, agree in supports) or average >= config.consensus_threshold
                    or (config.distribution == "gac" and p_draft >= GAC_DRAFTER_CONFIDENT)):
                counters.skipped_consensus += 1
                continue
            key, prefixes = self._ensemble(request, draft, windows, j)
            counters.ensembled += 1
            if isinstance(key, EndOfText):
                return _Decision(j, None, eos=True, eos_drafted=is_eos)
            if is_eos or draft.bounds[j + 1] is None or drafter_keys[draft.ids[j]] != prefixes[request.drafter] + key:
                return _Decision(j, key.decode("utf-8"))
        if not draft.eos and draft.complete == 0 and not draft.budget_cut:
            # the draft never completes a character: only an ensemble point makes progress
            key, _ = self._ensemble(request, draft, windows, 0)
            counters.ensembled += 1
            if isinstance(key, EndOfText):
                return _Decision(0, None, eos=True)
            return _Decision(0, key.decode("utf-8"))
        return _Decision(draft.complete, None, eos=draft.eos, eos_drafted=draft.eos)

    def _verifier_support(self, request: SafeRequest, windows: list[_Window], offset: int,
                          is_eos: bool) -> list[tuple[float, bool]] | None:
        """Per verifier: (probability of continuing as drafted, argmax agrees); None if unstable."""
        out = []
        for w in windows:
            view = request.views[w.index]
            own = view.offset(offset)
            if not w.tokens.is_boundary(own):
                return None
            k = w.tokens.tokens_before(own)
            if k < w.first:
                return None
            r = k - w.first
            best = w.argmax[r]
            if is_eos:
                out.append((w.probs.mass(r, view.member.eos_id_tensor), best in view.member.eos_token_ids))
            elif k < len(w.tokens):
                nxt = w.tokens.ids[k]
                out.append((w.probs.prob(r, nxt), best == nxt))
            else:
                return None
        return out

    # ------------------------------------------------------------------ 5. commit
    def _commit(self, request: SafeRequest, draft: _Draft, decision: _Decision) -> str | None:
        """Commit the decided text, crop the drafter; return a finish reason or None."""
        counters = request.counters
        self._accept(request, draft, decision.accept)
        kept = decision.accept + int(decision.eos_drafted)
        counters.accepted += kept
        counters.replaced += len(draft.ids) - kept
        request.spent += decision.accept
        if decision.piece is not None:
            before = len(request.views[request.drafter].tokens)
            self._append(request, decision.piece)
            request.spent += max(1, len(request.views[request.drafter].tokens) - before)
        if decision.eos:
            return "eos"
        if decision.piece is None and draft.budget_cut:
            return "length"
        return None

    def _ensemble(self, request: SafeRequest, draft: _Draft, windows: list[_Window],
                  point: int) -> tuple[Any, list[bytes]]:
        """Fuse, sharpen and choose at ``point``; returns the chosen key and the members' prefixes."""
        offset = len(request.text) + (draft.bounds[point] or 0)
        prefixes = [view.lead.encode("utf-8") if offset == 0 else b"" for view in request.views]
        probs: list[torch.Tensor | None] = [None] * len(request.views)
        probs[request.drafter] = draft.probs.row(point)
        for w in windows:
            probs[w.index] = w.probs.row(w.tokens.tokens_before(request.views[w.index].offset(offset)) - w.first)
        candidates = request.fusion.fuse(probs, drafter=request.drafter, prefixes=prefixes,  # type: ignore[arg-type]
                                         weights=request.weights)
        pipeline = request.views[request.drafter].pipeline  # the request's one stream of choices
        if pipeline.constrained:  # only candidates every member's grammar accepts (it is one grammar over text)
            pipeline.restore(draft.mark)
            prefix = draft.shared_text[: draft.bounds[point] or 0]
            allowed = pipeline.allowed_candidates(candidates, prefix)
            if allowed is None:  # none of the fused candidates: the drafter's own (masked, so valid) token
                return (EndOfText() if draft.eos and point == len(draft.ids) - 1
                        else member_table(request.views[request.drafter].member).keys[draft.ids[point]]), prefixes
            # the verifiers scored without the loop penalty and the closing pressure: apply both by text
            candidates = pipeline.merged_call_openers(pipeline.reweighted(allowed, prefix), prefix)
        scores = sharpen(candidates, request.config.sharpening)
        chosen = pipeline.choose(scores)
        if request.votes is not None:
            request.votes.count(candidates.member_probs, chosen)
        return candidates.keys[chosen], prefixes

    def _accept(self, request: SafeRequest, draft: _Draft, count: int) -> None:
        """Keep the first ``count`` drafted text tokens (they end on a valid boundary)."""
        view = request.views[request.drafter]
        t = view.tokens
        base = len(t.text)

        def own(k: int) -> int:  # drafter offset after k drafted tokens (k on a valid boundary)
            return draft.bounds[k] + draft.shift if k else 0  # type: ignore[operator]

        ids = draft.text_ids[:count]
        starts, ends, valid = [], [], []
        last_valid = 0
        for i in range(count):
            nxt = draft.next_valid(i)
            assert nxt is not None and nxt <= count
            starts.append(base + own(last_valid))
            ends.append(base + own(nxt))
            valid.append(draft.bounds[i + 1] is not None)
            if valid[-1]:
                last_valid = i + 1
        added = draft.text[: own(count)]
        view.tokens = t.extend(Tokenized(added, tuple(ids), tuple(starts), tuple(ends), tuple(valid)))
        request.text += added[draft.shift:] if count else ""
        target = view.state.prompt_len + len(view.tokens)
        if len(view.state.ids) > target:
            view.state.crop(target)
        else:
            view.state.extend(ids[len(view.state.ids) - view.state.prompt_len - len(t):])

    def _append(self, request: SafeRequest, piece: str) -> None:
        """Append ensemble-chosen text, encoded for the drafter in context (after its lead)."""
        view = request.views[request.drafter]
        text = request.text + piece
        view.commit(*view.continuation(view.lead + text, request.config.margin))
        request.text = text

    def _truncate(self, request: SafeRequest, floor: int) -> None:
        """Cut the drafter's tokens back to ``max_new_tokens`` at a valid boundary.

        An ensemble point may append a string of several drafter tokens; the cut never
        goes behind ``floor`` (shared text already returned) nor inside a character.
        """
        view = request.views[request.drafter]
        t = view.tokens
        if len(t) <= request.config.max_new_tokens:
            return
        n = t.last_boundary(request.config.max_new_tokens)
        cut = t.end(n)
        shared = max(cut - len(view.lead), 0) if n else 0
        if shared < floor or (n and cut < len(view.lead)):
            return
        view.truncate(n)
        request.text = request.text[:shared]

    # ------------------------------------------------------------------ stats
    def stats(self, request: SafeRequest) -> SafeStats:
        """The counters kept during the request, completed with the totals and the members' work."""
        return dataclasses.replace(
            request.counters, method=self.name, tokens=len(request.views[request.drafter].tokens),
            members=self._members_stats(request), reliability=request.votes.source if request.votes else None,
            distribution=request.config.distribution, sub_tokens=request.fusion.sub_tokens,
            drafter=request.views[request.drafter].member.name,
            sharpening=request.config.sharpening, prompt_lookup=request.lookup, draft_confidence=request.confidence,
        )

    @staticmethod
    def _members_stats(request: SafeRequest) -> list[MemberStats]:
        members = [MemberStats.of(v.state, "drafter" if i == request.drafter else "verifier")
                   for i, v in enumerate(request.views)]
        return request.votes.annotate(members) if request.votes else members
