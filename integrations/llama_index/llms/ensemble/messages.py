"""LlamaIndex messages and responses ↔ the core's plain data.

Only the *translation* of LlamaIndex types lives here; what is done with content parts,
tool calls and tool results (joining, dropping, rendering per member) is the core's
message policy (:mod:`ensemble_core.text.chat`), shared with the LangChain adapter and the server.

Messages are passed through as messages (never flattened into one prompt string by
``messages_to_prompt``: that would hide the turns from the templates the members were
trained on). Responses carry the usage in ``raw["usage"]`` with OpenAI's key names, which
is where ``TokenCountingHandler`` looks (``llama_index.core.callbacks.token_counting``),
and the method's statistics in ``additional_kwargs`` and ``raw["stats"]``.

Tool calls in a response are ``ToolCallBlock``s of its message (with the core's call ids),
which is where ``FunctionCallingLLM`` agents and programs look, and what
:func:`to_core_messages` reads back as the assistant turn's calls.

A call that cannot run (cut by the token budget, or against its tool's schema) must not
end an agent's run as its "answer" (``FunctionAgent`` ends on a response without calls).
So it is a ``ToolCallBlock`` too, of the reserved tool :data:`INVALID_CALL` with the call's
name, text and error as its arguments: the agent "runs" it, finds no such tool, and
answers with an error message; :func:`to_core_messages` turns that exchange back into what
the member needs to read: its reply, then a user turn saying why the call did not run and
asking for the call again or an answer.
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
from ensemble_core.constraints.structured import StructuredOutput
from ensemble_core.serving.runtime import api_finish_reason, result_info, usage

#: The tool name of a call that cannot run (see the module docstring): no tool may have it.
INVALID_CALL = "invalid_tool_call"
#: What the member reads after an invalid call of its own.
INVALID_CALL_FEEDBACK = ("Your call of {name} could not run: {error}. Call the tool again with complete arguments "
                         "that match its parameters, or answer without it.")

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
    names: dict[str, Any] = {}  # tool call id → tool name, from the assistant messages so far
    invalid: dict[str, dict[str, Any]] = {}  # id → the arguments of an INVALID_CALL block
    for i, message in enumerate(messages):
        if not isinstance(message, ChatMessage):
            raise InputError(f"Message {i} is a {type(message).__name__}, not a llama_index ChatMessage.")
        role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
        if role not in ROLE_MAP:
            raise InputError(f"Message {i} has role {role!r}; use one of {', '.join(ROLE_MAP)}.")
        parts, calls = content_parts(message)
        seen = {c["id"] for c in calls if c.get("id")}
        calls += [c for c in (_plain(c) for c in message.additional_kwargs.get("tool_calls") or [])
                  if not (isinstance(c, dict) and c.get("id") and c["id"] in seen)]  # blocks and kwargs may repeat a call
        core: dict[str, Any] = {"role": ROLE_MAP[role], "content": parts}
        bad = [c for c in calls if isinstance(c, dict) and c.get("name") == INVALID_CALL]
        if bad and core["role"] == "assistant":
            invalid.update({str(c.get("id")): dict(c.get("arguments") or {}) for c in bad})
            calls = [c for c in calls if c not in bad]
        if core["role"] == "tool" and str(message.additional_kwargs.get("tool_call_id")) in invalid:
            call = invalid[str(message.additional_kwargs.get("tool_call_id"))]
            out.append({"role": "user", "content": INVALID_CALL_FEEDBACK.format(
                name=call.get("name") or "a tool", error=call.get("error") or "it is not a valid call")})
            continue
        if calls and core["role"] == "assistant":
            core["tool_calls"] = calls
            names.update({str(c.get("id")): _call_name(c) for c in calls if isinstance(c, dict) and c.get("id")})
        if core["role"] == "tool":
            extra = message.additional_kwargs
            core["tool_call_id"] = extra.get("tool_call_id")
            # FunctionAgent sends only the id: the name comes from the call it answers
            core["name"] = extra.get("name") or extra.get("tool_name") or names.get(str(extra.get("tool_call_id")))
        out.append(core)
    return out


def _call_name(call: dict[str, Any]) -> Any:
    fn = call.get("function")
    return fn.get("name") if isinstance(fn, dict) else call.get("name")


def raw_payload(result: GenerationResult, ensemble: Ensemble) -> dict[str, Any]:
    """The ``raw`` field of a response: usage where token counters read it, plus how it was made (and the
    calls dropped because they repeated an answered call)."""
    raw = {"model": ensemble.name, "usage": usage(result), **result_info(result, ensemble)}
    if result.structured is not None and result.structured.repeated_tool_calls:
        raw["repeated_tool_calls"] = [c.as_dict() for c in result.structured.repeated_tool_calls]
    return raw


def extra_kwargs(result: GenerationResult) -> dict[str, Any]:
    """``additional_kwargs`` of a response: the method statistics, the finish reason and the usage
    (plus ``invalid_tool_calls``: replies that looked like a call but did not parse)."""
    extra = {"finish_reason": api_finish_reason(result.finish_reason, bool(result.tool_calls)),
             "stop_reason": result.finish_reason, "ensemble_stats": result.stats.as_dict(), **usage(result)}
    if result.structured is not None and result.structured.invalid_tool_calls:
        extra["invalid_tool_calls"] = list(result.structured.invalid_tool_calls)
    return extra


# ----------------------------------------------------------------------------- replies with tool calls
def assistant_message(content: str, output: StructuredOutput | None = None) -> ChatMessage:
    """The assistant message of a response: its text, and one ``ToolCallBlock`` per parsed call.

    The blocks carry the core's call ids, so the message goes back into the chat history
    as it is (:func:`to_core_messages` reads the blocks as the assistant turn's calls). A call
    that cannot run is a block of :data:`INVALID_CALL` (see the module docstring).
    """
    calls = output.tool_calls if output is not None else []
    invalid = output.invalid_tool_calls if output is not None else []
    if not calls and not invalid:
        return ChatMessage(role=MessageRole.ASSISTANT, content=content)
    if not calls:
        content = output.content if output is not None else content  # the invalid calls' text is in their blocks
    blocks: list[Any] = [TextBlock(text=content)] if content else []
    blocks += [ToolCallBlock(tool_call_id=c.id, tool_name=c.name, tool_kwargs=c.arguments) for c in calls]
    blocks += [ToolCallBlock(tool_call_id=c.get("id"), tool_name=INVALID_CALL, tool_kwargs={
        "name": c.get("name"), "arguments": c.get("args"), "error": c.get("error")}) for c in invalid]
    return ChatMessage(role=MessageRole.ASSISTANT, blocks=blocks)
