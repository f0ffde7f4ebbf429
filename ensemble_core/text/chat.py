"""Chat messages → each member's own prompt text: the one message policy of the library.

Every member formats the conversation with its own chat template, so that each model
sees the prompt it was trained on. The response is then shared as *text*. Models without
a template (the bundled Gemma-3 base) get :data:`FALLBACK_TEMPLATE`, a plain transcript
that base models continue naturally; its turn marker ``"\\nUser:"`` is a default stop
string of such members so that a base model does not write the user's next turn.

The adapters (LangChain, LlamaIndex, the server) only translate their framework's
message objects into the plain dicts described at :func:`normalize_messages`; every
decision below is made here, once:

* **Content** is a string or a list of parts. Text parts (an OpenAI ``refusal`` part too) are
  joined with ``"\\n"`` (as vLLM's OpenAI-compatible server joins text parts); reasoning /
  thinking parts and provider hints (cache points) are dropped, because local chat templates
  do not replay them; any other part (image, audio, file, or a type not known here) raises
  :class:`UnsupportedContentError`.
* **Roles**: ``system``, ``user``, ``assistant``, ``tool``. System messages are joined into
  one leading system message, consecutive user or assistant messages are joined with a
  blank line (many templates insist on alternating turns); tool results are never merged.
* **Tool calls and results** round-trip: an assistant message may carry ``tool_calls``
  and a ``tool`` message answers one. A member whose template knows tools receives them
  as they are; for any other member they are written as text (:func:`as_text_turns`):
  the calls as the documented JSON tool-call format in the assistant turn, each result as
  a user turn ``"Tool result (name): ..."``.
* **Bad input** (wrong types, no text at all, text that is not valid Unicode) raises
  :class:`InputError` naming the message and the fix, before any model runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Union

from ensemble_core.errors import InputError, UnsupportedContentError

Message = Mapping[str, Any]
Prompt = Union[str, Sequence[Message]]

ROLES = ("system", "user", "assistant", "tool")
#: Other names of those roles: OpenAI's ``developer`` messages are system messages to these models.
ROLE_ALIASES = {"developer": "system"}
#: Content parts that carry text, and the key that holds it (an OpenAI assistant's ``refusal`` part is
#: text its client sends back in the history).
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}
#: Content parts of other media (OpenAI's, LangChain's standard blocks, LlamaIndex's): text-only
#: members cannot read them.
MEDIA_PARTS = frozenset({"image", "image_url", "input_image", "audio", "input_audio", "file", "input_file", "video",
                         "video_url", "document", "text-plain"})
#: Content parts that are dropped: earlier reasoning is not replayed, cache points are provider hints.
DROPPED_PARTS = frozenset({"reasoning", "thinking", "redacted_thinking", "cache_point", "cache_control"})
#: How text parts of one message are joined.
PART_SEPARATOR = "\n"
#: How consecutive messages of one role (and several system messages) are joined.
TURN_SEPARATOR = "\n\n"

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


# ----------------------------------------------------------------------------- text checks
def check_text(text: str, where: str) -> str:
    """``text`` if it is valid Unicode text; a typed error otherwise.

    A lone surrogate (``"\\ud800"``, what a broken UTF-16 decode leaves behind) cannot be
    encoded as UTF-8, so no tokenizer can read it: say so here instead of failing inside one.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise InputError(
            f"{where} contains the lone surrogate U+{ord(bad):04X} at character {exc.start}, which is not valid "
            "Unicode text. Fix the decoding that produced it, or replace it, e.g. "
            "text.encode('utf-8', 'replace').decode('utf-8')."
        ) from None
    return text


