"""LangChain messages → the core's ``{"role", "content"}`` messages.

Only the *conversion* lives here. Merging consecutive same-role messages and several
system messages, and rendering with each member's own chat template, is the core's job
(:func:`ensemble_core.normalize_messages`, :meth:`ensemble_core.Member.render`), so every
adapter formats a conversation the same way.

Choices (documented in the README of this package):

* ``SystemMessage`` → ``system``, ``HumanMessage`` → ``user``, ``AIMessage`` → ``assistant``,
  ``ChatMessage`` with role ``system``/``user``/``human``/``assistant``/``ai``.
* ``ToolMessage`` / ``FunctionMessage``, and ``AIMessage`` carrying tool calls, are
  **rejected** with :class:`ToolMessagesNotSupported`: the ensemble has no tool-calling
  protocol yet, and silently flattening a tool result into text would let an agent loop
  run on a model that never saw the tool's schema.
* Content may be a string or a list of blocks. Text blocks are concatenated (as
  ``BaseMessage.text`` does); reasoning blocks in assistant turns are dropped (local chat
  templates do not replay them); any other block (image, audio, file) is rejected with
  :class:`UnsupportedContentError`, since the members are text-only.
* A message's ``name`` is not rendered: the members' chat templates have no field for it.
"""

from __future__ import annotations

from collections.abc import Sequence

from langchain_core.messages import (
    AIMessage,
    BaseMessage,
    ChatMessage,
    FunctionMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)

from ensemble_core import InputError

_CHAT_ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant", "ai": "assistant"}
_DROPPED_ASSISTANT_BLOCKS = {"reasoning", "thinking"}


class ToolMessagesNotSupported(InputError):
    """The conversation contains tool calls or tool results."""


class UnsupportedContentError(InputError):
    """A message holds non-text content (image, audio, file...)."""


def message_role(message: BaseMessage, index: int) -> str:
    if isinstance(message, (ToolMessage, FunctionMessage)) or (isinstance(message, AIMessage) and message.tool_calls):
        raise ToolMessagesNotSupported(
            f"Message {index} is a {type(message).__name__}"
            f"{' with tool calls' if isinstance(message, AIMessage) else ''}: ChatEnsemble does not support "
            "tool calling yet. Remove tool calls and tool results from the history, or pass the tool output "
            "as a HumanMessage."
        )
    if isinstance(message, SystemMessage):
        return "system"
    if isinstance(message, HumanMessage):
        return "user"
    if isinstance(message, AIMessage):
        return "assistant"
    if isinstance(message, ChatMessage):
        role = _CHAT_ROLES.get(message.role.lower())
        if role is None:
            raise InputError(
                f"Message {index} is a ChatMessage with role {message.role!r}; use one of "
                f"{', '.join(sorted(_CHAT_ROLES))}."
            )
        return role
    raise InputError(f"Message {index} has unsupported type {type(message).__name__}.")


def message_text(message: BaseMessage, role: str, index: int) -> str:
    """The text of one message; non-text content raises :class:`UnsupportedContentError`."""
    if isinstance(message.content, str):
        return message.content
    parts: list[str] = []
    for block in message.content_blocks:
        kind = block.get("type")
        if kind == "text":
            parts.append(str(block.get("text", "")))
        elif role == "assistant" and (kind in _DROPPED_ASSISTANT_BLOCKS or (
                kind == "non_standard" and (block.get("value") or {}).get("type") in _DROPPED_ASSISTANT_BLOCKS)):
            continue
        else:
            raise UnsupportedContentError(
                f"Message {index} holds a {kind!r} content block; the ensemble members are text-only. "
                "Pass text content (a string or 'text' blocks)."
            )
    return "".join(parts)


def to_core_messages(messages: Sequence[BaseMessage]) -> list[dict[str, str]]:
    """Convert LangChain messages; the core normalizes (merges) them afterwards."""
    if not messages:
        raise InputError("No messages were given: pass at least one HumanMessage.")
    out = []
    for i, message in enumerate(messages):
        role = message_role(message, i)
        out.append({"role": role, "content": message_text(message, role, i)})
    return out
