"""Serving an ensemble to framework adapters: shared ensembles, the option policy, cancellable runs.

LangChain and LlamaIndex build model objects freely (a chain per request, ``model_copy``,
a fresh instance per standard test). Both adapters go through this module, so that
identical descriptions share one :class:`~ensemble_core.Ensemble` (and its weights) in a
process, concurrent generations on one ensemble share forward passes (batching, the
default) or take turns round by round, and sync, async,
streaming, timeout and cancellation behave the same in every framework. The message
policy is :mod:`ensemble_core.text.chat`'s; the option policy is here (:func:`call_overrides`):

==========================  ==============================================================
parameter                   core
==========================  ==============================================================
``temperature``             ``0`` (or unset) → greedy; ``> 0`` → ``do_sample=True`` at that
                            temperature
``max_tokens``              ``max_new_tokens`` (the same option; giving both with different
                            values raises), counted in the primary member's tokens
``top_p``, ``seed``         the same config fields
``stop``                    a string or a list; a per-call ``stop`` REPLACES the instance's
                            (as in ChatOpenAI and OpenAI's API); members' own stop strings
                            (``"\nUser:"`` for template-less members) are always added
method config fields        passed through (``lookahead``, ``segment_length``, ...)
anything else               :class:`~ensemble_core.errors.ConfigurationError` naming it
==========================  ==============================================================

Values are checked strictly: ``max_tokens="10"`` is refused, never converted. Finish
reasons are reported OpenAI-style by :func:`api_finish_reason` (``eos`` → ``stop``; a
reply that is tool calls → ``tool_calls``).
The adapters keep only their framework's types.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator, Hashable, Iterator, Mapping, Sequence
from contextlib import aclosing
from typing import Any

from ensemble_core.constraints.lazy import ANSWER_REQUEST, drop_repeated_calls
from ensemble_core.constraints.structured import CallDelta, ReplyStream, StructuredOutput, read_value
from ensemble_core.decoding.generation import GenerationConfig, GenerationResult
from ensemble_core.decoding.members import Member
from ensemble_core.ensemble import Ensemble
from ensemble_core.errors import (
    ConfigurationError,
    GenerationCancelled,
    GenerationTimeout,
    InvalidOptionError,
    NotPicklableError,
    UnknownOptionError,
)
from ensemble_core.methods import config_fields as config_fields_of
from ensemble_core.models.loading import MemberSpec
from ensemble_core.options import is_number
from ensemble_core.text.chat import Prompt, normalize_messages

#: How many distinct ensembles stay cached (weights are cached separately by the members).
MAX_ENTRIES = 16
#: How often a run waiting for its ensemble looks at its cancel event.
LOCK_POLL_S = 0.05

_ENSEMBLES: OrderedDict[Hashable, Ensemble] = OrderedDict()
_REGISTRY_LOCK = threading.Lock()


#: The standard chat-API parameters every adapter accepts (besides the method's config fields).
STANDARD_OPTIONS = ("temperature", "max_tokens", "max_new_tokens", "top_p", "seed", "stop")
#: Core finish reasons → the OpenAI-style values users of chat APIs check for.
API_FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "cancelled"}


def api_finish_reason(reason: str, has_tool_calls: bool = False) -> str:
    """The OpenAI-style finish reason for a core one (``eos`` and stop strings are both ``stop``).

    A reply that ended normally with parsed tool calls reports ``tool_calls`` (OpenAI's
    value, which agent loops check); a call cut by the token budget stays ``length``.
    """
    if has_tool_calls and reason in ("eos", "stop"):
        return "tool_calls"
    return API_FINISH_REASONS.get(reason, reason)


def merge_options(instance: Mapping[str, Any], call: Mapping[str, Any]) -> dict[str, Any]:
    """Instance options overridden by call options, name by name (``None`` means unset).

    ``max_tokens`` and ``max_new_tokens`` are one option: a call's value of either
    replaces the instance's value of both.
    """
    merged = {k: v for k, v in instance.items() if v is not None}
    call = {k: v for k, v in call.items() if v is not None}
    if {"max_tokens", "max_new_tokens"} & set(call):
        merged.pop("max_tokens", None)
        merged.pop("max_new_tokens", None)
    merged.update(call)
    return merged


def call_overrides(options: Mapping[str, Any], config: GenerationConfig, owner: str,
                   exclude: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    """Standard parameters and method options → core config overrides (see the module docstring).

    This only *renames* (``max_tokens`` → ``max_new_tokens``, ``temperature`` → ``do_sample`` +
    ``temperature``, a ``stop`` string → a tuple); the values are checked by the method's
    config itself (``config.replace``, i.e. :class:`~ensemble_core.decoding.generation.GenerationConfig`
    and the option groups), here and now rather than when the run starts, and an error names
    the option as the caller wrote it (``max_tokens``, not ``max_new_tokens``). ``config`` is
    the ensemble's method config; ``exclude`` are its fields a caller may not set (LlamaIndex
    sets ``do_sample`` only through ``temperature``); ``owner`` names the caller in error
    messages (``"ChatEnsemble"``, ``"EnsembleLLM"``, ...).
    """
    opts = {k: v for k, v in options.items() if v is not None}
    fields = frozenset(f.name for f in dataclasses.fields(config)) - set(exclude)
    out: dict[str, Any] = {}
    written: dict[str, str] = {}  # core name -> the name the caller used
    if "max_tokens" in opts and "max_new_tokens" in opts and opts["max_tokens"] != opts["max_new_tokens"]:
        raise ConfigurationError(f"{owner}: max_tokens={opts['max_tokens']!r} and max_new_tokens="
                                 f"{opts['max_new_tokens']!r} name one option; pass one of them.")
    if "max_new_tokens" in opts or "max_tokens" in opts:
        written["max_new_tokens"] = "max_new_tokens" if "max_new_tokens" in opts else "max_tokens"
        out["max_new_tokens"] = opts.pop("max_new_tokens", opts.pop("max_tokens", None))
        opts.pop("max_tokens", None)
    if "temperature" in opts:
        temperature = opts.pop("temperature")
        if is_number(temperature) and temperature == 0:
            out["do_sample"] = False  # 0 decodes greedily
        else:
            out.update(do_sample=True, temperature=temperature)
    if "stop" in opts:
        stop = opts.pop("stop")
        stops = [stop] if isinstance(stop, str) else stop
        out["stop"] = tuple(dict.fromkeys(stops)) if isinstance(stops, (list, tuple)) and all(
            isinstance(x, str) for x in stops) else stop
    unknown = sorted(set(opts) - fields)
    if unknown:
        raise UnknownOptionError(unknown, owner, {*STANDARD_OPTIONS, *fields}, f"Accepted: {', '.join(STANDARD_OPTIONS)} "
                                 f"and the method's config fields ({', '.join(sorted(fields))}).")
    out.update(opts)
    try:
        config.replace(**out)
    except InvalidOptionError as exc:
        if exc.option in written and written[exc.option] != exc.option:
            raise InvalidOptionError(written[exc.option], exc.value, exc.expected) from exc
        raise
    return out


def collect_method_options(data: Mapping[str, Any], known: set[str] | frozenset[str], method: Any,
                           owner: str, reserved: tuple[str, ...] = ()) -> dict[str, Any]:
    """Constructor keywords of an adapter → its fields, with method config fields moved into ``method_config``.

    ``ChatEnsemble(method="safe", lookahead=4)`` equals ``ChatEnsemble(method="safe",
    method_config={"lookahead": 4})``. ``known`` are the adapter's own field names;
    ``reserved`` config fields must be given as adapter fields instead. A name that is
    neither raises, so that a typo is never silently ignored.
    """
    extra = {k: v for k, v in data.items() if k not in known}
    if not extra:
        return dict(data)
    if not isinstance(method, str):
        raise InvalidOptionError("method", method, "a method name such as 'safe'")
    fields = config_fields_of(method) - set(reserved)
    unknown = sorted(set(extra) - fields)
    if unknown:
        raise UnknownOptionError(unknown, owner, {*known, *fields}, f"Options: {', '.join(sorted(known))}; "
                                 f"and the {method!r} config fields: {', '.join(sorted(fields))}.")
    method_config = dict(data.get("method_config") or {})
    for key, value in extra.items():
        if key in method_config and method_config[key] != value:
            raise ConfigurationError(f"{key!r} is given twice with different values (as a keyword and in method_config).")
        method_config[key] = value
    return {**{k: v for k, v in data.items() if k not in extra}, "method_config": method_config}


def config_fields(ensemble: Ensemble) -> frozenset[str]:
    """Names of the fields of ``ensemble``'s method config."""
    return frozenset(f.name for f in dataclasses.fields(ensemble.config))


