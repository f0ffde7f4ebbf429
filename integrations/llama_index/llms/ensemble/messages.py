"""LlamaIndex messages and responses ↔ the core's plain data.

Only the *translation* of LlamaIndex types lives here; what is done with content parts,
tool calls and tool results (joining, dropping, rendering per member) is the core's
message policy (:mod:`ensemble_core.chat`), shared with the LangChain adapter and the server.

Messages are passed through as messages (never flattened into one prompt string by
``messages_to_prompt``: that would hide the turns from the templates the members were
trained on). Responses carry the usage in ``raw["usage"]`` with OpenAI's key names, which
is where ``TokenCountingHandler`` looks (``llama_index.core.callbacks.token_counting``),
and the method's statistics in ``additional_kwargs`` and ``raw["stats"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    CachePoint,
    ChatMessage,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)

from ensemble_core import Ensemble, GenerationResult, InputError
from ensemble_core.runtime import api_finish_reason, result_info, usage

#: LlamaIndex role → core role.
ROLE_MAP: dict[str, str] = {
    MessageRole.SYSTEM.value: "system",
    MessageRole.DEVELOPER.value: "system",
    MessageRole.USER.value: "user",
    MessageRole.ASSISTANT.value: "assistant",
    MessageRole.MODEL.value: "assistant",
    MessageRole.CHATBOT.value: "assistant",
    MessageRole.TOOL.value: "tool",
    MessageRole.FUNCTION.value: "tool",
}


def content_parts(message: ChatMessage) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A message's blocks as core content parts, and the tool calls among them."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append({"type": "text", "text": block.text})
        elif isinstance(block, ThinkingBlock):
            parts.append({"type": "thinking"})
        elif isinstance(block, CachePoint):
            parts.append({"type": "cache_point"})
        elif isinstance(block, ToolCallBlock):
            calls.append({"id": block.tool_call_id, "name": block.tool_name, "arguments": block.tool_kwargs})
        else:
            parts.append({"type": getattr(block, "block_type", type(block).__name__)})
    return parts, calls


def _plain(call: Any) -> Any:
    """An OpenAI SDK tool-call object (``additional_kwargs["tool_calls"]``) as a dict."""
    return call.model_dump() if hasattr(call, "model_dump") else call


def to_core_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """LlamaIndex chat messages → the core's message dicts (see :func:`ensemble_core.normalize_messages`)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise InputError(f"chat() takes a list of ChatMessage, got {type(messages).__name__}.")
    if not messages:
        raise InputError("No messages: pass at least one user message.")
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise InputError(f"Message {i} is a {type(message).__name__}, not a llama_index ChatMessage.")
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        if role not in ROLE_MAP:
            raise InputError(f"Message {i} has role {role!r}; use one of {', '.join(ROLE_MAP)}.")
        parts, calls = content_parts(message)
        calls += [_plain(c) for c in message.additional_kwargs.get("tool_calls") or []]
        core: dict[str, Any] = {"role": ROLE_MAP[role], "content": parts}
        if calls and core["role"] == "assistant":
            core["tool_calls"] = calls
        if core["role"] == "tool":
            extra = message.additional_kwargs
            core["tool_call_id"] = extra.get("tool_call_id")
            core["name"] = extra.get("name") or extra.get("tool_name")
        out.append(core)
    return out


def raw_payload(result: GenerationResult, ensemble: Ensemble) -> dict[str, Any]:
    """The ``raw`` field of a response: usage where token counters read it, plus how it was made."""
    return {"model": ensemble.name, "usage": usage(result), **result_info(result, ensemble)}


def extra_kwargs(result: GenerationResult) -> dict[str, Any]:
    """``additional_kwargs`` of a response: the method statistics, the finish reason and the usage."""
    return {"finish_reason": api_finish_reason(result.finish_reason), "stop_reason": result.finish_reason,
            "ensemble_stats": result.stats, **usage(result)}
