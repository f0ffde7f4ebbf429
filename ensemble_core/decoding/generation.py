"""The generation loop shared by every ensemble method.

A method is a two-method strategy object, like transformers' ``CandidateGenerator``:
:meth:`EnsembleMethod.begin` prepares a request (each member's prompt and decoding
state) and :meth:`EnsembleMethod.step` runs one round and returns the text it
*committed*. Everything else (stop strings, streaming without retractions, cancellation,
batching, token counting, timing) lives here once, so SAFE, SpecEM and the baselines
behave identically towards callers.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from ensemble_core.constraints.closing import check_margin
from ensemble_core.constraints.repetition import LoopPenalty
from ensemble_core.constraints.structured import (
    StructuredOutput,
    StructuredRequest,
    ToolCall,
    parse_output,
    structured_request,
)
from ensemble_core.decoding.members import DecodeState, Member
from ensemble_core.decoding.runner import quiet
from ensemble_core.decoding.scheduler import Batcher, BatchingConfig, Binding, bound
from ensemble_core.decoding.stats import RequestStats
from ensemble_core.errors import ConfigurationError, InvalidOptionError, NoMembersError, UnknownOptionError
from ensemble_core.options import check_bool, check_int, check_number, next_post_init
from ensemble_core.text.alignment import REPLACEMENT_CHAR
from ensemble_core.text.chat import Prompt
from ensemble_core.text.distributions import prepare_fusion

FINISH_REASONS = ("stop", "length", "eos", "cancelled")


@dataclass(frozen=True)
class GenerationConfig:
    """Options every method understands. Method configs subclass this.

    Greedy decoding by default (the deterministic setting of the papers); with
    ``do_sample=True`` tokens are drawn at ``temperature`` / ``top_p`` from a generator
    seeded by ``seed`` so that a seeded run is reproducible. ``temperature=0`` means greedy
    (as in OpenAI-style APIs), whatever ``do_sample`` says. Values are checked strictly
    (``max_new_tokens="10"`` or ``True`` is refused, not converted).
    """

    max_new_tokens: int = 256
    stop: tuple[str, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    #: OpenAI-style tool specs, the tool choice and a response format (see :mod:`ensemble_core.constraints.structured`).
    tools: tuple[dict[str, Any], ...] | None = None
    tool_choice: Any = None
    response_format: Any = None
    #: Under a grammar (a forced tool call, a response format): logits taken from tokens that
    #: would continue a repeat of more than 24 bytes, growing with the repeat, so a member that
    #: loops inside the JSON ends the value instead of running into the token budget
    #: (:mod:`ensemble_core.constraints.repetition`). 0 turns it off; free text is never penalized.
    loop_penalty: float = 1.0
    #: Under a grammar: over the last ``close_margin`` tokens of the budget, tokens that close a
    #: string, list or object gain logits (1 at the margin, doubling every 3 tokens), so that a
    #: member that keeps adding new items still ends the value inside the budget
    #: (:mod:`ensemble_core.constraints.closing`). None: a quarter of the budget, at least 24 tokens; 0 turns
    #: it off; free text is never pushed.
    close_margin: int | None = None
    #: ``tool_choice="auto"``: a call the model starts (``<tool_call>``, a ``{"name"`` line, a fenced
    #: call) is decoded under the call grammar to its end, so it always parses unless the budget cuts
    #: it (:mod:`ensemble_core.constraints.lazy`). False: free decoding, the reply is only parsed.
    lazy_tool_grammar: bool = True
    #: ``tool_choice="auto"``: a call equal (name and arguments) to one whose result is already in
    #: the history (or to that call fed its own result, or to an earlier call of the reply) makes the
    #: member answer after it, and the adapters drop it from the calls, so an agent gets an answer
    #: instead of the same call until its step limit (:mod:`ensemble_core.constraints.lazy`).
    #: ``"required"``: a reply of such calls only is asked again among the other tools
    #: (:func:`ensemble_core.serving.runtime.settle_calls`).
    exclude_repeated_calls: bool = True
    #: OpenAI's ``parallel_tool_calls``: whether a reply may hold several tool calls. False: at most one;
    #: with ``tool_choice="auto"`` the reply ends once its first call is complete (the lazy grammar allows
    #: only the end there), and a reply read without the grammar keeps its first call.
    parallel_tool_calls: bool = True
    #: When a method re-encodes a reply it is writing (every-token after each token, SAFE's verifiers and its
    #: appended text, SpecEM's segments): a trailing whitespace run is split as it will be once text follows
    #: (:func:`~ensemble_core.text.alignment.tokenize_open`). SmolLM2's tokenizer writes ``"\n\n"`` at the end
    #: of a text as one token it never uses mid-text; members placed after it wrote newlines to the budget.
    #: None: True, False under ``published=True`` (the papers' code re-encodes the plain way).
    open_end: bool | None = None
    #: The papers' exact settings for every option left at its default (uniform votes, UniTE's
    #: published scoring, one token per drafter pass, drafts of ``lookahead`` tokens), where the
    #: defaults are otherwise the measured-best (per device: :func:`~ensemble_core.options.device_default`;
    #: docs/configuration.md says which is which). An option given explicitly wins either way.
    published: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif self.stop is None:
            object.__setattr__(self, "stop", ())
        elif isinstance(self.stop, (list, tuple)):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidOptionError("stop", self.stop, "a string or a list of non-empty strings")
        check_int("max_new_tokens", self.max_new_tokens, 1)
        check_bool("do_sample", self.do_sample)
        check_number("temperature", self.temperature, 0, finite=True, expected="a finite number >= 0 (0 decodes greedily)")
        if self.temperature == 0:
            object.__setattr__(self, "do_sample", False)
        check_number("top_p", self.top_p, 0, 1, above=True)
        check_int("seed", self.seed, -2**63, 2**64 - 1, optional=True,  # what torch's generators take
                  expected="None or an integer that fits in 64 bits (-2**63 to 2**64 - 1)")
        request = structured_request(self.tools, self.tool_choice, self.response_format, self.parallel_tool_calls)
        if self.tools is not None:
            object.__setattr__(self, "tools", tuple(self.tools))
        object.__setattr__(self, "_structured", request)
        object.__setattr__(self, "_loops", LoopPenalty(multiplier=self.loop_penalty))  # validates loop_penalty
        check_margin(self.close_margin)
        check_bool("lazy_tool_grammar", self.lazy_tool_grammar)
        check_bool("exclude_repeated_calls", self.exclude_repeated_calls)
        check_bool("open_end", self.open_end, "True, False or None (None: True, False under published=True)",
                   optional=True)
        check_bool("published", self.published)
        next_post_init(GenerationConfig, self)  # the option groups a method config adds (ensemble_core.options)

    @property
    def structured(self) -> StructuredRequest:
        """The request's tools / tool choice / response format, validated (:mod:`ensemble_core.constraints.structured`)."""
        return self._structured  # type: ignore[attr-defined]

    @property
    def loops(self) -> LoopPenalty:
        """The loop penalty of constrained output (:mod:`ensemble_core.constraints.repetition`)."""
        return self._loops  # type: ignore[attr-defined]

    def replace(self, **overrides: Any) -> GenerationConfig:
        """A copy with ``overrides`` applied (and validated); unknown names raise."""
        known = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise UnknownOptionError(unknown, type(self).__name__, known)
        return dataclasses.replace(self, **{k: v for k, v in overrides.items()})


