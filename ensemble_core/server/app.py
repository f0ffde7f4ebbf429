"""The FastAPI application: OpenAI's chat / completions / models endpoints over one ensemble.

:func:`create_app` builds it around a loaded :class:`~ensemble_core.Ensemble` or a
``load`` callable that runs in a background thread at startup (``/health`` and every other
endpoint answer 503 until it returns). Per request:

1. ``Authorization: Bearer`` (401), loading (503), the body, read with a size limit (413),
   parsed strictly (400), the model name (404), the fields (400, :func:`plan`);
2. the messages are checked by the core's message policy and the options mapped by its
   option policy (:func:`~ensemble_core.serving.runtime.call_overrides`), then
   :meth:`Engine.start <ensemble_core.server.engine.Engine.start>` starts the generation;
3. the answer is sent whole or as server-sent events. A client that goes away cancels its
   generation (a watcher task listens for ``http.disconnect``; a closed event stream does
   the same), and the others carry on.

Every error is OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``; see
``docs/serving.md`` for the table. Anything unexpected is a logged 500, never a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ensemble_core.constraints.structured import CallDelta, reply_content
from ensemble_core.decoding.generation import GenerationResult
from ensemble_core.ensemble import Ensemble
from ensemble_core.errors import (
    ApiError,
    ClientDisconnected,
    ConfigurationError,
    EnsembleError,
    GenerationCancelled,
    GenerationTimeout,
    InputError,
    InvalidOptionError,
    PromptTooLongError,
    UnsupportedContentError,
    UnsupportedParameterError,
)
from ensemble_core.server.engine import Engine, Generation, LoadingState
from ensemble_core.server.protocol import (
    DEFAULT_MAX_BODY_BYTES,
    IGNORED,
    NEUTRAL_ONLY,
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChunkChoice,
    ChunkDelta,
    CompletionChoice,
    CompletionRequest,
    EnsembleInfo,
    ModelCard,
    ModelList,
    SamplingFields,
    TextCompletion,
    Usage,
    new_id,
    now,
)
from ensemble_core.serving.runtime import Run, api_finish_reason, asettle, call_overrides, result_info, usage
from ensemble_core.text.chat import normalize_messages

log = logging.getLogger("ensemble_core.server")

#: Standard options that have their own top-level field: not accepted inside the ``ensemble`` extension.
TOP_LEVEL_OPTIONS = frozenset({"temperature", "max_tokens", "max_new_tokens", "top_p", "seed", "stop", "do_sample",
                               "tools", "tool_choice", "response_format", "parallel_tool_calls"})
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
#: openai-python retries 408/409/429/5xx unless told not to: a deterministic failure would only repeat.
NO_RETRY = {"x-should-retry": "false"}

M = TypeVar("M", bound=BaseModel)


# ----------------------------------------------------------------------------- errors
def error_response(err: ApiError) -> JSONResponse:
    """The HTTP answer of an :class:`~ensemble_core.errors.ApiError`."""
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def api_error(exc: BaseException, input_param: str = "messages") -> ApiError:
    """The answer for an exception raised while handling a request (see the table in docs/serving.md)."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, UnsupportedParameterError):
        return ApiError(400, str(exc), param=exc.param, code="unsupported_parameter")
    if isinstance(exc, PromptTooLongError):  # OpenAI's words, in the request's names (the core's say max_new_tokens)
        where = "prompt" if input_param == "prompt" else "messages"
        return ApiError(400, f"This model's maximum context length is {exc.window} tokens (member {exc.member!r}). "
                             f"However, you requested {exc.prompt_tokens + exc.max_new_tokens} tokens ({exc.prompt_tokens} "
                             f"in the {where}, {exc.max_new_tokens} in the completion: max_tokens). Please reduce the "
                             f"length of the {where} or max_tokens.", param=input_param, code="context_length_exceeded")
    if isinstance(exc, UnsupportedContentError):
        return ApiError(400, str(exc), param=input_param, code="unsupported_content")
    if isinstance(exc, InputError):
        return ApiError(400, str(exc), param=exc.param or input_param, code="invalid_value")
    if isinstance(exc, InvalidOptionError):
        return ApiError(400, str(exc), param=exc.option, code="invalid_value")
    if isinstance(exc, ConfigurationError):
        return ApiError(400, str(exc), code="invalid_value")
    if isinstance(exc, GenerationTimeout):
        return ApiError(504, str(exc), type="timeout_error", code="timeout", headers=NO_RETRY)
    if isinstance(exc, GenerationCancelled):
        return ApiError(503, str(exc), type="server_error", code="cancelled")
    if isinstance(exc, EnsembleError):
        log.error("Request failed: %s", exc)
        return ApiError(500, str(exc), type="server_error", code="ensemble_error", headers=NO_RETRY)
    log.error("Unexpected error while handling a request", exc_info=exc)
    return ApiError(500, f"Internal server error ({type(exc).__name__}); see the server log.", type="server_error",
                    code="internal_error", headers=NO_RETRY)


