"""Chat messages → each member's own prompt text.

Every member formats the conversation with its own chat template, so that each model
sees the prompt it was trained on. The response is then shared as *text*. Models without
a template (the bundled Gemma-3 base) get :data:`FALLBACK_TEMPLATE`, a plain transcript
that base models continue naturally; its turn marker ``"\\nUser:"`` is a default stop
string of such members so that a base model does not write the user's next turn.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

from .errors import InputError

Message = Mapping[str, Any]
Prompt = Union[str, Sequence[Message]]

ROLES = ("system", "user", "assistant")

#: Jinja template used for tokenizers without one. Documented in docs/configuration.md.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n' }}"
    "{% else %}{{ 'Assistant: ' + message['content'] + '\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
#: Stop strings implied by the fallback transcript format.
FALLBACK_STOPS: tuple[str, ...] = ("\nUser:",)


def normalize_messages(prompt: Prompt) -> list[dict[str, str]]:
    """Validate messages and bring them to the shape every chat template accepts.

    A plain string is one user message. System messages are joined into one leading
    system message (several system messages are legal in LangChain, rare in templates);
    consecutive messages of the same role are joined with a blank line, because many
    templates insist on alternating user/assistant turns.
    """
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or len(prompt) == 0:
        raise InputError("The prompt is empty: pass a non-empty string or a list of {'role', 'content'} messages.")
    system: list[str] = []
    turns: list[dict[str, str]] = []
    for i, msg in enumerate(prompt):
        if not isinstance(msg, Mapping) or "role" not in msg or "content" not in msg:
            raise InputError(f"Message {i} is {msg!r}: each message must be a mapping with 'role' and 'content'.")
        role, content = msg["role"], msg["content"]
        if role not in ROLES:
            raise InputError(f"Message {i} has role {role!r}; use one of {', '.join(ROLES)}.")
        if not isinstance(content, str):
            raise InputError(f"Message {i} content must be a string, got {type(content).__name__}.")
        if role == "system":
            system.append(content)
        elif turns and turns[-1]["role"] == role:
            turns[-1]["content"] += "\n\n" + content
        else:
            turns.append({"role": role, "content": content})
    if not turns:
        raise InputError("The messages hold only system text: add a user message.")
    if system:
        turns.insert(0, {"role": "system", "content": "\n\n".join(system)})
    return turns


def render_chat(tokenizer: Any, messages: list[dict[str, str]], template: str | None = None) -> str:
    """Render normalized messages with the generation prompt, as text.

    ``template`` overrides the tokenizer's template; without either the fallback is
    used. If a template rejects the system role (some do, by raising), the system text
    is folded into the first user message and rendering is retried.
    """
    chat_template = template or getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True
        )
    except Exception as exc:  # jinja2 TemplateError raised by the template itself
        if messages[0]["role"] != "system":
            raise InputError(f"The chat template could not render these messages: {exc}") from exc
        folded = fold_system(messages)
        return tokenizer.apply_chat_template(
            folded, chat_template=chat_template, tokenize=False, add_generation_prompt=True
        )


def fold_system(messages: list[dict[str, str]]) -> list[dict[str, str]]:
    """Move a leading system message into the first user message."""
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    if rest and rest[0]["role"] == "user":
        rest[0]["content"] = system + "\n\n" + rest[0]["content"]
    else:
        rest.insert(0, {"role": "user", "content": system})
    return rest


_REPLY_MARKER = "\u2063reply\u2063"


def reply_lead(tokenizer: Any, messages: list[dict[str, str]], template: str | None = None) -> str:
    """Whitespace a chat format puts between its generation prompt and the reply.

    Rendered once with a marker reply: the fallback transcript gives ``"Assistant: <reply>"``
    after a generation prompt ending in ``"Assistant:"``, so its lead is ``" "``; ChatML
    gives ``""``. Anything that is not pure whitespace (a template adding tags) gives ``""``.
    Ensemble methods share the reply as text after each member's own lead.
    """
    opened = render_chat(tokenizer, messages, template)
    full = render_chat(tokenizer, messages + [{"role": "assistant", "content": _REPLY_MARKER}], template)
    at = full.find(_REPLY_MARKER)
    if at < 0 or not full.startswith(opened):
        return ""
    lead = full[len(opened):at]
    return lead if lead.isspace() else ""
