"""LangChain messages → the core's message dicts.

Only the *translation* of LangChain types lives here. What is done with content blocks,
tool calls and tool results (joining text with a newline, dropping reasoning, rendering
tools per member), and merging consecutive same-role messages, is the core's message
policy (:mod:`ensemble_core.text.chat`), shared with the LlamaIndex adapter and the server.

* ``SystemMessage`` → ``system``, ``HumanMessage`` → ``user``, ``AIMessage`` → ``assistant``
  (with its ``tool_calls``), ``ToolMessage`` → ``tool`` (with ``tool_call_id`` and ``name``),
  ``FunctionMessage`` → ``tool`` named after the function, ``ChatMessage`` with role
  ``system``/``user``/``human``/``assistant``/``ai``/``tool``.
* Content is passed as LangChain's standard content blocks (``message.content_blocks``);
  tool-call blocks (and providers' own, such as Anthropic's ``tool_use``) are skipped there
  because ``AIMessage.tool_calls`` carries the calls.
* A message's ``name`` is not rendered: the members' chat templates have no field for it.

The other direction (:func:`lc_tool_calls`, :func:`lc_call_deltas`)
turns the core's :class:`~ensemble_core.constraints.structured.StructuredOutput` into ``AIMessage.tool_calls``
/ ``invalid_tool_calls``, and its streamed call pieces into ``tool_call_chunks``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.tool import InvalidToolCall, ToolCall, ToolCallChunk, invalid_tool_call, tool_call, tool_call_chunk

from ensemble_core import InputError, UnsupportedContentError
from ensemble_core.constraints.structured import CallDelta, StructuredOutput, reply_content

_CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "human": "user", "assistant": "assistant",
               "ai": "assistant", "tool": "tool"}  # developer: OpenAI's system role for reasoning models
#: Blocks of an AIMessage's content that describe its tool calls (carried by ``tool_calls`` instead).
_TOOL_CALL_BLOCKS = frozenset({"tool_call", "tool_call_chunk", "invalid_tool_call", "server_tool_call"})
#: Provider-specific call blocks that LangChain leaves as ``non_standard`` (Anthropic's ``tool_use``,
#: OpenAI Responses' ``function_call``): also carried by ``AIMessage.tool_calls``.
_PROVIDER_CALL_BLOCKS = frozenset({"tool_use", "server_tool_use", "function_call"})

__all__ = ["UnsupportedContentError", "lc_call_deltas", "lc_tool_calls", "message_role",
           "reply_content", "to_core_messages"]
#: Qwen2.5-style templates open a call with this tag; text from it on is never streamed as content.


def message_role(message: BaseMessage, index: int) -> str:
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, (ToolMessage, FunctionMessage)):
        return "tool"
    if isinstance(message, ChatMessage):
        role = _CHAT_ROLES.get(message.role.lower())
        if role is None:
            raise InputError(
                f"Message {index} is a ChatMessage with role {message.role!r}; use one of "
                f"{', '.join(sorted(_CHAT_ROLES))}."
            )
        return role
    raise InputError(f"Message {index} has unsupported type {type(message).__name__}.")


def content_parts(message: BaseMessage) -> str | list[dict[str, Any]]:
    """The message's content for the core: its string, or its standard content blocks."""
    if isinstance(message.content, str):
        return message.content
    parts = []
    for block in message.content_blocks:
        kind = block.get("type")
        value_kind = (block.get("value") or {}).get("type") if kind == "non_standard" else None
        if kind in _TOOL_CALL_BLOCKS or (value_kind in _PROVIDER_CALL_BLOCKS and isinstance(message, AIMessage)):
            continue
        if value_kind in ("reasoning", "thinking"):
            parts.append({"type": "reasoning"})
        else:
            parts.append(dict(block))
    return parts


def to_core_messages(messages: Sequence[BaseMessage]) -> list[dict[str, Any]]:
    """Convert LangChain messages; the core normalizes (validates, merges) them afterwards."""
    if not messages:
        raise InputError("No messages were given: pass at least one HumanMessage.")
    out = []
    called: dict[str, str] = {}  # tool call id -> the tool's name, for results that carry only the id
    for i, message in enumerate(messages):
        if not isinstance(message, BaseMessage):
            raise InputError(f"Message {i} is a {type(message).__name__}, not a LangChain message.")
        role = message_role(message, i)
        core: dict[str, Any] = {"role": role, "content": content_parts(message)}
        if isinstance(message, AIMessage) and message.tool_calls:
            core["tool_calls"] = [{"id": c.get("id"), "name": c["name"], "arguments": c.get("args", {})}
                                  for c in message.tool_calls]
            called.update((str(c["id"]), c["name"]) for c in message.tool_calls if c.get("id"))
        if isinstance(message, ToolMessage):
            # ToolMessage(content, tool_call_id=...) is how results are usually written: the name comes from
            # the call it answers (members that read tool turns as text see "Tool result (name): ...")
            core["tool_call_id"] = message.tool_call_id
            core["name"] = message.name or called.get(str(message.tool_call_id))
        elif isinstance(message, FunctionMessage):
            core["name"] = message.name
        out.append(core)
    return out


# ----------------------------------------------------------------------------- core → LangChain
def lc_tool_calls(output: StructuredOutput | None) -> tuple[list[ToolCall], list[InvalidToolCall]]:
    """``AIMessage.tool_calls`` (with the core's ids) and ``invalid_tool_calls`` of a reply."""
    if output is None:
        return [], []
    calls = [tool_call(name=c.name, args=c.arguments, id=c.id) for c in output.tool_calls]
    invalid = [invalid_tool_call(name=c.get("name"), args=c.get("args"), id=c.get("id"), error=c.get("error"))
               for c in output.invalid_tool_calls]
    return calls, invalid


def lc_call_deltas(calls: Sequence[CallDelta]) -> list[ToolCallChunk]:
    """The core's tool-call pieces as ``tool_call_chunks``: LangChain joins the pieces of one ``index``.

    The first piece of a call carries its id and name, the next ones its arguments text as
    decoded; a call that did not parse ends with break text
    (:class:`~ensemble_core.constraints.structured.CallDelta`), so that the merged message lists
    it in ``invalid_tool_calls`` instead of completing its partial JSON into a call.
    """
    return [tool_call_chunk(name=c.name, args=c.arguments or None, id=c.id, index=c.index) for c in calls]