def usage(result: GenerationResult) -> dict[str, Any]:
    """Token usage in OpenAI's key names (counted with the method's primary member's tokenizer), with the
    prompt tokens read from the primary member's prefix cache (``prompt_tokens_details.cached_tokens``)."""
    return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
            "total_tokens": result.total_tokens, "prompt_tokens_details": {"cached_tokens": result.cached_tokens}}


def result_info(result: GenerationResult, ensemble: Ensemble) -> dict[str, Any]:
    """What every adapter reports about how a response was made (its metadata / raw payload)."""
    return {
        "finish_reason": api_finish_reason(result.finish_reason, bool(result.tool_calls)),
        "stop_reason": result.finish_reason,
        "method": ensemble.method_name,
        "ensemble": ensemble.name,
        "members": [m.name for m in ensemble.members],
        "token_counter": ensemble.method.primary.name,
        "seconds": result.seconds,
        "time_to_first_chunk": result.time_to_first_chunk,
        "stats": result.stats.as_dict(),
    }


def freeze(value: Any) -> Hashable:
    """A hashable stand-in for a config value (dicts and lists by content, objects by identity)."""
    if isinstance(value, Mapping):
        return ("dict", tuple(sorted((str(k), freeze(v)) for k, v in value.items())))
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(freeze(v) for v in value))
    if isinstance(value, (set, frozenset)):
        return ("set", frozenset(freeze(v) for v in value))
    if isinstance(value, os.PathLike):
        return ("path", os.fspath(value))
    if isinstance(value, MemberSpec):  # by its fields: a dict device_map made the spec itself unhashable
        return ("spec", tuple((f.name, freeze(getattr(value, f.name))) for f in dataclasses.fields(value)))
    if isinstance(value, (str, int, float, bool, type(None))):
        return value
    return ("id", id(value))  # Member objects, torch dtypes (one object each), ...