def validation_error(exc: ValidationError) -> ApiError:
    """A strict-parsing failure as OpenAI words it (first problem; ``param`` names the field)."""
    err = exc.errors()[0]
    kind, loc = err["type"], [str(x) for x in err["loc"]]
    if kind == "json_invalid":
        return ApiError(400, f"We could not parse the JSON body of your request: {err['msg']}. Send a JSON object "
                             "with Content-Type: application/json.", code="invalid_json")
    if not loc:
        return ApiError(400, f"The request body must be a JSON object ({err['msg']}).", code="invalid_type")
    param = ".".join(loc[:2]) if loc[0] == "stream_options" and len(loc) > 1 else loc[0]
    if kind == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {param}", param=param, code="unknown_parameter")
    if kind == "missing":
        return ApiError(400, f"Missing required parameter: '{param}'.", param=param, code="missing_required_parameter")
    got = type(err.get("input")).__name__
    more = f" (and {len(exc.errors()) - 1} more problem(s) with this value)" if len(exc.errors()) > 1 else ""
    return ApiError(400, f"Invalid type for '{param}': {err['msg']}; got {got}{more}.", param=param, code="invalid_type")


def loading_error(state: LoadingState) -> ApiError:
    if state.error is not None:
        return ApiError(503, f"The ensemble failed to load: {state.error}", type="server_error",
                        code="model_load_failed", headers=NO_RETRY)
    waited = time.time() - state.started_at
    return ApiError(503, f"The ensemble is loading ({waited:.0f} s so far); retry in a moment.", type="server_error",
                    code="model_loading", headers={"Retry-After": "2"})


# ----------------------------------------------------------------------------- request planning
@dataclass
class Plan:
    """What one request asks for, checked: the core prompt, options, streaming."""

    model: str
    prompt: Any
    overrides: dict[str, Any]
    features: dict[str, Any]
    stream: bool
    include_usage: bool
    #: A request with tools: its stream goes through :meth:`Run.areplies` (content held back where it may
    #: be a call, tool calls as ``delta.tool_calls`` pieces while decoded), its answer through the
    #: repeated-call rule (:func:`~ensemble_core.serving.runtime.settle_calls`).
    buffered: bool = False


def check_neutral(request: SamplingFields) -> None:
    """400 for ``n != 1`` and for unsupported fields set to anything but their neutral value."""
    if request.n is not None and request.n != 1:
        raise ApiError(400, f"n={request.n} is not supported: the ensemble returns one choice per request (n=1).",
                       param="n", code="unsupported_value")
    for name, (neutral, why) in NEUTRAL_ONLY.items():
        if name in type(request).model_fields and not neutral(getattr(request, name)):
            raise UnsupportedParameterError(name, why)
    if request.stream_options is not None and not request.stream:
        raise ApiError(400, "The 'stream_options' parameter is only allowed when 'stream' is true.",
                       param="stream_options", code="invalid_value")


def options(request: SamplingFields, engine: Engine, max_tokens: int | None) -> dict[str, Any]:
    """Standard fields + the ``ensemble`` extension → core overrides (the core's option policy)."""
    extension = dict(request.ensemble or {})
    clash = sorted(TOP_LEVEL_OPTIONS & set(extension))
    if clash:
        field = {"do_sample": "temperature", "max_new_tokens": "max_tokens"}.get(clash[0], clash[0])
        raise ApiError(400, f"ensemble.{clash[0]}: pass this option as the top-level field '{field}', not inside "
                            "'ensemble'.", param=f"ensemble.{clash[0]}", code="invalid_value")
    unknown = sorted(set(extension) - engine.fields)
    if unknown:
        raise ApiError(400, f"Unknown ensemble option {unknown[0]!r} for method {engine.ensemble.method_name!r}. "
                            f"Accepted: {', '.join(sorted(engine.fields - TOP_LEVEL_OPTIONS))}.",
                       param=f"ensemble.{unknown[0]}", code="unknown_parameter")
    standard = {"temperature": request.temperature, "max_tokens": max_tokens, "top_p": request.top_p,
                "seed": request.seed, "stop": request.stop,
                "parallel_tool_calls": getattr(request, "parallel_tool_calls", None)}  # a chat field
    return call_overrides({**standard, **extension}, engine.ensemble.config, "the server")


