"""LlamaIndex messages and responses ↔ the core's plain data.

The core takes ``[{"role", "content"}]`` with roles system / user / assistant and renders
the conversation with *each member's own* chat template, so messages are passed through
as messages (never flattened into one prompt string by ``messages_to_prompt``: that would
hide the turns from the templates the members were trained on). What LlamaIndex adds on
top (developer / tool / function roles, content blocks) is mapped here, in one place.

Responses carry the usage in ``raw["usage"]`` with OpenAI's key names, which is where
``TokenCountingHandler`` looks (``llama_index.core.callbacks.token_counting``), and the
method's statistics in ``additional_kwargs`` and ``raw["stats"]``.
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
)

from ensemble_core import GenerationResult, InputError

#: LlamaIndex role → core role. Tool and function results are shown to the members as a
#: user turn (the members are plain chat models without a tool role in their templates).
ROLE_MAP: dict[str, str] = {
    MessageRole.SYSTEM.value: "system",
    MessageRole.DEVELOPER.value: "system",
    MessageRole.USER.value: "user",
    MessageRole.ASSISTANT.value: "assistant",
    MessageRole.MODEL.value: "assistant",
    MessageRole.CHATBOT.value: "assistant",
    MessageRole.TOOL.value: "user",
    MessageRole.FUNCTION.value: "user",
}
TOOL_ROLES = (MessageRole.TOOL.value, MessageRole.FUNCTION.value)


def message_text(message: ChatMessage, index: int = 0) -> str:
    """The text of one message; non-text content is refused with a clear error.

    Cache points are provider hints and earlier reasoning (thinking blocks) is not part
    of the conversation, so both are dropped. Images, audio, documents and tool-call
    blocks cannot be shown to text-only members.
    """
    parts: list[str] = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, (CachePoint, ThinkingBlock)):
            continue
        else:
            kind = getattr(block, "block_type", type(block).__name__)
            raise InputError(
                f"Message {index} holds a {kind!r} block: ensemble members are text-only models, "
                "so pass text content (describe or transcribe other content first)."
            )
    return "\n".join(parts)


def to_core_messages(messages: Sequence[ChatMessage]) -> list[dict[str, str]]:
    """LlamaIndex chat messages → the core's ``[{"role", "content"}]`` list."""
    if not messages:
        raise InputError("No messages: pass at least one user message.")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        if role not in ROLE_MAP:
            raise InputError(f"Message {i} has role {role!r}; use one of {', '.join(ROLE_MAP)}.")
        text = message_text(message, i)
        if role in TOOL_ROLES:
            name = message.additional_kwargs.get("name") or message.additional_kwargs.get("tool_name")
            text = f"Tool result ({name}): {text}" if name else f"Tool result: {text}"
        out.append({"role": ROLE_MAP[role], "content": text})
    return out


def usage(result: GenerationResult) -> dict[str, int]:
    """Token usage in OpenAI's key names (counted with the method's primary member)."""
    return {
        "prompt_tokens": result.prompt_tokens,
        "completion_tokens": result.completion_tokens,
        "total_tokens": result.total_tokens,
    }


def raw_payload(result: GenerationResult, model_name: str) -> dict[str, Any]:
    """The ``raw`` field of a response: usage where token counters read it, plus the rest."""
    return {
        "model": model_name,
        "usage": usage(result),
        "finish_reason": result.finish_reason,
        "seconds": result.seconds,
        "time_to_first_chunk": result.time_to_first_chunk,
        "stats": result.stats,
    }


def extra_kwargs(result: GenerationResult) -> dict[str, Any]:
    """``additional_kwargs`` of a response: the method statistics and the finish reason."""
    return {"finish_reason": result.finish_reason, "ensemble_stats": result.stats, **usage(result)}