def member_key(item: Any) -> Hashable:
    """Cache key of one member description; prebuilt objects are keyed by identity.

    The cached ensemble keeps those objects alive, so an id cannot be reused by another
    object while its entry exists.
    """
    if isinstance(item, Member):
        return ("member", id(item))
    if isinstance(item, tuple) and len(item) == 2:
        return ("pair", id(item[0]), id(item[1]))
    return freeze(item)


def shared_ensemble(members: Sequence[Any] | None, method: str, method_config: Mapping[str, Any] | None = None,
                    member_options: Mapping[str, Any] | None = None) -> Ensemble:
    """The process-wide ensemble for this description, built on first use.

    Built under a lock, so two threads asking for the same new ensemble build it once;
    errors (unknown alias, bad option) propagate and nothing is cached. Per-call settings
    (temperature, max tokens, stop) are not part of the key: pass them to :class:`Run`.
    """
    key = (None if members is None else tuple(member_key(m) for m in members), method,
           freeze(dict(method_config or {})), freeze(dict(member_options or {})))
    with _REGISTRY_LOCK:
        ensemble = _ENSEMBLES.get(key)
        if ensemble is None:
            ensemble = Ensemble(None if members is None else list(members), method=method,
                                member_options=dict(member_options) if member_options else None,
                                **dict(method_config or {}))
            _ENSEMBLES[key] = ensemble
            while len(_ENSEMBLES) > MAX_ENTRIES:
                _ENSEMBLES.popitem(last=False)
        else:
            _ENSEMBLES.move_to_end(key)
        return ensemble


def loaded_objects(members: Sequence[Any] | None, ensemble: Any = None) -> list[tuple[str, tuple[Any, ...]]]:
    """The loaded models an adapter's model object holds: (a description, the objects) for each.

    ``Member`` objects, ``(model, tokenizer)`` pairs and an ``ensemble=``: weights and running
    threads. A copy of the model object shares them (:func:`deepcopy_memo`); a pickle refuses them
    (:func:`reduce_by_constructor`). Names, paths and ``MemberSpec`` are descriptions, not models.
    """
    found: list[tuple[str, tuple[Any, ...]]] = []
    for item in members or ():
        if isinstance(item, Member):
            found.append((f"Member {item.name!r}", (item,)))
        elif isinstance(item, tuple):
            found.append((f"a ({type(item[0]).__name__}, tokenizer) pair", tuple(item)))
    if ensemble is not None:
        found.append(("ensemble=", (ensemble,)))
    return found