def content_text(content: Any, where: str) -> str:
    """The text of one message's content (a string or a list of parts, see the module docstring)."""
    if isinstance(content, str):
        return check_text(content, where)
    if content is None:
        return ""
    if isinstance(content, Mapping) or not isinstance(content, Sequence):
        raise InputError(f"{where} has content of type {type(content).__name__}: pass a string or a list of "
                         "content parts such as {'type': 'text', 'text': ...}.")
    texts: list[str] = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(check_text(part, f"{where}, part {j}"))
            continue
        kind = part.get("type") if isinstance(part, Mapping) else None
        if kind in TEXT_PARTS:
            key = TEXT_PARTS[kind]
            text = part.get(key)
            if not isinstance(text, str):
                raise InputError(f"{where}, part {j} is a {kind!r} part whose {key!r} is {type(text).__name__}, "
                                 "not a string.")
            texts.append(check_text(text, f"{where}, part {j}"))
        elif kind in DROPPED_PARTS:
            continue
        elif kind is None:
            raise InputError(f"{where}, part {j} is {part!r}: content parts are strings or mappings with a 'type'.")
        elif kind in MEDIA_PARTS:
            raise UnsupportedContentError(
                f"{where} holds a {kind!r} content part; the ensemble members are text-only models. "
                "Pass text content (a string or 'text' parts), or describe / transcribe the other content first."
            )
        else:
            raise UnsupportedContentError(
                f"{where}, part {j} has the content part type {kind!r}, which the ensemble does not know. Text "
                f"parts are {sorted(TEXT_PARTS)} (read), {sorted(DROPPED_PARTS)} are dropped, and media parts "
                "cannot be read by its text-only members: pass the text as a string or a 'text' part."
            )
    return PART_SEPARATOR.join(texts)