def plan_chat(request: ChatCompletionRequest, engine: Engine, model: str) -> Plan:
    check_neutral(request)
    if request.max_tokens is not None and request.max_completion_tokens is not None \
            and request.max_tokens != request.max_completion_tokens:
        raise ApiError(400, f"max_tokens={request.max_tokens} and max_completion_tokens={request.max_completion_tokens} "
                            "name one limit; pass one of them.", param="max_completion_tokens", code="invalid_value")
    max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    tools = request.tools or None
    choice = None if tools is None and request.tool_choice in ("auto", "none") else request.tool_choice
    features = engine.generate_keywords({"tools": tools, "tool_choice": choice,
                                         "response_format": _unless_text(request.response_format)})
    overrides = options(request, engine, max_tokens)
    normalize_messages(request.messages)  # the core's message policy: bad messages are a 400 before anything runs
    buffered = bool(features.get("tools")) and features.get("tool_choice") != "none"
    return Plan(model, request.messages, overrides, features, bool(request.stream), _include_usage(request), buffered)


def plan_completion(request: CompletionRequest, engine: Engine, model: str) -> Plan:
    check_neutral(request)
    prompt = request.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise ApiError(400, "'prompt' must be a string or a list of exactly one string (batches and token "
                                "arrays are not supported).", param="prompt", code="unsupported_value")
        prompt = prompt[0]
    overrides = options(request, engine, request.max_tokens)
    normalize_messages(prompt)
    return Plan(model, prompt, overrides, {}, bool(request.stream), _include_usage(request))