def deepcopy_memo(members: Sequence[Any] | None, *shared: Any, ensemble: Any = None) -> dict[int, Any]:
    """A ``copy.deepcopy`` memo under which the loaded models (and ``shared``) are kept, not copied.

    Why: a deep copy of a framework model object (pydantic's ``model_copy(deep=True)``, a framework
    copying a model it is given) must not duplicate gigabytes of weights, and cannot copy the locks and
    threads of a running ensemble; LangChain's hosted models share their HTTP clients the same way.
    """
    kept = [obj for _, objs in loaded_objects(members, ensemble) for obj in objs]
    kept += [obj for obj in shared if obj is not None]
    return {id(obj): obj for obj in kept}


def _rebuild(cls: type, values: Mapping[str, Any]) -> Any:
    return cls(**values)


def reduce_by_constructor(obj: Any, members: Sequence[Any] | None, ensemble: Any = None) -> tuple[Any, ...]:
    """``__reduce__`` of an adapter's model object (a pydantic model): the values it was built with, rebuilt by
    its constructor on load, where members given by name load once per process. Loaded members (or an
    ``ensemble=``) raise :class:`~ensemble_core.errors.NotPicklableError`: their weights and threads cannot travel."""
    loaded = loaded_objects(members, ensemble)
    if loaded:
        raise NotPicklableError(type(obj).__name__, [what for what, _ in loaded])
    return _rebuild, (type(obj), {name: getattr(obj, name) for name in obj.model_fields_set})


def clear_shared() -> None:
    """Forget every cached ensemble (loaded weights stay: see ``models.loading.clear_loaded``)."""
    with _REGISTRY_LOCK:
        _ENSEMBLES.clear()


def settle_calls(result: GenerationResult, prompt: Prompt, config: GenerationConfig) -> dict[str, Any] | None:
    """Drop from ``result`` the calls that repeat an answered call (``exclude_repeated_calls``, the default);
    return the options of the turn of its own in which the answer must be asked for (:func:`settle`), or
    None when the result stands.

    ``tool_choice="auto"``: the answer turn offers no tools (``tool_choice="none"``) when the reply holds
    no call and no text (or, under a schema, only text that is not its value, written before the
    repeated call), or, with a ``response_format`` next to the tools (LangChain's
    ``create_agent(..., response_format=Model)``), when it holds no call and is not a value of the schema.
    The second is rare since the lazy grammar holds such a reply to the value or calls
    (:mod:`ensemble_core.constraints.lazy`, "A value or calls"); it remains for text that left the rule
    (``lazy_tool_grammar=False``, text committed without the mask) and a value cut by the budget: the
    answer turn decodes under the schema's grammar from its first token.

    A forced call of any tool (``"required"``): a reply whose every call repeats an answered one would loop
    an agent that forces calls until one of them ends it (LangChain's ``create_agent(...,
    response_format=ToolStrategy(Model))`` offers the schema as one more tool under ``"any"``; the bundled
    members called ``multiply(12, 34)`` again until the recursion limit). The call is asked for again
    among the tools not repeated, still forced; when no other tool is left the repeat stands (a call is
    what the caller asked for). A forced call of one named tool is never asked again.
    """
    structured, request = result.structured, config.structured
    if not request.tools or structured is None:
        return None
    if request.choice == "required":
        return _forced_again(structured, prompt, request) if config.exclude_repeated_calls else None
    if request.choice != "auto":
        return None
    if config.exclude_repeated_calls:
        dropped = drop_repeated_calls(structured, prompt)
        if dropped and not structured.tool_calls and (not structured.content.strip() or (
                request.schema is not None and read_value(structured.content.strip(), request.schema).parse_error)):
            return {"tool_choice": "none"}  # nothing left, or only text before the repeat where a value was asked for
    if (request.schema is not None and not structured.tool_calls and not structured.invalid_tool_calls
            and not structured.repeated_tool_calls and structured.parse_error is not None):
        return {"tool_choice": "none"}
    return None