@dataclass
class Chunk:
    """What one round of a method commits."""

    text: str
    done: bool = False
    finish_reason: str | None = None


@dataclass
class GenerationResult:
    """A finished generation. Token counts use the method's primary member's tokenizer."""

    text: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    seconds: float
    time_to_first_chunk: float | None
    stats: RequestStats = field(default_factory=lambda: RequestStats("method"))
    #: The reply read as tool calls / a JSON value, for requests with tools or a response format.
    structured: StructuredOutput | None = None
    #: Of ``prompt_tokens``, those whose states came from the primary member's prefix cache (OpenAI's
    #: ``usage.prompt_tokens_details.cached_tokens``; :mod:`~ensemble_core.decoding.prefix_cache`).
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The parsed tool calls (empty without tools, or when the ensemble answered in text)."""
        return self.structured.tool_calls if self.structured else []

    @property
    def parsed(self) -> Any:
        """The reply as a JSON value, for a request with a response format (None if it did not parse)."""
        return self.structured.parsed if self.structured else None


C = TypeVar("C", bound=GenerationConfig)


class EnsembleMethod(ABC, Generic[C]):
    """An ensemble strategy over a list of members (one subclass per method).

    Subclasses set ``name``, ``config_class`` and ``min_members`` and implement
    :meth:`begin` and :meth:`step`; :meth:`primary` names the member whose tokenizer
    counts tokens (the drafter for SAFE, the first member otherwise).
    """

    name: ClassVar[str] = "method"
    config_class: ClassVar[type[GenerationConfig]] = GenerationConfig
    min_members: ClassVar[int] = 1
    #: Whether the method fuses the members' next-token distributions (SAFE, every-token): its warm-up then
    #: also builds their union vocabulary and backing tables (:func:`~ensemble_core.text.distributions.prepare_fusion`).
    fuses: ClassVar[bool] = False

    def __init__(self, members: Sequence[Member], config: C | None = None, **options: Any) -> None:
        members = list(members)
        if len(members) < self.min_members:
            raise NoMembersError(len(members), self.min_members)
        for m in members:
            if not isinstance(m, Member):
                raise ConfigurationError(f"{type(self).__name__} takes Member objects, got {type(m).__name__}.")
        self.members: list[Member] = members
        if config is not None and not isinstance(config, self.config_class):
            raise ConfigurationError(
                f"{type(self).__name__} expects a {self.config_class.__name__}, got {type(config).__name__}."
            )
        base = config if config is not None else self.config_class()
        self.config: C = base.replace(**options) if options else base  # type: ignore[assignment]
        self.check(self.config)  # a bad option fails when the method is built, not at the first request
        #: Shares forward passes between concurrent requests (None: each request decodes alone);
        #: see :mod:`ensemble_core.decoding.scheduler` and :meth:`set_batching`.
        self.batcher: Batcher | None = Batcher(BatchingConfig())

    def set_batching(self, config: BatchingConfig) -> None:
        """Turn cross-request batching on (with ``config``'s limits) or off (``enabled=False``)."""
        self.batcher = Batcher(config) if config.enabled else None

    def check(self, config: C) -> None:
        """Raise what ``config`` cannot run on these members (a member index or name out of range, weights
        given for other members), as :meth:`begin` would at the first request. Called when the method is
        built; the config a request brings (per-call overrides) is checked where :meth:`begin` reads it."""

    # ------------------------------------------------------------ to implement
    @abstractmethod
    def begin(self, prompt: Prompt, config: C) -> Any:
        """Prepare one request: render and encode the prompt for each member."""

    @abstractmethod
    def step(self, request: Any) -> Chunk:
        """Run one round; return the text committed in it (never retracted later)."""

    def warm_up(self) -> None:
        """Build what the first requests would otherwise build inside their own time.

        A method that compares members (``min_members`` > 1) maps every member's vocabulary
        to text once per process, and one that fuses them (:attr:`fuses`) the members' vocabularies
        onto their union (:func:`~ensemble_core.text.distributions.prepare_fusion`: ~1.4 s for the
        three bundled tokenizers), lazily at the first point where the members disagree; a server's
        or a benchmark's first requests paid that mid-answer.
        """
        if self.min_members > 1:
            prepare_fusion(self.members, union=self.fuses)

    def stats(self, request: Any) -> RequestStats:
        """Method statistics for a finished request (typed; see :mod:`ensemble_core.decoding.stats`)."""
        return RequestStats(self.name)

    @property
    def primary(self) -> Member:
        return self.members[0]

    def primary_state(self, request: Any) -> DecodeState | None:
        """The primary member's decoding state in ``request`` (a request keeps one ``MemberView`` per member
        in ``views``; override when the primary is not the first member)."""
        views = getattr(request, "views", None)
        return views[0].state if views else None

    def prompt_tokens(self, request: Any) -> int:
        """Prompt length in the primary member's tokens."""
        state = self.primary_state(request)
        return state.prompt_len if state is not None else 0

    def cached_tokens(self, request: Any) -> int:
        """Of :meth:`prompt_tokens`, those the primary member read from its prefix cache."""
        state = self.primary_state(request)
        return state.stats.prefix_reused if state is not None else 0

    # ------------------------------------------------------------ shared loop
    def stop_strings(self, config: GenerationConfig) -> tuple[str, ...]:
        stops = list(config.stop)
        for m in self.members:
            stops.extend(s for s in m.stop_strings if s not in stops)
        return tuple(stops)

    def stream(self, prompt: Prompt, cancel: threading.Event | None = None, **overrides: Any) -> GenerationStream:
        """Text deltas as they are committed; ``.result`` holds the result once exhausted."""
        config = self.config.replace(**overrides) if overrides else self.config
        return GenerationStream(self, prompt, config, cancel)

    def generate(self, prompt: Prompt, cancel: threading.Event | None = None, **overrides: Any) -> GenerationResult:
        stream = self.stream(prompt, cancel=cancel, **overrides)
        stream.drained = True
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def batch(self, prompts: Sequence[Prompt], **overrides: Any) -> list[GenerationResult]:
        """Several prompts, results in order.

        With batching on they run concurrently, one worker thread per prompt (at most
        ``max_batch_rows`` at a time), and share their forward passes, which the model runner
        computes (:mod:`~ensemble_core.decoding.runner`); otherwise one after another. The first
        error raised by any prompt is raised here, as soon as it is raised: the other prompts are
        cancelled after the round they are in and those not yet started never start (their answers
        would be thrown away; an empty prompt among 300-token answers raised after all of them).
        """
        if self.batcher is None or len(prompts) < 2:
            return [self.generate(p, **overrides) for p in prompts]
        workers = min(len(prompts), self.batcher.config.max_batch_rows)
        cancel = threading.Event()
        with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ensemble-batch") as pool:
            futures = [pool.submit(self.generate, p, cancel, **overrides) for p in prompts]
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
            if failed is not None:
                cancel.set()
                for f in futures:
                    f.cancel()
                raise failed.exception()  # type: ignore[misc]
            return [f.result() for f in futures]


def _holdback(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of ``text`` that may still become the start of a stop string."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold


class GenerationStream:
    """Iterator of committed text deltas; concatenated, they equal ``result.text``.

    Leading whitespace of the response is dropped (base-model transcripts start with a
    space after ``Assistant:``); stop strings are cut, and text that may still turn out to
    be the start of a stop string is held back until it is decided.
    """

    def __init__(self, method: EnsembleMethod, prompt: Prompt, config: GenerationConfig,
                 cancel: threading.Event | None = None) -> None:
        self.method, self.prompt, self.config = method, prompt, config
        self.cancel_event = cancel or threading.Event()
        self.result: GenerationResult | None = None
        #: The consumer takes every delta at once (``generate``, ``Run.run``): the request then
        #: stays active for the batcher while a delta is out. Otherwise (a streaming consumer,
        #: maybe slow) it is paused there so that it never holds up other requests' passes;
        #: but a paused request that comes back mid-pass computes next to it (measured: a
        #: 7-row pass of SpecEM x8 took 2.2-2.6 s instead of 0.6).
        self.drained = False
        self._iter = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._iter

    def __next__(self) -> str:
        return next(self._iter)

    @property
    def quiet(self) -> bool:
        """Whether the loop computes quietly (:func:`~ensemble_core.decoding.runner.quiet`): its consumer takes
        every delta at once, in a thread other than the main one.

        Such a thread may run beside other requests (``Ensemble.batch``'s workers, the async frameworks'
        and the server's generation threads, LangChain's sync ``batch``), and no code of the caller's runs
        in it between two deltas. The main thread keeps computing its own passes: it usually holds an
        OpenMP team already (measured: SmolLM2 in the main thread 10.1-14.8 s for three answers, quiet
        13.2-18.2 s), and a streaming consumer's own code runs between the deltas.
        """
        return self.drained and threading.current_thread() is not threading.main_thread()

    def cancel(self) -> None:
        """Ask the loop to stop after the current round."""
        self.cancel_event.set()

    def _run(self) -> Iterator[str]:
        t0 = time.perf_counter()
        method, config = self.method, self.config
        stops = method.stop_strings(config)
        longest = max((len(s) for s in stops), default=0)
        batcher = method.batcher
        # For the batcher this request is active (it may submit rows) except while a
        # streaming consumer holds a delta (see ``drained``).
        participant = batcher.join() if batcher is not None else None
        binding = Binding(batcher, participant) if batcher is not None and participant is not None else None
        try:
            with quiet() if self.quiet else nullcontext():
                yield from self._loop(binding, stops, longest, t0)
        finally:
            if binding is not None:
                binding.batcher.leave(binding.participant)

    def _loop(self, binding: Binding | None, stops: tuple[str, ...], longest: int, t0: float) -> Iterator[str]:
        method, config = self.method, self.config
        with bound(binding):  # the members' decoding states submit to this request's batcher
            request = method.begin(self.prompt, config)
        raw, emitted, lead, lead_fixed = "", 0, 0, False
        first: float | None = None
        while True:
            if self.cancel_event.is_set():
                finish = "cancelled"
                break
            with bound(binding):
                chunk = method.step(request)
            before = len(raw)
            raw += chunk.text
            hits = [i for i in (raw.find(s, max(0, before - longest + 1)) for s in stops) if i >= 0]
            done = chunk.done or bool(hits)
            if hits:
                raw, finish = raw[: min(hits)], "stop"
            else:
                finish = chunk.finish_reason or "eos"
            if not lead_fixed:
                stripped = raw.lstrip()
                lead, lead_fixed = len(raw) - len(stripped), bool(stripped)
            end = len(raw)
            if not done:  # hold back a possible stop-string start
                end -= _holdback(raw, stops)
            if not done or finish == "length":  # and an unfinished character, for good where the budget cut it
                while end > lead and raw[end - 1] == REPLACEMENT_CHAR:
                    end -= 1
            start = max(emitted, lead)
            if end > start:
                if first is None:
                    first = time.perf_counter() - t0
                paused = binding if binding is not None and not self.drained else None
                if paused is not None:
                    paused.batcher.pause(paused.participant)
                yield raw[start:end]
                if paused is not None:
                    paused.batcher.resume(paused.participant)
                emitted = end
            if done:
                break
        text = raw[lead:max(emitted, lead)]
        self.result = GenerationResult(
            text=text,
            finish_reason=finish,
            prompt_tokens=method.prompt_tokens(request),
            cached_tokens=method.cached_tokens(request),
            completion_tokens=method.primary.count_tokens(text) if text else 0,
            seconds=time.perf_counter() - t0,
            time_to_first_chunk=first,
            stats=method.stats(request),
            structured=parse_output(text, config.structured, finish_reason=finish) if config.structured.active else None,
        )
