"""A member's view of one request: its decoding state and its tokenization of the shared text.

Every method shares the response as *text* (see :mod:`~ensemble_core.text.alignment`). Each
member reads that text after its own *reply lead* (the whitespace its chat format puts
before a reply: ``" "`` after a plain ``"Assistant:"``, nothing after a chat template's
generation prompt, see :meth:`Member.response_lead`), tokenizes it with its own tokenizer
and keeps a KV cache over those ids. :class:`MemberView` holds the three together and is
the one place where a member's ids are brought in line with a new tokenization
(:meth:`~MemberView.commit`) or cut back at a boundary (:meth:`~MemberView.truncate`),
and it carries the member's :class:`~ensemble_core.decoding.pipeline.TokenPipeline` (how it
chooses tokens, and its grammar position under a constraint). SAFE, SpecEM and the
baselines all use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ensemble_core.constraints.closing import resolve_margin
from ensemble_core.constraints.grammar import compile_for_member, request_constraint
from ensemble_core.constraints.lazy import lazy_calls
from ensemble_core.decoding.generation import GenerationConfig
from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.decoding.pipeline import TokenPipeline
from ensemble_core.decoding.sampling import make_generator
from ensemble_core.text.alignment import DEFAULT_MARGIN, EMPTY, Tokenized, encode_continuation
from ensemble_core.text.chat import Prompt, normalize_messages


@dataclass
class MemberView:
    """One member within one request.

    ``tokens`` is the member's latest tokenization of its own text (``lead`` + shared
    text), with character spans relative to the start of that text. The decoding state's
    response ids equal ``tokens.ids`` after :meth:`commit`; in between, a method may run
    further ids through the state (SAFE's drafter drafts ahead of its committed tokens, a
    verifier's ``tokens`` cover the draft it is checking). ``open_end``: a trailing whitespace run of
    re-encoded text is split as it will be once text follows (:func:`~ensemble_core.text.alignment.tokenize_open`;
    the config's ``open_end``; off under ``published=True``, where the text is re-encoded as the papers' code does).
    """

    member: Member
    state: DecodeState
    pipeline: TokenPipeline
    lead: str = ""
    tokens: Tokenized = EMPTY
    open_end: bool = True

    @property
    def tokenizer(self) -> object:
        return self.member.tokenizer

    def own_text(self, shared: str) -> str:
        """This member's text for the shared text ``shared`` (the lead only once there is text)."""
        return self.lead + shared if shared else ""

    def piece(self, shared: str, new: str) -> str:
        """The text this member appends for ``new`` after the shared text ``shared`` (its lead first)."""
        return (self.lead if not shared else "") + new

    def offset(self, shared: int) -> int:
        """This member's character offset for offset ``shared`` of the shared text.

        Offset 0 stays 0: there the member has yet to write its lead (a prefix to fusion).
        """
        return len(self.lead) + shared if shared else 0

    def continuation(self, text: str, margin: int = DEFAULT_MARGIN) -> tuple[int, Tokenized]:
        """Tokenize the member's new text ``text`` reusing :attr:`tokens` (see ``encode_continuation``)."""
        return encode_continuation(self.member.tokenizer, text, self.tokens, margin, open_end=self.open_end)

    def appended(self, shared: str, new: str) -> tuple[int, Tokenized]:
        """:meth:`continuation` for the shared text ``shared`` followed by ``new``."""
        return self.continuation(self.tokens.text + self.piece(shared, new))

    def commit(self, keep: int, tokens: Tokenized) -> None:
        """Make ``tokens`` the member's text: keep the first ``keep`` response ids, feed the rest.

        Ids past ``keep`` are cropped from the state (and its cache); the new ids are
        appended without a forward pass (they are fed by the next ``score``).
        """
        state = self.state
        if state.prompt_len + keep < len(state.ids):
            state.crop(state.prompt_len + keep)
        state.extend(tokens.ids[keep:])
        self.tokens = tokens

    def truncate(self, n: int) -> int:
        """Keep at most ``n`` committed tokens, cut back to a valid boundary; return how many remain."""
        tokens = self.tokens.truncated(n)
        self.state.crop(self.state.prompt_len + len(tokens))
        self.tokens = tokens
        return len(tokens)


def start_views(members: Sequence[Member], prompt: Prompt, config: GenerationConfig,
                seeded: bool = False) -> list[MemberView]:
    """A fresh view per member (raises ``PromptTooLongError`` like :meth:`Member.start`).

    The prompt is normalised once for all members. Sampling: by default every member's
    pipeline shares one generator seeded by ``config.seed`` (one stream of choices per
    request: SAFE's drafter and ensemble points, every-token's fusion); with ``seeded`` each
    member gets its own, seeded ``seed + i``, so that members drafting in parallel threads
    draw reproducibly. A request with tools or a response format renders them into each
    member's prompt; a constrained one (a forced tool call, a schema) gives each member's
    pipeline its grammar position, compiled for its tokenizer; one with tools and
    ``tool_choice="auto"`` (or ``"none"``) gives it the lazy call grammar
    (:mod:`~ensemble_core.constraints.lazy`), with the calls answered in the history excluded.
    """
    structured = config.structured if config.structured.active else None
    constraint = request_constraint(structured) if structured else None
    conversation = normalize_messages(prompt)
    calls = lazy_calls(config.structured, conversation, config.exclude_repeated_calls, config.lazy_tool_grammar)
    margin = resolve_margin(config.close_margin, config.max_new_tokens)
    shared = None if seeded else make_generator(config)
    views = []
    for i, m in enumerate(members):
        generator = shared
        if seeded:
            own = config.replace(seed=config.seed + i) if config.do_sample and config.seed is not None else config
            generator = make_generator(own)
        messages = m.messages(conversation, structured, normalized=True)
        state = m.start_from_ids(m.prompt_ids(messages, structured, config.max_new_tokens))
        grammar = lazy = None
        if constraint is not None:
            grammar = compile_for_member(constraint, m).start(config.loops, margin)
            grammar.set_budget(config.max_new_tokens)  # methods that commit text tell it again each round
        elif calls is not None:
            lazy = calls.start(m, config.loops, margin, config.max_new_tokens)
        views.append(MemberView(m, state, TokenPipeline(config, generator, grammar, lazy), m.lead_of(messages),
                                open_end=not config.published if config.open_end is None else config.open_end))
    return views