def _forced_again(structured: StructuredOutput, prompt: Prompt, request: Any) -> dict[str, Any] | None:
    """The options that force a call of another tool after a forced reply of repeats only (:func:`settle_calls`)."""
    dropped = drop_repeated_calls(structured, prompt)
    if not dropped or structured.tool_calls:
        return None
    repeated = {call.name for call in dropped}
    others = [{"type": "function", "function": tool} for tool in request.tools if tool["name"] not in repeated]
    if not others:  # only the repeated tools are offered: the repeat is the call the caller forced
        structured.tool_calls[:] = dropped
        del structured.repeated_tool_calls[-len(dropped):]
        return None
    return {"tools": others, "tool_choice": "required"}


def answer_request(run: Run, options: Mapping[str, Any]) -> Run:
    """The run that asks for the answer after a reply that only repeated answered calls (or, in ``auto``
    with a schema, was not its value).

    The same conversation, one more user turn (:data:`~ensemble_core.constraints.lazy.ANSWER_REQUEST`),
    the same options with ``options`` (:func:`settle_calls`'s) over them: in ``auto``
    ``tool_choice="none"`` (the tools are not offered and call-shaped text is masked): the bundled members
    answer there, where right after their own repeated call they wrote timestamps
    (:mod:`ensemble_core.constraints.lazy`); under a forced call, the tools not repeated.
    """
    messages = [*normalize_messages(run.stream.prompt), {"role": "user", "content": ANSWER_REQUEST}]
    return Run(run.ensemble, messages, {**run.overrides, **options}, run.timeout)


def answered(first: GenerationResult, answer: GenerationResult) -> GenerationResult:
    """One result for the two runs: the answer's text, finish and value (under a ``response_format``, the
    answer turn decodes under the schema's grammar: its ``parsed`` / ``parse_error``) or, where a call was
    forced, its calls; both runs' tokens and seconds, and the repeated calls of the first."""
    repeated = list(first.structured.repeated_tool_calls) if first.structured is not None else []
    value = answer.structured
    if value is not None and (value.tool_calls or value.invalid_tool_calls):
        structured = dataclasses.replace(value, repeated_tool_calls=[*repeated, *value.repeated_tool_calls])
    else:
        structured = StructuredOutput(answer.text, parsed=value.parsed if value else None,
                                      parse_error=value.parse_error if value else None, repeated_tool_calls=repeated)
    return dataclasses.replace(
        answer, prompt_tokens=first.prompt_tokens + answer.prompt_tokens,
        cached_tokens=first.cached_tokens + answer.cached_tokens,
        completion_tokens=first.completion_tokens + answer.completion_tokens, seconds=first.seconds + answer.seconds,
        structured=structured)


def settle(run: Run) -> GenerationResult:
    """A finished run's result as the adapters return it: repeated calls dropped, and, when nothing is left,
    the answer asked for in a turn of its own (:func:`answer_request`). Every non-streaming path reads
    its reply through it; :meth:`Run.replies` does the same while streaming."""
    result = run.result
    assert result is not None
    options = settle_calls(result, run.stream.prompt, run.stream.config)
    if options is None:
        return result
    return answered(result, answer_request(run, options).run())


async def asettle(run: Run) -> GenerationResult:
    """:func:`settle` with the answer generated in a worker thread."""
    result = run.result
    assert result is not None
    options = settle_calls(result, run.stream.prompt, run.stream.config)
    if options is None:
        return result
    return answered(result, await answer_request(run, options).arun())


@dataclasses.dataclass(frozen=True)
class ReplyChunk:
    """One piece of a reply as a framework shows it (see :meth:`Run.replies`).

    ``delta`` is the text to show now, ``text`` everything shown so far. ``calls`` are tool-call
    pieces to send now (:class:`~ensemble_core.constraints.structured.CallDelta`: a call's index,
    id and name once its name is written, then its arguments text as it is committed). The last
    chunk of a reply carries ``result`` (usage, stats, parsed tool calls): its ``text`` is the
    reply's final content (without the calls), its ``delta`` whatever of it was held back, and
    its ``calls`` the closing pieces (calls the stream did not see, whole; break text for a
    streamed call that did not parse).
    """

    delta: str
    text: str
    result: GenerationResult | None = None
    calls: tuple[CallDelta, ...] = ()

    @property
    def last(self) -> bool:
        return self.result is not None


