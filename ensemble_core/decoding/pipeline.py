"""A member's token pipeline: how it chooses its next token in one request, the same way everywhere.

transformers applies one ``LogitsProcessor`` list on every decoding path; this is that idea
for an ensemble member. Every place that turns a member's logits into a token (a single
model's step, SAFE's drafter, a SpecEM / generate-then-select segment, every-token's
fusion inputs) and every place that commits text goes through the member's
:class:`TokenPipeline`, in this order:

1. **mask**: under a grammar (a forced tool call, a response format), tokens that would
   break the output get ``-inf`` (:mod:`~ensemble_core.constraints.grammar`);
2. **loop penalty**: tokens that continue a repeat of the output lose logits
   (:mod:`~ensemble_core.constraints.repetition`);
3. **closing pressure**: near the end of the token budget, tokens that close the value gain
   logits (:mod:`~ensemble_core.constraints.closing`);
4. **choice**: greedy, or a temperature / nucleus sample from the request's seeded generator
   (:mod:`~ensemble_core.decoding.sampling`).

Steps 1-3 act only under a grammar; free text goes straight to the choice. With
``tool_choice="auto"`` the grammar is *lazy* (:mod:`~ensemble_core.constraints.lazy`,
``calls``): the pipeline follows its member's text for a call's trigger (``<tool_call>``, a
``{"name"`` line, a fenced call), and only from there to the call's end do steps 1-3 apply,
under the grammar of one call of the request's tools; an activation inside a draft is undone
by :meth:`restore` like any grammar move. With ``tool_choice="none"`` the pipeline masks the
tokens that would complete a trigger. The pipeline also
carries the grammar's *position*, which follows the committed text: :meth:`accept` advances
it by a drafted token, :meth:`commit` by any committed text (a verifier's, an ensemble
point's, another member's segment), :meth:`checkpoint` / :meth:`restore` undo a draft that
was not kept, and :meth:`set_budget` tells the closing pressure how much budget is left.
Where the grammar forces the next bytes (a property name, the only tool's name), :meth:`forced`
names the member's tokens for them, and every decoding loop feeds them with the pass before them
as guesses it keeps where it chooses them anyway (:func:`~ensemble_core.decoding.drafting.next_guesses`;
llguidance's fast-forward tokens, as SGLang's jump-forward decoding uses forced text, but kept only
where chosen, so the tokens are the ones a token-by-token loop chooses).
At an ensemble point, where the choice is among fused *texts* rather than one member's
tokens, :meth:`allowed_candidates` and :meth:`reweighted` apply the same grammar and
penalties by text. A method never touches the grammar itself: a new method, or a new kind
of constraint, changes one place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ensemble_core.decoding.generation import GenerationConfig
from ensemble_core.decoding.sampling import choose_token, device_generator, sample_ids
from ensemble_core.text.distributions import Candidates, EndOfText, grammar_allows

#: The most forced tokens fed with one pass: with the token before them a pass of at most 16 new tokens,
#: which a captured bucket holds (``static.BUCKETS``); a longer forced run (a long ``const``) takes more passes.
MAX_FORCED = 15


@dataclass
class TokenPipeline:
    """One member's token choice and grammar position within one request (see the module docstring).

    ``generator`` is the seeded sampling generator (None: greedy, or unseeded sampling with a
    fresh seed); ``grammar`` the member's :class:`~ensemble_core.constraints.grammar.ConstraintState`
    when the request is constrained.
    """

    config: GenerationConfig
    generator: torch.Generator | None = None
    grammar: Any = None
    #: The lazy call grammar (:class:`~ensemble_core.constraints.lazy.LazyState`) of an ``auto`` or
    #: ``none`` request with tools; None otherwise (an eager ``grammar`` and lazy calls never mix).
    calls: Any = None

    @property
    def constrained(self) -> bool:
        """Whether a grammar shapes (or may shape) this member's tokens: an eager one, or lazy calls."""
        return self.grammar is not None or self.calls is not None

    @property
    def unmasked(self) -> bool:
        """Whether the next token is chosen from the raw logits: no grammar, or lazy calls in free text
        (:attr:`~ensemble_core.constraints.lazy.LazyState.free`). A draft may then leave its ids on the
        device; under lazy calls it follows them after its read and ends behind a token that starts a call."""
        return self.grammar is None and (self.calls is None or self.calls.free)

    # ------------------------------------------------------------------ choosing a token
    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Stages 1-3 on ``logits`` (``[V]`` or ``[n, V]`` at the current position): mask, loop penalty,
        closing pressure. Unchanged (the same tensor) without a grammar, and in free text before a call."""
        if self.grammar is not None:
            return self.grammar.mask_logits(logits)
        return logits if self.calls is None else self.calls.process(logits)

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The member's next-token probabilities after stages 1-3 (what fusion and drafts compare)."""
        return torch.softmax(self.process(logits).float(), dim=-1)

    def choose(self, probs: torch.Tensor) -> int:
        """Stage 4: greedy argmax, or a sample under the request's temperature / top-p and generator."""
        return choose_token(probs, self.config, self.generator)

    def pick(self, probs: torch.Tensor) -> torch.Tensor:
        """Stage 4 without reading: the id :meth:`choose` would choose from ``probs`` (the same draw), as a
        0-d tensor on their device, for a draft that reads its ids once at its end (#38)."""
        return sample_ids(probs, self.config, self.generator)

    def draws(self, device: torch.device) -> Any:
        """Where the generator that draws on ``device`` stands (None: greedy), to :meth:`undraw` to later.

        Why: a draft that picks its ids unread draws for every id it queues, also for those behind its
        end (an EOS, a stop string, where a call started) that the reading loop never chooses; undrawing
        them leaves the generator where that loop leaves it, so the text that follows is the same too."""
        generator = device_generator(self.generator, device) if self.config.do_sample else None
        return None if generator is None else (generator, generator.get_state())

    @staticmethod
    def undraw(mark: Any) -> None:
        """Put a generator back where :meth:`draws` found it."""
        if mark is not None:
            mark[0].set_state(mark[1])

    def pick_next(self, logits: torch.Tensor) -> torch.Tensor:
        """Stages 1-4 without reading: the id ``next_token(logits, keep_probs=False)`` chooses, on the device."""
        row = self.process(logits)
        return sample_ids(torch.softmax(row.float(), dim=-1) if self.config.do_sample else row, self.config,
                          self.generator)

    def next_token(self, logits: torch.Tensor, keep_probs: bool = True) -> tuple[int, torch.Tensor | None]:
        """The token chosen from ``logits`` (stages 1-4) and the distribution it was chosen from.

        With ``keep_probs=False`` a greedy choice takes the argmax of the processed logits
        without normalising them (a segment draft keeps its own scores instead); sampling
        always normalises.
        """
        row = self.process(logits)
        if keep_probs or self.config.do_sample:
            probs = torch.softmax(row.float(), dim=-1)
            return self.choose(probs), probs
        return choose_token(row, self.config, self.generator), None

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` (at most :data:`MAX_FORCED`) tokens the grammar forces next (a property name, the only
        tool's name): guesses a decoding loop feeds with its next pass and keeps where it chooses them anyway
        (:func:`~ensemble_core.decoding.drafting.next_guesses`); [] without a grammar and in free text."""
        limit = min(limit, MAX_FORCED)
        if self.grammar is not None:
            return self.grammar.forced(limit)
        return self.calls.forced(limit) if self.calls is not None else []

    # ------------------------------------------------------------------ following the text
    def accept(self, token: int) -> None:
        """Advance the grammar by one of this member's tokens (a drafted or chosen one); lazy calls
        look for a trigger in its text."""
        if self.grammar is not None:
            self.grammar.accept_token(token)
        elif self.calls is not None:
            self.calls.accept(token)

    def commit(self, text: str) -> None:
        """Advance the grammar by committed text (any member's; it need not end on a token boundary)."""
        if self.grammar is not None:
            self.grammar.accept_text(text)
        elif self.calls is not None:
            self.calls.commit(text)

    def checkpoint(self) -> Any:
        """The grammar position now (None without a grammar), to :meth:`restore` after a draft."""
        if self.grammar is not None:
            return self.grammar.checkpoint()
        return self.calls.checkpoint() if self.calls is not None else None

    def restore(self, mark: Any) -> None:
        """Go back to a :meth:`checkpoint` (the grammar follows the committed text, not a draft): a call
        that a rejected draft started is forgotten with it."""
        if mark is None:
            return
        if self.grammar is not None:
            self.grammar.restore(mark)
        elif self.calls is not None:
            self.calls.restore(mark)

    def set_budget(self, left: int | None) -> None:
        """How many budget tokens remain now (the closing pressure grows near the end)."""
        if self.grammar is not None:
            self.grammar.set_budget(left)
        elif self.calls is not None:
            self.calls.set_budget(left)

    # ------------------------------------------------------------------ ensemble points (texts)
    def allowed_candidates(self, candidates: Candidates, prefix: str = "") -> Candidates | None:
        """The fused candidates the grammar accepts after the committed text and ``prefix``.

        Unchanged without a grammar; None when the grammar accepts none of them.
        """
        if self.grammar is not None:
            return candidates.subset([grammar_allows(self.grammar, prefix, k) for k in candidates.keys])
        if self.calls is not None:
            return candidates.subset([self.calls.allows(prefix, None if isinstance(k, EndOfText) else k)
                                      for k in candidates.keys])
        return candidates

    def merged_call_openers(self, candidates: Candidates, prefix: str = "") -> Candidates:
        """With lazy calls, where a call may start: the candidates that open one (in any member's format)
        as one decision (:meth:`~ensemble_core.text.distributions.Candidates.merged`); else unchanged."""
        if self.calls is None:
            return candidates
        keys = [None if isinstance(k, EndOfText) else k for k in candidates.keys]
        return candidates.merged(self.calls.call_openers(prefix, keys))

    def reweighted(self, candidates: Candidates, prefix: str = "") -> Candidates:
        """Candidates with the loop penalty and the closing pressure applied by their text (stages 2-3)."""
        if self.grammar is None and self.calls is None:
            return candidates
        texts = [None if isinstance(k, EndOfText) else k for k in candidates.keys]
        source = self.grammar if self.grammar is not None else self.calls
        factors = source.text_factors(prefix, texts) if self.grammar is not None else source.factors(prefix, texts)
        return candidates if factors is None else candidates.reweighted(factors)