# ----------------------------------------------------------------------------- tool calls
def normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    """One tool call as ``{"id", "name", "arguments": dict}``.

    Accepts the OpenAI shape (``{"id", "type": "function", "function": {"name", "arguments": JSON
    string}}``) and the flat shape (``{"id", "name", "arguments" | "args": dict}``).
    """
    if not isinstance(call, Mapping):
        raise InputError(f"{where} is {call!r}: a tool call is a mapping with a name and arguments.")
    fn = call.get("function") if isinstance(call.get("function"), Mapping) else call
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise InputError(f"{where} has no tool name: give it 'name' (or 'function': {{'name': ...}}).")
    arguments = fn.get("arguments", fn.get("args", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise InputError(f"{where} ({name}) has arguments that are not valid JSON: {exc}.") from None
    if not isinstance(arguments, Mapping):
        raise InputError(f"{where} ({name}) has arguments of type {type(arguments).__name__}: pass a JSON object.")
    call_id = call.get("id")
    return {"id": str(call_id) if call_id is not None else "", "name": name, "arguments": dict(arguments)}


def tool_call_text(call: Mapping[str, Any]) -> str:
    """The documented JSON tool-call format: ``{"name": ..., "arguments": {...}}`` on one line."""
    return json.dumps({"name": call["name"], "arguments": call["arguments"]}, ensure_ascii=False)


# ----------------------------------------------------------------------------- normalisation
def normalize_messages(prompt: Prompt) -> list[dict[str, Any]]:
    """Validate messages and bring them to the one shape every chat template accepts.

    A plain string is one user message. A message is a mapping with ``role`` and
    ``content`` (string, list of parts, or None for an assistant turn that only calls
    tools); an assistant message may add ``tool_calls``, a tool message ``tool_call_id``
    and ``name``. The result holds plain ``{"role", "content": str}`` dicts (plus
    ``tool_calls`` / ``tool_call_id`` / ``name`` where given), one leading system message
    at most, and no two consecutive user or assistant messages.
    """
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Mapping) or not isinstance(prompt, Sequence):
        raise InputError(f"The prompt is {type(prompt).__name__}: pass a string or a list of "
                         "{'role', 'content'} messages.")
    if len(prompt) == 0:
        raise InputError("The prompt is empty: pass a non-empty string or a list of {'role', 'content'} messages.")
    system: list[str] = []
    turns: list[dict[str, Any]] = []
    for i, msg in enumerate(prompt):
        where = f"Message {i}"
        calls_only = isinstance(msg, Mapping) and msg.get("role") == "assistant" and bool(msg.get("tool_calls"))
        if not isinstance(msg, Mapping) or "role" not in msg or ("content" not in msg and not calls_only):
            raise InputError(f"{where} is {msg!r}: each message must be a mapping with 'role' and 'content'.")
        role = msg["role"]
        role = ROLE_ALIASES.get(role, role) if isinstance(role, str) else role
        if role not in ROLES:
            raise InputError(f"{where} has role {role!r}; use one of {', '.join(ROLES)}.")
        if msg.get("content") is None and role != "assistant":
            raise InputError(f"{where} ({role}) has no content: pass a string.")
        content = content_text(msg.get("content"), where)
        if role == "system":
            system.append(content)
            continue
        turn: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and msg.get("tool_calls"):
            calls = msg["tool_calls"]
            if isinstance(calls, (str, Mapping)) or not isinstance(calls, Sequence):
                raise InputError(f"{where} has tool_calls of type {type(calls).__name__}: pass a list of tool calls.")
            turn["tool_calls"] = [normalize_tool_call(c, f"{where}, tool call {j}") for j, c in enumerate(calls)]
        if role == "tool":
            for key in ("tool_call_id", "name"):
                if msg.get(key) is not None:
                    turn[key] = str(msg[key])
        mergeable = role in ("user", "assistant") and "tool_calls" not in turn
        if mergeable and turns and turns[-1]["role"] == role and "tool_calls" not in turns[-1]:
            turns[-1]["content"] += TURN_SEPARATOR + content
        else:
            turns.append(turn)
    if not turns:
        raise InputError("The messages hold only system text: add a user message.")
    if not any(t["content"].strip() or t.get("tool_calls") for t in turns) and not any(s.strip() for s in system):
        raise InputError("The prompt has no text (it is empty or only whitespace): there is nothing to answer. "
                         "Pass a question or an instruction.")
    if system:
        turns.insert(0, {"role": "system", "content": TURN_SEPARATOR.join(system)})
    return turns


def as_text_turns(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Tool calls and results written as text, for a template that knows no tools.

    Calls are appended to their assistant turn in the documented JSON format (one per
    line); a result becomes the user turn ``"Tool result (name): content"``. Consecutive
    turns of one role are joined again afterwards.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if m.get("tool_calls"):
            calls = "\n".join(tool_call_text(c) for c in m["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        if role == "tool":
            label = f"Tool result ({m['name']})" if m.get("name") else "Tool result"
            role, content = "user", f"{label}: {content}"
        if out and out[-1]["role"] == role and role in ("user", "assistant"):
            out[-1]["content"] += TURN_SEPARATOR + content
        else:
            out.append({"role": role, "content": content})
    return out


def has_tool_messages(messages: list[dict[str, Any]]) -> bool:
    return any(m["role"] == "tool" or m.get("tool_calls") for m in messages)


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders tools itself (it reads a ``tools`` variable and the tool role).

    The bundled SmolLM2 template renders any role name verbatim, which is not tool support;
    Qwen2.5's template has ``{%- if tools %}`` and a ``tool`` role branch.
    """
    return bool(template) and "tools" in template and "tool" in template.replace("tools", "")


def to_template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normalised messages in the shape Hugging Face chat templates read (tool calls as
    ``{"type": "function", "function": {"name", "arguments"}}``)."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function",
                                "function": {"name": c["name"], "arguments": c["arguments"]}} for c in m["tool_calls"]]
        out.append(m)
    return out


# ----------------------------------------------------------------------------- rendering
def render_chat(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None,
                tools: list[dict[str, Any]] | None = None) -> str:
    """Render normalized messages with the generation prompt, as text.

    ``template`` overrides the tokenizer's template; without either the fallback is
    used. Tool messages go to a template that supports tools as they are, to any other as
    text (:func:`as_text_turns`). If a template rejects the system role (some do, by
    raising), the system text is folded into the first user message and rendering is
    retried.
    """
    chat_template = template or getattr(tokenizer, "chat_template", None) or FALLBACK_TEMPLATE
    native = template_supports_tools(chat_template)
    if has_tool_messages(messages):
        messages = to_template_messages(messages) if native else as_text_turns(messages)
    extra = {"tools": tools} if tools and native else {}
    try:
        return tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False, add_generation_prompt=True, **extra
        )
    except Exception as exc:  # jinja2 TemplateError raised by the template itself
        if messages[0]["role"] != "system":
            raise InputError(f"The chat template could not render these messages: {exc}") from exc
        folded = fold_system(messages)
        return tokenizer.apply_chat_template(
            folded, chat_template=chat_template, tokenize=False, add_generation_prompt=True, **extra
        )


def fold_system(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Move a leading system message into the first user message."""
    system, rest = messages[0]["content"], [dict(m) for m in messages[1:]]
    if rest and rest[0]["role"] == "user":
        rest[0]["content"] = system + TURN_SEPARATOR + rest[0]["content"]
    else:
        rest.insert(0, {"role": "user", "content": system})
    return rest


_REPLY_MARKER = "\u2063reply\u2063"


def reply_lead(tokenizer: Any, messages: list[dict[str, Any]], template: str | None = None) -> str:
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