def _unless_text(response_format: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """``{"type": "text"}`` is the neutral response format."""
    return None if not response_format or response_format.get("type") == "text" else response_format


def _include_usage(request: SamplingFields) -> bool:
    return bool(request.stream and request.stream_options and request.stream_options.include_usage)


# ----------------------------------------------------------------------------- response shapes
def ensemble_info(result: GenerationResult, ensemble: Ensemble) -> EnsembleInfo:
    """The ``ensemble`` extension field: how the answer was made, and calls or values that did not check out.

    OpenAI's ``message`` has no place for a call that cannot run, so the validator's errors
    (``invalid_tool_calls``, ``parse_error``) travel here.
    """
    info = result_info(result, ensemble)
    structured = getattr(result, "structured", None)
    invalid = list(structured.invalid_tool_calls) if structured is not None else []
    return EnsembleInfo(name=info["ensemble"], method=info["method"], members=info["members"],
                        token_counter=info["token_counter"], stop_reason=info["stop_reason"], seconds=info["seconds"],
                        time_to_first_chunk=info["time_to_first_chunk"], stats=info["stats"],
                        invalid_tool_calls=invalid or None, parse_error=getattr(structured, "parse_error", None))


def tool_calls(result: GenerationResult) -> list[dict[str, Any]] | None:
    """The tool calls of a result in OpenAI's shape (``arguments`` as a JSON string), or None.

    Reads ``result.tool_calls``: the core's ``ToolCall`` objects (``as_dict()``) or
    ``{"id", "name", "arguments": dict}`` mappings.
    """
    calls = getattr(result, "tool_calls", None)
    if not calls:
        return None
    out = []
    for call in calls:
        c = call.as_dict() if hasattr(call, "as_dict") else dict(call)
        out.append({"id": c.get("id") or new_id("call"), "type": "function",
                    "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}})
    return out


def content(result: GenerationResult) -> str:
    """The reply's text: without the tool-call JSON when the core read calls out of it.

    A reply whose calls are all invalid keeps its whole text (as the adapters do): the client
    sees what the model wrote; ``ensemble.invalid_tool_calls`` says why it did not run.
    """
    return reply_content(result.text, getattr(result, "structured", None))


def finish_reason(result: GenerationResult) -> str:
    """``tool_calls`` when the reply has calls that may run, else ``stop`` / ``length`` (as :func:`result_info` says).

    Only invalid calls finish ``stop``: OpenAI's clients and agent loops read ``tool_calls``
    on that reason and would find none; the errors are in the ``ensemble`` field.
    """
    return api_finish_reason(result.finish_reason, bool(tool_calls(result)))


def sse(model: BaseModel | str, drop: set[str] | None = None) -> str:
    data = model if isinstance(model, str) else model.model_dump_json(exclude=drop or None)
    return f"data: {data}\n\n"


class ChatFormat:
    """``chat.completion`` and ``chat.completion.chunk`` bodies for one request."""

    def __init__(self, model: str, ensemble: Ensemble, include_usage: bool) -> None:
        self.id, self.created, self.model, self.ensemble = new_id("chatcmpl"), now(), model, ensemble
        self.drop = set() if include_usage else {"usage"}

    def _chunk(self, choices: list[ChunkChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def start(self) -> str:
        return sse(self._chunk([ChunkChoice(delta=ChunkDelta(role="assistant", content=""))]), self.drop | {"ensemble"})

    def delta(self, text: str) -> str:
        return sse(self._chunk([ChunkChoice(delta=ChunkDelta(content=text))]), self.drop | {"ensemble"})

    def finish(self, result: GenerationResult) -> str:
        return sse(self._chunk([ChunkChoice(delta=ChunkDelta(), finish_reason=finish_reason(result))],
                               ensemble=ensemble_info(result, self.ensemble)), self.drop)

    def usage(self, result: GenerationResult) -> str:
        return sse(self._chunk([], usage=Usage(**usage(result))), {"ensemble"})

    def call_deltas(self, calls: Sequence[CallDelta]) -> str | None:
        """Tool-call pieces as OpenAI streams them: ``delta.tool_calls[i]`` with ``index``; a call's first
        piece has its ``id``, ``type`` and ``function.name``, the next ones ``function.arguments`` text
        that the client appends (a call that did not parse ends in text no JSON reader accepts, and
        the finish reason is not ``tool_calls``: see ``CallDelta``)."""
        items = []
        for c in calls:
            item: dict[str, Any] = {"index": c.index}
            if c.id is not None:
                item.update(id=c.id, type="function")
            function: dict[str, Any] = {"arguments": c.arguments}
            if c.name is not None:
                function["name"] = c.name
            item["function"] = function
            items.append(item)
        if not items:
            return None
        return sse(self._chunk([ChunkChoice(delta=ChunkDelta(tool_calls=items))]), self.drop | {"ensemble"})

    def buffered(self, result: GenerationResult) -> list[str]:
        """A complete answer as chunks: its text, then its tool calls (as OpenAI streams them, with an index)."""
        out = [self.delta(content(result))] if content(result) else []
        calls = tool_calls(result)
        if calls:
            delta = ChunkDelta(tool_calls=[{"index": i, **c} for i, c in enumerate(calls)])
            out.append(sse(self._chunk([ChunkChoice(delta=delta)]), self.drop | {"ensemble"}))
        return out

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        calls = tool_calls(result)
        message = AssistantMessage(content=content(result) if not calls or content(result) else None, tool_calls=calls)
        return ChatCompletion(id=self.id, created=self.created, model=self.model,
                              choices=[ChatChoice(message=message, finish_reason=finish_reason(result))],
                              usage=Usage(**usage(result)), ensemble=ensemble_info(result, self.ensemble)).model_dump()


class CompletionFormat:
    """``text_completion`` bodies (whole and streamed) for one request."""

    def __init__(self, model: str, ensemble: Ensemble, include_usage: bool) -> None:
        self.id, self.created, self.model, self.ensemble = new_id("cmpl"), now(), model, ensemble
        self.drop = set() if include_usage else {"usage"}

    def _body(self, choices: list[CompletionChoice], **extra: Any) -> TextCompletion:
        return TextCompletion(id=self.id, created=self.created, model=self.model, choices=choices, **extra)

    def start(self) -> str | None:
        return None

    def delta(self, text: str) -> str:
        return sse(self._body([CompletionChoice(text=text)]), self.drop | {"ensemble"})

    def buffered(self, result: GenerationResult) -> list[str]:
        return [self.delta(result.text)] if result.text else []

    def finish(self, result: GenerationResult) -> str:
        return sse(self._body([CompletionChoice(text="", finish_reason=finish_reason(result))],
                              ensemble=ensemble_info(result, self.ensemble)), self.drop)

    def usage(self, result: GenerationResult) -> str:
        return sse(self._body([], usage=Usage(**usage(result))), {"ensemble"})

    def whole(self, result: GenerationResult) -> dict[str, Any]:
        return self._body([CompletionChoice(text=result.text, finish_reason=finish_reason(result))],
                          usage=Usage(**usage(result)), ensemble=ensemble_info(result, self.ensemble)).model_dump()


# ----------------------------------------------------------------------------- disconnects
class DisconnectWatcher:
    """Listens for ``http.disconnect`` while a request is being answered; cancels its generation then.

    Starlette's event stream also stops on a disconnect (which closes our event generator),
    but only when it notices it; this task notices it at once, for whole answers as well.
    """

    def __init__(self, request: Request, generation: Generation, engine: Engine, request_id: str) -> None:
        self.request, self.generation, self.engine, self.request_id = request, generation, engine, request_id
        self.finished = False
        self.gone = False
        self.task = asyncio.create_task(self._watch())

    async def _watch(self) -> None:
        try:
            while (await self.request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # a connection that cannot be read from any more is gone as well
            pass
        self.client_gone()

    def client_gone(self) -> None:
        """Cancel the generation of a client that went away (once; not after the answer was complete)."""
        if self.finished or self.gone:
            return
        self.gone = True
        self.generation.cancel()
        self.engine.client_gone()
        log.info("%s: client gone (disconnected, or the server is stopping); generation cancelled", self.request_id)

    def done(self) -> None:
        self.finished = True
        self.task.cancel()

    async def guard(self, awaitable: Awaitable[Any]) -> Any:
        """Await ``awaitable`` unless the client leaves first (then cancel it and raise :class:`ClientDisconnected`)."""
        work = asyncio.ensure_future(awaitable)
        try:
            await asyncio.wait({work, self.task}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            work.cancel()
            raise
        if work.done():
            return work.result()
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        raise ClientDisconnected()


async def _first(deltas: AsyncIterator[str]) -> str | None:
    """The first delta, or None when the generation ended without text (errors propagate)."""
    try:
        return await deltas.__anext__()
    except StopAsyncIteration:
        return None


async def _drain(deltas: AsyncIterator[str]) -> None:
    async for _ in deltas:
        pass


async def answer(request: Request, engine: Engine, plan: Plan, fmt: ChatFormat | CompletionFormat,
                 input_param: str) -> Response:
    """Run the generation and answer whole or as server-sent events."""
    generation = engine.start(plan.prompt, plan.overrides, plan.features)
    watcher = DisconnectWatcher(request, generation, engine, fmt.id)
    replies = plan.stream and plan.buffered and isinstance(fmt, ChatFormat) and hasattr(generation, "areplies")
    deltas = generation.areplies() if replies else generation.astream()  # type: ignore[attr-defined]
    try:
        if not plan.stream or (plan.buffered and not replies):
            await watcher.guard(_drain(deltas))
            result = await watcher.guard(_settled(generation))
            watcher.done()
            if plan.stream:
                return StreamingResponse(buffered_events(result, fmt, plan.include_usage),
                                         media_type="text/event-stream", headers=SSE_HEADERS)
            return JSONResponse(fmt.whole(result))
        # the first delta (or the end) before the status line: errors in the first round (a prompt too
        # long for a member's window...) are still a proper error status, not an event in a 200 stream
        first = await watcher.guard(_first(deltas))
    except ClientDisconnected:
        return Response(status_code=499)  # nobody reads it
    except BaseException:
        watcher.done()
        generation.cancel()
        raise
    return StreamingResponse(events(generation, deltas, first, fmt, watcher, plan.include_usage, input_param),
                             media_type="text/event-stream", headers=SSE_HEADERS)


async def _settled(generation: Generation) -> GenerationResult:
    """The finished result as every adapter returns it: calls that repeat an answered call dropped, and then,
    when nothing is left, the answer asked for (:func:`~ensemble_core.serving.runtime.asettle`)."""
    result = generation.result
    assert result is not None
    return await asettle(generation) if isinstance(generation, Run) else result


async def buffered_events(result: GenerationResult, fmt: ChatFormat | CompletionFormat,
                          include_usage: bool) -> AsyncIterator[str]:
    """The event stream of an answer that is already complete (requests with tools)."""
    for event in [fmt.start(), *fmt.buffered(result), fmt.finish(result), fmt.usage(result) if include_usage else None,
                  sse("[DONE]")]:
        if event is not None:
            yield event


async def events(generation: Generation, deltas: AsyncIterator[str], first: str | None, fmt: ChatFormat | CompletionFormat,
                 watcher: DisconnectWatcher, include_usage: bool, input_param: str) -> AsyncIterator[str]:
    """The event stream: role chunk, deltas, the finishing chunk, the usage chunk, ``[DONE]``.

    An error after the status line is sent as ``data: {"error": {...}}`` (OpenAI's clients
    raise it). If the stream is closed or cancelled before its end, the client is gone.
    """
    complete = False
    try:
        start = fmt.start()
        if start is not None:
            yield start
        async for event in _delta_events(first, deltas, fmt):
            yield event
        result = generation.result
        assert result is not None
        complete = True
        watcher.done()
        yield fmt.finish(result)
        if include_usage:
            yield fmt.usage(result)
        yield sse("[DONE]")
    except Exception as exc:  # not CancelledError / GeneratorExit: those mean the client is gone
        complete = True
        watcher.done()
        err = api_error(exc, input_param)
        log.info("%s: stream ended with an error: %s", fmt.id, err.message)
        yield sse(json.dumps(err.body()))
        yield sse("[DONE]")
    finally:
        if not complete:
            watcher.client_gone()
        watcher.done()
        generation.cancel()


async def _delta_events(first: Any, deltas: AsyncIterator[Any], fmt: ChatFormat | CompletionFormat) -> AsyncIterator[str]:
    """The events of the deltas: text deltas, or (a request with tools) :class:`ReplyChunk`s: content, then
    tool-call pieces (the last chunk's settled content and closing pieces included)."""
    async def all_deltas() -> AsyncIterator[Any]:
        if first is not None:
            yield first
        async for delta in deltas:
            yield delta

    async for delta in all_deltas():
        if isinstance(delta, str):
            yield fmt.delta(delta)
            continue
        if delta.delta:
            yield fmt.delta(delta.delta)
        calls = fmt.call_deltas(delta.calls) if isinstance(fmt, ChatFormat) else None
        if calls is not None:
            yield calls


def batching_counters(ensemble: Ensemble) -> dict[str, Any] | None:
    """The batcher's counters since start (None with batching off): how many rows a pass served is
    what says whether concurrent requests share their passes (``rows / model_calls``)."""
    batcher = getattr(ensemble.method, "batcher", None)
    return None if batcher is None else batcher.stats.as_dict()


# ----------------------------------------------------------------------------- the app
def create_app(ensemble: Ensemble | None = None, *, load: Callable[[], Ensemble] | None = None,
               served_model_names: Sequence[str] = (), api_key: str | None = None,
               max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, timeout: float | None = None) -> FastAPI:
    """An OpenAI-compatible app serving ``ensemble`` (or what ``load()`` returns, loaded in the background).

    ``served_model_names`` are accepted in ``model`` besides the ensemble's name
    (``safe(smollm2-135m-instruct+gemma3-270m)``); ``api_key`` enables ``Authorization:
    Bearer`` checks on ``/v1/*``; ``timeout`` (seconds) bounds each generation.
    """
    if (ensemble is None) == (load is None):
        raise ConfigurationError("create_app: pass either a loaded ensemble or a load() callable, not both / neither.")
    state = LoadingState()
    if ensemble is not None:
        state.load(lambda: ensemble, timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if load is not None and not state.done.is_set():
            threading.Thread(target=state.load, args=(load, timeout), name="ensemble-load", daemon=True).start()
        yield
        if state.engine is not None:  # generations still running once the connections closed (see Engine.stop_all)
            state.engine.stop_all()

    app = FastAPI(title="ensemble_core OpenAI-compatible server", lifespan=lifespan)
    app.state.loading = state

    def model_names(engine: Engine) -> list[str]:
        return list(dict.fromkeys([engine.ensemble.name, *served_model_names]))

    def ready(request: Request) -> Engine:
        """Authorised and loaded, or an ApiError."""
        if api_key is not None:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise ApiError(401, "You didn't provide an API key. Send it in the Authorization header "
                                    "(Authorization: Bearer YOUR_KEY).", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
            if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
                raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key",
                               headers={"WWW-Authenticate": "Bearer"})
        if state.engine is None:
            raise loading_error(state)
        return state.engine

    def resolve_model(engine: Engine, requested: str | None) -> str:
        names = model_names(engine)
        if requested is None:
            return names[0]
        if requested not in names:
            raise ApiError(404, f"The model '{requested}' does not exist. This server serves "
                                f"{', '.join(repr(n) for n in names)} (GET /v1/models).", param="model",
                           code="model_not_found")
        return requested

    async def read(request: Request, schema: type[M]) -> M:
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > max_body_bytes):
            if not length.isdigit():
                raise ApiError(400, f"Invalid Content-Length header: {length!r}.", code="invalid_value")
            raise _too_large(int(length), max_body_bytes)
        body, size = bytearray(), 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise _too_large(size, max_body_bytes)
            body += chunk
        try:
            return schema.model_validate_json(bytes(body))
        except ValidationError as exc:
            raise validation_error(exc) from None

    def endpoint(handler: Callable[[Request], Awaitable[Response]], input_param: str = "messages") \
            -> Callable[[Request], Awaitable[Response]]:
        @functools.wraps(handler)
        async def wrapped(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientDisconnect:  # gone while sending its body: nothing started, nobody to answer
                return Response(status_code=499)
            except Exception as exc:
                return error_response(api_error(exc, input_param))
        return wrapped

    @app.get("/health")
    @endpoint
    async def health(request: Request) -> Response:
        """200 with the counters once loaded; 503 (error shape) while loading or after a failed load."""
        if state.engine is None:
            raise loading_error(state)
        engine = state.engine
        return JSONResponse({"status": "ok", "model": engine.ensemble.name, "models": model_names(engine),
                             "method": engine.ensemble.method_name, "members": [m.name for m in engine.ensemble.members],
                             "features": sorted(engine.core_features),
                             "load_seconds": state.load_seconds, "uptime_seconds": round(time.time() - state.started_at, 3),
                             "requests": engine.snapshot(), "batching": batching_counters(engine.ensemble)})

    @app.get("/v1/models")
    @endpoint
    async def models(request: Request) -> Response:
        engine = ready(request)
        root = engine.ensemble.name
        created = int(state.started_at)
        return JSONResponse(ModelList(data=[ModelCard(id=n, created=created, root=root)
                                            for n in model_names(engine)]).model_dump())

    @app.get("/v1/models/{name:path}")
    @endpoint
    async def model(request: Request) -> Response:
        engine = ready(request)
        name = resolve_model(engine, request.path_params["name"])
        return JSONResponse(ModelCard(id=name, created=int(state.started_at), root=engine.ensemble.name).model_dump())

    @app.post("/v1/chat/completions")
    @endpoint
    async def chat_completions(request: Request) -> Response:
        engine = ready(request)
        body = await read(request, ChatCompletionRequest)
        plan = plan_chat(body, engine, resolve_model(engine, body.model))
        return await answer(request, engine, plan, ChatFormat(plan.model, engine.ensemble, plan.include_usage), "messages")

    async def completions_handler(request: Request) -> Response:
        engine = ready(request)
        body = await read(request, CompletionRequest)
        plan = plan_completion(body, engine, resolve_model(engine, body.model))
        return await answer(request, engine, plan, CompletionFormat(plan.model, engine.ensemble, plan.include_usage),
                            "prompt")

    app.post("/v1/completions")(endpoint(completions_handler, "prompt"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return error_response(ApiError(exc.status_code, f"{exc.detail}: {request.method} {request.url.path}", code=code))

    @app.exception_handler(RequestValidationError)
    async def request_error(request: Request, exc: RequestValidationError) -> Response:
        return error_response(ApiError(400, f"Invalid request: {exc.errors()[:1]}", code="invalid_type"))

    return app


def _too_large(size: int, limit: int) -> ApiError:
    return ApiError(413, f"The request body is larger than this server accepts ({size} > {limit} bytes; see "
                         "--max-body-bytes).", code="request_too_large", headers=NO_RETRY)


__all__ = ["ApiError", "DEFAULT_MAX_BODY_BYTES", "IGNORED", "create_app"]