@dataclasses.dataclass
class _Shown:
    """What one streamed reply has shown so far (shared by :meth:`Run.replies` and :meth:`Run.areplies`):
    content goes through ``hold`` (text that may still be a call waits), call pieces pass on."""

    hold: ReplyStream | None
    text: str = ""

    def reply(self, delta: str) -> ReplyChunk | None:
        """The chunk for one delta of the reply (None while everything in it is held back)."""
        piece, calls = self.hold.feed(delta) if self.hold is not None else (delta, [])
        if not (piece or calls):
            return None
        self.text += piece
        return ReplyChunk(piece, self.text, calls=tuple(calls))

    def answer(self, delta: str) -> ReplyChunk:
        """The chunk for one delta of the answer asked for after repeated calls (plain text, never held)."""
        self.text += delta
        return ReplyChunk(delta, self.text)


class Run:
    """One generation on a (shared) ensemble: iterate for text deltas; ``result`` at the end.

    Options are validated at construction. With batching on (the default) concurrent runs
    step at the same time and share forward passes (:mod:`ensemble_core.decoding.scheduler`);
    otherwise the ensemble's lock is held for each *round* (one step of the core stream),
    not for the whole generation: concurrent requests interleave round by round. Either
    way a stream abandoned half-way blocks nobody. ``timeout``
    sets the cancel event from a timer and the run then raises :class:`GenerationTimeout`;
    a run cancelled before its first round raises :class:`GenerationCancelled`; a run
    cancelled later ends with ``finish_reason == "cancelled"``.
    """

    def __init__(self, ensemble: Ensemble, prompt: Prompt, overrides: Mapping[str, Any] | None = None,
                 timeout: float | None = None) -> None:
        self.ensemble, self.timeout, self.overrides = ensemble, timeout, dict(overrides or {})
        self.cancel_event = threading.Event()
        self.stream = ensemble.stream(prompt, cancel=self.cancel_event, **self.overrides)
        self.timed_out = False
        self.result: GenerationResult | None = None
        self._iter: Iterator[str] | None = None

    @property
    def cancelled(self) -> bool:
        return self.cancel_event.is_set()

    def cancel(self) -> None:
        """Stop after the current round (idempotent; harmless once finished)."""
        self.cancel_event.set()

    def _on_deadline(self) -> None:
        self.timed_out = True
        self.cancel_event.set()

    def __iter__(self) -> Iterator[str]:
        if self._iter is None:
            self._iter = self._steps()
        return self._iter

    def _steps(self) -> Iterator[str]:
        timer = None
        if self.timeout is not None:
            timer = threading.Timer(self.timeout, self._on_deadline)
            timer.daemon = True
            timer.start()
        lock, deltas, started = self.ensemble.lock, iter(self.stream), False
        batched = getattr(self.ensemble.method, "batcher", None) is not None
        try:
            while True:
                if batched:  # requests run concurrently and share forward passes (ensemble_core.decoding.scheduler)
                    if self.cancelled and not started:
                        if self.timed_out:
                            raise GenerationTimeout(self.timeout or 0.0)
                        raise GenerationCancelled("The generation was cancelled while waiting to start.")
                    started = True
                    delta = next(deltas, None)
                    if delta is None:
                        break
                    yield delta
                    continue
                while not lock.acquire(timeout=LOCK_POLL_S):
                    if self.cancelled and not started:
                        if self.timed_out:
                            raise GenerationTimeout(self.timeout or 0.0)
                        raise GenerationCancelled("The generation was cancelled while waiting for the ensemble.")
                try:  # a run cancelled after its start still takes one (cheap) step: the core reports "cancelled"
                    started = True
                    delta = next(deltas, None)
                finally:
                    lock.release()
                if delta is None:
                    break
                yield delta
        finally:
            if timer is not None:
                timer.cancel()
            self.cancel_event.set()  # a consumer that stopped early also stops the core loop
        self.result = self.stream.result
        if self.timed_out and self.result is not None and self.result.finish_reason == "cancelled":
            raise GenerationTimeout(self.timeout or 0.0, self.result.text)
        assert self.result is not None

    def replies(self) -> Iterator[ReplyChunk]:
        """The reply as a framework streams it: content deltas, then one last chunk with the result.

        The one streaming loop of both adapters (LangChain's ``_stream``, LlamaIndex's
        ``stream_chat`` / ``stream_complete``). With tools, text that is, or may still become, a
        tool call is held back (:class:`~ensemble_core.constraints.structured.ReplyStream`) and
        the calls arrive with the last chunk. A consumer that stops early cancels the run.
        """
        shown = _Shown(ReplyStream.for_request(self.stream.config.structured))
        try:
            for delta in self:
                if (chunk := shown.reply(delta)) is not None:
                    yield chunk
        finally:
            self.close()
        answer = self._answer_run()
        if answer is not None:  # only repeated calls: the answer, asked for in a turn of its own
            for delta in answer:
                if not answer.calls_only:
                    yield shown.answer(delta)
            self._answered(answer)
        yield self._last_reply(shown, answered=answer is not None)

    async def areplies(self) -> AsyncIterator[ReplyChunk]:
        """:meth:`replies` with the model in a worker thread (the event loop stays free)."""
        shown = _Shown(ReplyStream.for_request(self.stream.config.structured))
        async with aclosing(self.astream()) as deltas:
            async for delta in deltas:
                if (chunk := shown.reply(delta)) is not None:
                    yield chunk
        answer = self._answer_run()
        if answer is not None:
            async with aclosing(answer.astream()) as deltas:
                async for delta in deltas:
                    if not answer.calls_only:
                        yield shown.answer(delta)
            self._answered(answer)
        yield self._last_reply(shown, answered=answer is not None)

    def _answer_run(self) -> Run | None:
        """The run that asks for the answer when the finished reply only repeated answered calls, else None."""
        assert self.result is not None
        options = settle_calls(self.result, self.stream.prompt, self.stream.config)
        return None if options is None else answer_request(self, options)

    def _answered(self, answer: Run) -> None:
        assert self.result is not None and answer.result is not None
        self.result = answered(self.result, answer.result)

    def _last_reply(self, shown: _Shown, answered: bool = False) -> ReplyChunk:
        """The closing chunk of a settled result (:func:`settle_calls`). ``answered``: the final text is the
        answer asked for after repeated calls (already streamed), not the reply's own; the pieces of a
        streamed repeated call are then broken like any call that did not parse."""
        result, hold = self.result, shown.hold
        assert result is not None
        if hold is None:
            return ReplyChunk("", shown.text, result)
        calls = tuple(hold.finish(result.structured))
        if answered and result.structured is not None and (result.structured.tool_calls
                                                           or result.structured.invalid_tool_calls):
            return ReplyChunk("", shown.text, result, calls)  # the answer turn forced a call: its pieces, no text
        if not answered:
            content = hold.content(result.text, result.structured)
            return ReplyChunk(hold.rest(content), content, result, calls)
        content = result.text
        return ReplyChunk(content[len(shown.text):] if content.startswith(shown.text) else "", content, result, calls)

    @property
    def calls_only(self) -> bool:
        """Whether the reply can only be calls (a forced call): its text is never content."""
        return self.stream.config.structured.forced_call

    def run(self) -> GenerationResult:
        """Generate to the end (blocking) and return the result."""
        self.stream.drained = True
        for _ in self:
            pass
        assert self.result is not None
        return self.result

    def close(self) -> None:
        """Cancel and stop iterating now (a sync consumer that stops early)."""
        self.cancel()
        if self._iter is not None:
            self._iter.close()

    async def astream(self) -> AsyncIterator[str]:
        """The same deltas, produced in a worker thread so that the event loop stays free.

        Closing this iterator early or cancelling the task that awaits it cancels the run;
        the worker stops after the round it is in.
        """
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()

        def post(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (kind, value))
            except RuntimeError:  # the loop was closed: nobody is listening any more
                self.cancel()

        def work() -> None:
            # this thread hands each delta to the queue and goes on: the request stays active for the
            # batcher (a pause per delta let passes start without it: the server's eight concurrent SAFE
            # requests ran 4.3 rows per pass instead of Ensemble.batch's 6.6)
            self.stream.drained = True
            try:  # a drained stream in a thread of its own: its passes run on the model runner (decoding.runner)
                for delta in self:
                    post("delta", delta)
            except BaseException as exc:  # handed to the awaiting task, re-raised there
                post("error", exc)
            else:
                post("done", None)

        threading.Thread(target=work, name="ensemble-generation", daemon=True).start()
        try:
            while True:
                kind, value = await queue.get()
                if kind == "delta":
                    yield value
                elif kind == "error":
                    raise value
                else:
                    return
        finally:
            self.cancel()

    async def arun(self) -> GenerationResult:
        """Generate to the end in a worker thread; cancelling the awaiting task cancels the run."""
        async with aclosing(self.astream()) as deltas:
            async for _ in deltas:
                pass
        assert self.result is not None
        return self.result
