"""Requests and responses of the server, in the shapes of OpenAI's API.

Requests are parsed **strictly** (:data:`STRICT`): a JSON number where a string is expected,
``"10"`` for ``max_tokens`` or ``true`` for ``n`` is a 400, never converted, and a field
OpenAI's API does not have is a 400 ``unknown_parameter`` (as OpenAI answers
``Unrecognized request argument supplied``), so that a typo never silently changes nothing.
Fields OpenAI's API has but the ensemble cannot honour are accepted at their neutral value
only (:data:`NEUTRAL_ONLY`) or ignored when they carry no generation semantics
(:data:`IGNORED`); see ``docs/serving.md``.

Responses carry one extension field, ``ensemble`` (:class:`EnsembleInfo`): how the answer
was made (method, members, the method's statistics, timings). OpenAI's client libraries
keep unknown fields, e.g. ``completion.model_extra["ensemble"]`` in ``openai``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

#: Request models: no coercion, no unknown fields.
STRICT = ConfigDict(extra="forbid", strict=True)

#: Largest request body accepted unless ``--max-body-bytes`` says otherwise (1 MiB).
DEFAULT_MAX_BODY_BYTES = 1 << 20


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorDetail


# ----------------------------------------------------------------------------- requests
class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool | None = None
    #: OpenAI pads chunks against side channels; nothing to hide on a local server: accepted, ignored.
    include_obfuscation: bool | None = None


class SamplingFields(BaseModel):
    """Fields the chat and the completions endpoints share."""

    model_config = STRICT

    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    #: Extension: method options (the method config's fields, e.g. ``{"lookahead": 3}``).
    ensemble: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. Messages are checked by the core (``ensemble_core.text.chat``)."""

    messages: list[Any]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    # OpenAI fields without generation semantics here (accepted, ignored) or only neutral values
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is one user message (the core's completion semantics)."""

    prompt: str | list[Any]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


def _neutral_none(value: Any) -> bool:
    return value is None


def _neutral_zero(value: Any) -> bool:
    return value is None or value == 0


#: Fields accepted only at these values: ``name → (is neutral, what to say)``.
NEUTRAL_ONLY: dict[str, tuple[Any, str]] = {
    "presence_penalty": (_neutral_zero, "only 0 is supported"),
    "frequency_penalty": (_neutral_zero, "only 0 is supported"),
    "logit_bias": (lambda v: not v, "only an empty map is supported"),
    "logprobs": (lambda v: v is None or v is False, "log probabilities are not returned"),
    "top_logprobs": (_neutral_zero, "log probabilities are not returned"),
    "echo": (lambda v: not v, "the prompt is not echoed"),
    "best_of": (lambda v: v is None or v == 1, "only 1 is supported"),
    "suffix": (lambda v: not v, "insertion (suffix) is not supported"),
    "modalities": (lambda v: v is None or list(v) == ["text"], "the members are text-only: only ['text']"),
    "audio": (_neutral_none, "the members are text-only"),
    "prediction": (_neutral_none, "predicted outputs are not supported"),
    "reasoning_effort": (_neutral_none, "the members are not reasoning models"),
    "verbosity": (_neutral_none, "not supported"),
    "web_search_options": (_neutral_none, "web search is not supported"),
    "functions": (_neutral_none, "the deprecated 'functions' API is not supported; use 'tools'"),
    "function_call": (_neutral_none, "the deprecated 'functions' API is not supported; use 'tool_choice'"),
}
#: Accepted and ignored: they carry no generation semantics for a local server.
IGNORED = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")


# ----------------------------------------------------------------------------- responses
def _is_none(value: Any) -> bool:
    return value is None


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens read from the primary member's prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class EnsembleInfo(BaseModel):
    """Extension field ``ensemble`` of every response (the finishing chunk when streaming)."""

    name: str
    method: str
    members: list[str]
    token_counter: str
    stop_reason: str
    seconds: float
    time_to_first_chunk: float | None
    stats: dict[str, Any]
    #: Calls the reply started that cannot run (broken or cut JSON, an unknown tool, arguments that break the
    #: tool's schema), as ``{"name", "args", "id", "error"}``; omitted when there are none. Such a reply has no
    #: ``tool_calls`` and finishes ``stop`` (``length`` when cut); its text is the message content.
    invalid_tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_is_none)
    #: Why a ``response_format`` reply is not a valid value (not JSON, or breaks the schema); omitted when it is.
    parse_error: str | None = Field(default=None, exclude_if=_is_none)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_is_none)


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChatChoice]
    usage: Usage
    ensemble: EnsembleInfo


class ChunkDelta(BaseModel):
    """Only the keys that are set (``{}`` in the finishing chunk, as OpenAI sends it)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)
    tool_calls: list[dict[str, Any]] | None = Field(default=None, exclude_if=_is_none)


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChunkDelta
    logprobs: None = None
    finish_reason: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[ChunkChoice]
    usage: Usage | None = None
    ensemble: EnsembleInfo | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None


class TextCompletion(BaseModel):
    """A ``text_completion`` (also each streamed chunk, as OpenAI streams them)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None
    choices: list[CompletionChoice]
    usage: Usage | None = None
    ensemble: EnsembleInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ensemble_core"
    root: str | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


def new_id(prefix: str) -> str:
    """``chatcmpl-…`` / ``cmpl-…`` ids (random, 24 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
