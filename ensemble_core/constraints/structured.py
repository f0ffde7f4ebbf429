"""Tool calls and structured output: what a request asks for, how members are told, how output is read.

A request may carry OpenAI-style ``tools`` with a ``tool_choice``, and/or a
``response_format`` (a JSON Schema, or any JSON object). This module turns those into:

1. **Prompt**: a member whose chat template knows tools gets them through the template
   (``apply_chat_template(tools=...)``, Qwen2.5's); any other member gets one documented
   instruction in the system prompt (:func:`tool_instructions`): call a tool by answering
   with one JSON object ``{"name": ..., "arguments": {...}}`` and nothing else. A
   ``response_format`` adds the schema to the system prompt the same way for every member.
2. **Constraint** (:func:`request_constraint`): when a call is forced (``tool_choice``
   ``"required"`` / ``"any"`` / a tool name) or a schema is requested, every member decodes
   under the grammar of :mod:`ensemble_core.constraints.grammar`, so the output ALWAYS parses.
   With ``tool_choice="auto"`` decoding is free and the ensemble's text decides: a reply
   that holds a call in one of the formats models write (Hermes tags, fenced or bare JSON,
   Llama 3, Mistral: :mod:`ensemble_core.constraints.tool_parsers`) is a call, anything
   else is text (:func:`parse_output`).
3. **Result** (:class:`StructuredOutput`): the text, the parsed calls (with ids), the parsed
   JSON value, and calls that cannot run (``invalid_tool_calls``): broken JSON, an unknown
   tool, or arguments that break the tool's JSON Schema. Every path (auto, forced, streamed,
   served) reads a finished reply through :func:`parse_output`, so every call is checked.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ensemble_core.constraints.schemas import schema_sketch
from ensemble_core.constraints.tool_parsers import (
    AutoParser,
    ToolCall,
    ToolCallParser,
    ToolSet,
    json_sequence,
    new_call_id,
    schema_error,
    schema_validator,
)
from ensemble_core.constraints.triggers import call_parts, closed_value, find_text_trigger, trigger_tail
from ensemble_core.errors import ConstraintError, InputError, InvalidOptionError, UnknownToolError

__all__ = [
    "ANSWER_INSTRUCTIONS", "CALL_TAG", "CallDelta", "JSON_INSTRUCTIONS", "SCHEMA_INSTRUCTIONS", "TOOL_CHOICES",
    "TOOL_INSTRUCTIONS", "VALUE_ANSWER_INSTRUCTIONS",
    "ReplyStream", "StructuredOutput", "StructuredRequest", "ToolCall", "function_spec", "json_sequence",
    "parse_output", "reply_content", "schema_instructions", "schema_of", "structured_request", "tool_instructions",
    "with_instructions",
]

TOOL_CHOICES = ("auto", "none", "required", "any")

#: The system-prompt instruction for members whose template knows no tools.
TOOL_INSTRUCTIONS = (
    "You can call these tools:\n{tools}\n\n"
    "To call a tool, answer with one JSON object and nothing else: "
    '{{"name": "<tool name>", "arguments": {{<the arguments>}}}}. '
    "{when}"
)
#: Added for every member (its template renders tools or not) once tool results are in the history of an
#: ``auto`` request: the bundled members' failure mode in agents is calling again instead of answering.
ANSWER_INSTRUCTIONS = ("Tool results are in the conversation above. If they answer the question, reply in plain "
                       "text, a full sentence with the answer; do not call a tool again for a result you already have.")
#: :data:`ANSWER_INSTRUCTIONS` where a ``response_format`` asks for the answer as a JSON value ("plain text" would
#: contradict the schema's instruction that follows).
VALUE_ANSWER_INSTRUCTIONS = ("Tool results are in the conversation above. If they answer the question, reply with "
                             "the answer as the JSON object described below; do not call a tool again for a result "
                             "you already have.")
#: When no tool is needed (``auto``), without and with a ``response_format``.
NO_TOOL_TEXT = "If no tool is needed, answer in plain text."
NO_TOOL_VALUE = "If no tool is needed, answer with the JSON object described below."
#: A ``response_format``'s schema, shown as the value it asks for (:func:`~ensemble_core.constraints.schemas.schema_sketch`:
#: shown the JSON Schema itself, small members write the schema back or take it for a tool).
SCHEMA_INSTRUCTIONS = "Answer with {what} of this form, and nothing else: {form}"
#: ``response_format={"type": "json_object"}``: any object (a schema of ``{}`` would only confuse a small model).
JSON_INSTRUCTIONS = "Answer with one JSON object, and nothing else."
#: Qwen2.5-style templates wrap calls in these tags; a reply may carry them in auto mode.
CALL_TAG = "<tool_call>"
#: What a ``response_format={"type": "json_object"}`` value must be (its schema is ``{}``).
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: The parser of every reply: all the formats of :mod:`ensemble_core.constraints.tool_parsers`.
_DEFAULT_PARSER = AutoParser()


@dataclass(frozen=True)
class StructuredRequest:
    """A request's tools, tool choice and response format, validated and normalised.

    ``tools`` are the bare function specs (``{"name", "description", "parameters"}``);
    ``choice`` is ``"auto"``, ``"none"``, ``"required"`` or a tool name; ``schema`` is the
    requested JSON Schema (``{}`` for any JSON object) or None; ``parallel``: whether a reply
    may hold several calls (OpenAI's ``parallel_tool_calls``; False: at most one).
    """

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "auto"
    schema: dict[str, Any] | None = None
    parallel: bool = True

    @property
    def forced_call(self) -> bool:
        return bool(self.tools) and self.choice not in ("auto", "none")

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none" or self.schema is not None


def function_spec(tool: Any, index: int = 0) -> dict[str, Any]:
    """An OpenAI-style tool (``{"type": "function", "function": {...}}``) or a bare function spec → the bare spec."""
    if not isinstance(tool, Mapping):
        raise InputError(f"Tool {index} is {type(tool).__name__}: pass a dict such as "
                         "{'type': 'function', 'function': {'name': ..., 'parameters': {...}}}.")
    spec = tool.get("function", tool) if tool.get("type", "function") == "function" else None
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise InputError(f"Tool {index} has no function name: {json.dumps(tool, default=str)[:200]}.")
    params = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, Mapping):
        raise InputError(f"Tool {spec['name']!r} has parameters of type {type(params).__name__}: pass a JSON Schema dict.")
    kind = params.get("type", "object")
    if kind != "object" and (kind in ("string", "number", "integer", "boolean", "array", "null") or isinstance(kind, list)):
        # a call's arguments are a JSON object (OpenAI requires "type": "object" here): a string or array schema
        # would compile into a grammar whose calls no reader could accept as arguments
        raise InputError(f"Tool {spec['name']!r} has parameters of type {kind!r}: a call's arguments "
                         "are one JSON object; pass {'type': 'object', 'properties': {...}} (a single value as one "
                         "property).")
    return {"name": spec["name"], "description": str(spec.get("description") or ""), "parameters": dict(params)}


def unique_names(specs: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tools' names, checked to be unique (a call names its tool: two tools of one name cannot be told apart).

    Checked when a request whose calls are read starts (a forced call's grammar, ``auto``'s lazy grammar), not
    when tools are bound: LangChain's standard tests bind a pydantic model next to its own JSON Schema (one name,
    two specs) and expect ``bind_tools`` to take them.
    """
    names = [s["name"] for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        error = ConstraintError(f"Tool names must be unique; repeated: {', '.join(duplicates)}. Rename or drop the copies.")
        error.param = "tools"
        raise error
    return names


#: What ``tool_choice`` may be (named in its errors).
TOOL_CHOICE_FORMS = ("'auto', 'none', 'required', 'any', a tool name, {'type': 'function', 'function': {'name': ...}} "
                     "or {'type': 'allowed_tools', 'allowed_tools': {'mode': 'auto' | 'required', 'tools': [...]}}")


def tool_choice_parts(tool_choice: Any) -> tuple[Any, tuple[str, ...] | None]:
    """OpenAI's ``tool_choice`` forms → (the choice: None, a mode or a tool name; the allowed tools' names or None).

    A string stands as it is; ``{"type": "function", "function": {"name": ...}}`` (Chat Completions) and
    ``{"type": "function", "name": ...}`` (Responses) name one tool; ``{"type": "allowed_tools", "allowed_tools":
    {"mode": "auto" | "required", "tools": [...]}}`` keeps ``mode`` over the named tools only. Any other mapping (no
    name, a custom tool) raises: read as ``"auto"`` it would let a forced call pass as prose.
    """
    if not isinstance(tool_choice, Mapping):
        return tool_choice, None
    kind = tool_choice.get("type", "function")
    if kind == "allowed_tools":
        inner = tool_choice.get("allowed_tools")
        mode = inner.get("mode", "auto") if isinstance(inner, Mapping) else None
        tools = inner.get("tools") if isinstance(inner, Mapping) else None
        if mode not in ("auto", "required") or not isinstance(tools, Sequence) or isinstance(tools, (str, Mapping)):
            raise InvalidOptionError("tool_choice", tool_choice, TOOL_CHOICE_FORMS)
        names = tuple(named_function(t) for t in tools)
        if not names or not all(names):
            raise InvalidOptionError("tool_choice", tool_choice, "allowed_tools.tools as a non-empty list of "
                                     "{'type': 'function', 'function': {'name': ...}}")
        return mode, names
    name = named_function(tool_choice) if kind == "function" else None
    if not name:
        raise InvalidOptionError("tool_choice", tool_choice, TOOL_CHOICE_FORMS)
    return name, None


def chosen_names(choice: Any, allowed: tuple[str, ...] | None, names: Sequence[str]) -> tuple[str, ...]:
    """The tools a choice (:func:`tool_choice_parts`) narrows a request to, each among ``names`` (an
    :class:`~ensemble_core.errors.UnknownToolError` otherwise); empty: a mode over all of them."""
    wanted = allowed or (() if choice is None or choice in TOOL_CHOICES else (choice,))
    for name in wanted:
        if name not in names:
            raise UnknownToolError(str(name), list(names))
    return wanted


def named_function(tool: Any) -> str | None:
    """The function name in ``{"type": "function", "function": {"name": ...}}`` or ``{"type": "function", "name": ...}``."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        return None
    inner = tool.get("function")
    name = inner.get("name") if isinstance(inner, Mapping) else tool.get("name")
    return name if isinstance(name, str) and name else None


_JSON_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def schema_of(response_format: Any) -> dict[str, Any] | None:
    """The JSON Schema a ``response_format`` asks for (``{}``: any JSON object; None: free text).

    Accepts OpenAI's ``{"type": "json_schema", "json_schema": {"schema": ...}}``,
    ``{"type": "json_object"}``, ``{"type": "text"}``, or a bare JSON Schema dict.
    """
    if response_format is None:
        return None
    if not isinstance(response_format, Mapping):
        raise InvalidOptionError("response_format", response_format,
                                 "a JSON Schema dict or {'type': 'json_schema' | 'json_object' | 'text', ...}")
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {}
    if kind == "json_schema":
        inner = response_format.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, Mapping) else None
        if not isinstance(schema, Mapping):
            raise InvalidOptionError("response_format", response_format,
                                     "{'type': 'json_schema', 'json_schema': {'name': ..., 'schema': {...}}}")
        return dict(schema)
    if kind in (None, *_JSON_TYPES) or (isinstance(kind, list) and kind and all(k in _JSON_TYPES for k in kind)) or any(
            k in response_format for k in ("properties", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")):
        return dict(response_format)
    raise InvalidOptionError("response_format", response_format,
                             "a JSON Schema dict or {'type': 'json_schema' | 'json_object' | 'text', ...}")


def structured_request(tools: Any = None, tool_choice: Any = None, response_format: Any = None,
                       parallel_tool_calls: Any = True) -> StructuredRequest:
    """Validate a request's ``tools`` / ``tool_choice`` / ``response_format`` (typed errors name the problem).

    The tools' parameters and the response format's schema are compiled into their
    ``jsonschema`` validators here (cached), so that a schema the validator rejects raises
    :class:`~ensemble_core.errors.InvalidSchemaError` naming the tool when the request is
    made, not when a reply is read.
    """
    if tools is not None and (isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence)):
        raise InvalidOptionError("tools", tools, "a list of tool specs")
    with about("tools"):
        specs = tuple(function_spec(t, i) for i, t in enumerate(tools or ()))
        names = [s["name"] for s in specs]
        ToolSet(specs).check()
    with about("tool_choice"):
        choice, allowed = tool_choice_parts(tool_choice)
        choice = "auto" if choice is None else choice
        if not isinstance(choice, str):
            raise InvalidOptionError("tool_choice", tool_choice, TOOL_CHOICE_FORMS)
        chosen_names(choice, allowed, names)  # a named tool stays among the others (its grammar narrows)
        if allowed is not None:
            specs = tuple(s for s in specs if s["name"] in allowed)
        if choice in ("required", "any") and not specs:
            raise InvalidOptionError("tool_choice", tool_choice, "'auto' or 'none' when no tools are given")
    if choice == "any":
        choice = "required"
    with about("response_format"):
        schema = schema_of(response_format)
        if schema is not None:
            schema_validator(schema or _ANY_OBJECT, "response_format")
    if not isinstance(parallel_tool_calls, bool):
        raise InvalidOptionError("parallel_tool_calls", parallel_tool_calls, "True (a reply may hold several calls) or "
                                 "False (at most one)")
    return StructuredRequest(specs, choice, schema, parallel_tool_calls)


@contextmanager
def about(param: str) -> Iterator[None]:
    """Input errors raised inside name the request field ``param`` (:attr:`~ensemble_core.errors.InputError.param`,
    the server's error's ``param``), unless they already name one."""
    try:
        yield
    except InputError as e:
        if e.param is None:
            e.param = param
        raise


def tool_instructions(request: StructuredRequest) -> str:
    """The system-prompt text for members whose template does not render tools itself."""
    lines = [json.dumps(t, ensure_ascii=False) for t in request.tools]
    if request.choice == "required":
        when = "You must call one of the tools now."
    elif request.choice not in ("auto", "none"):
        when = f"You must call the tool {request.choice!r} now."
    else:
        when = NO_TOOL_TEXT if request.schema is None else NO_TOOL_VALUE
    return TOOL_INSTRUCTIONS.format(tools="\n".join(lines), when=when)


def schema_instructions(schema: dict[str, Any]) -> str:
    """The system-prompt text of a ``response_format``'s schema: the value's form, not the schema, and the
    schema's own description (a pydantic class's docstring: what the value is) on a line after it."""
    form = schema_sketch(schema)
    text = SCHEMA_INSTRUCTIONS.format(what="one JSON object" if form.startswith("{") else "one JSON value", form=form)
    about = " ".join(str(schema.get("description") or "").split())
    return f"{text}\n{about}" if about else text


def with_instructions(messages: list[dict[str, Any]], request: StructuredRequest, native_tools: bool) -> list[dict[str, Any]]:
    """``messages`` with the request's instructions: in the (first) system message, and after the conversation.

    Members whose template does not render tools get :func:`tool_instructions`; in ``auto``
    mode with tool results in the history every member gets :data:`ANSWER_INSTRUCTIONS` (with a
    ``response_format``, :data:`VALUE_ANSWER_INSTRUCTIONS`: the answer is the schema's value).

    :data:`ANSWER_INSTRUCTIONS` come last, as a system message after the conversation: an agent's call after
    a tool result then starts with its previous call's prompt, which the members' prefix caches hold
    (:mod:`~ensemble_core.decoding.prefix_cache`); at the start they replaced Qwen's default system line,
    and its second prompt shared 3 tokens with its first. :data:`VALUE_ANSWER_INSTRUCTIONS` stay with the
    schema's instructions they point to ("described below").
    """
    parts: list[str] = []
    after: list[dict[str, Any]] = []
    if request.tools and request.choice != "none" and not native_tools:
        parts.append(tool_instructions(request))
    if request.tools and request.choice == "auto" and any(m.get("role") == "tool" for m in messages):
        if request.schema is None:
            after.append({"role": "system", "content": ANSWER_INSTRUCTIONS})
        else:
            parts.append(VALUE_ANSWER_INSTRUCTIONS)
    if request.schema is not None and not request.forced_call:
        parts.append(schema_instructions(request.schema) if request.schema else JSON_INSTRUCTIONS)
    if not parts:
        return [*messages, *after] if after else messages
    text = "\n\n".join(parts)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:], *after]
    return [{"role": "system", "content": text}, *messages, *after]


@dataclass
class StructuredOutput:
    """What a reply means.

    * ``content``: the text outside the calls (empty for a pure call);
    * ``tool_calls``: the calls that may run: a known tool, arguments that match its schema;
    * ``parsed``: the JSON value of a response-format reply (None when the reply is not JSON);
    * ``invalid_tool_calls``: calls that cannot run, ``{"name", "args", "id", "error"}``
      (LangChain's ``InvalidToolCall``): broken or cut JSON, an unknown tool, or arguments
      that break the tool's schema (``error`` is the validator's message);
    * ``parse_error``: why a response-format reply is not a valid value: not JSON (``parsed``
      is None), or the validator's message when ``parsed`` breaks the requested schema
      (``parsed`` keeps the value, as before); None when it matches;
    * ``repeated_tool_calls``: calls taken out of ``tool_calls`` because they repeat a call whose
      result is already in the history (:func:`~ensemble_core.constraints.lazy.drop_repeated_calls`);
      ``content`` is then the answer written after them.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parsed: Any = None
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_error: str | None = None
    repeated_tool_calls: list[ToolCall] = field(default_factory=list)


def parse_output(text: str, request: StructuredRequest, parser: ToolCallParser | None = None,
                 finish_reason: str | None = None) -> StructuredOutput:
    """Read a finished reply: its tool calls (forced or chosen in auto mode), or the requested JSON value.

    The one reader of every path (the generation loop calls it for every result; the
    adapters and the server read its :class:`StructuredOutput`). Calls are read by
    ``parser`` (default: every format, :class:`~ensemble_core.constraints.tool_parsers.AutoParser`)
    and checked against their tool's JSON Schema, forced ones too; ``tool_choice="none"``
    reads no calls. A response-format value is checked against its schema (``parse_error``), and one
    the token budget may have cut (``finish_reason`` ``"length"``) is refused (:func:`read_value`).
    """
    if not request.active:
        return StructuredOutput(text)
    if request.tools and request.choice != "none":
        found = (parser or _DEFAULT_PARSER).parse(text, ToolSet(request.tools))
        if found is not None and found.found:
            calls, invalid = list(found.calls), [c.as_dict() for c in found.invalid]
            if not request.parallel:  # at most one call (the lazy grammar ends the reply after it; free text may not)
                calls, invalid = calls[:1], invalid[:1] if not calls else []
            return StructuredOutput(found.content, calls, invalid_tool_calls=invalid)
    if request.schema is not None:
        return read_value(text, request.schema, finish_reason)
    return StructuredOutput(text)


def read_value(text: str, schema: Mapping[str, Any], finish_reason: str | None = None) -> StructuredOutput:
    """A response-format reply: its JSON value, and why it is not a valid one (not JSON, or breaks the schema).

    A reply the token budget ended (``finish_reason`` ``"length"``) whose value does not end itself
    (a top-level number: ``38`` may be the start of ``3805…``; an object, array, string or literal
    closes itself) is not a value either: ``parsed`` None, ``parse_error`` says the budget cut it.
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return StructuredOutput(text, parse_error=f"the reply is not valid JSON: {e}")
    if finish_reason == "length" and isinstance(value, (int, float)) and not isinstance(value, bool):
        return StructuredOutput(text, parse_error=f"the token budget cut the reply (finish_reason 'length'): the number "
                                f"{text.strip()[:40]} may be only the start of the value; raise max_new_tokens")
    error = schema_error(value, schema_validator(schema or _ANY_OBJECT, "response_format"))
    return StructuredOutput(text, parsed=value,
                            parse_error=None if error is None else f"the value does not match the schema: {error}")


def reply_content(text: str, output: StructuredOutput | None) -> str:
    """A reply's message text: the reply, without the calls when it holds tool calls.

    A reply with only invalid calls keeps its whole text: the user (or the agent loop)
    sees what the model wrote, and ``invalid_tool_calls`` says why it did not run.
    """
    return output.content if output is not None and (output.tool_calls or output.repeated_tool_calls) else text


# ----------------------------------------------------------------------------- streaming
def _tag_start(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of :data:`CALL_TAG`."""
    for k in range(min(len(CALL_TAG) - 1, len(text)), 0, -1):
        if text.endswith(CALL_TAG[:k]):
            return k
    return 0


@dataclass(frozen=True)
class CallDelta:
    """A piece of a tool call while it is decoded (OpenAI's ``delta.tool_calls[i]``, LangChain's ``ToolCallChunk``).

    The first piece of call ``index`` carries its ``id`` and ``name`` (as soon as the name's
    string is closed); later pieces carry the ``arguments`` text as it is committed. The
    concatenated ``arguments`` of a call are the JSON its model wrote; for a call that turns
    out invalid (cut by the budget, or against its schema) the last piece adds :data:`BREAK`
    text that no JSON reader completes, so that a client merging the pieces (LangChain
    completes partial JSON) gets an invalid call, never an executable half of one.
    """

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


@dataclass
class _StreamedCall:
    index: int
    id: str
    fmt: Any
    start: int  # where the call's grammar text starts in the reply
    name: str | None = None
    args_start: int | None = None  # relative to start
    args_end: int | None = None
    sent: str = ""  # the arguments text sent so far
    end: int | None = None  # absolute end of the call (its closer included)


#: A complete JSON string (what :func:`_breaker` skips to find an open one).
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


def _breaker(sent: str) -> str:
    """Text that makes ``sent`` + it unreadable even for a lenient (partial) JSON reader: a mismatched ``]``
    (after a closing quote when ``sent`` ends inside a string, and after the escaped character when it
    ends on a lone backslash there)."""
    rest = _JSON_STRING.sub("", sent)
    if '"' not in rest:
        return "]"
    tail = rest[rest.index('"') + 1:]  # the open string's text
    escaped = (len(tail) - len(tail.rstrip("\\"))) % 2 == 1
    return ('\\"' if escaped else '"') + "]"


class ReplyStream:
    """What of a request's committed text is streamed as content, what as tool-call pieces, and when.

    * A forced call (``tool_choice`` "any" / "required" / a name) is never content.
    * ``tool_choice="auto"``: text is streamed as it comes while the reply cannot (yet) be a
      call. A call starts at a trigger (:func:`~ensemble_core.constraints.triggers.find_text_trigger`:
      ``<tool_call>``, a ``{"name"`` line, a fenced call); from its name on it is streamed as
      :class:`CallDelta` pieces (the name, then the arguments text as it is committed), and
      content stops: the rest of the text arrives with the last piece (:meth:`rest`). A tail
      that may still become a trigger is held back (``Let me <tool``), as is trailing
      whitespace (the parsed content is stripped), and a reply that starts with ``{`` (it may
      be a call, or a JSON answer). With a ``response_format`` too, content is held back whole:
      the answer must be the schema's value, and a reply that is not one is answered again in a
      turn of its own (``ensemble_core.serving.runtime.settle_calls``), so its text is never shown.
    * At the end, :meth:`finish` reconciles the pieces with the parsed reply: a streamed call
      that parsed keeps its id in the result (so the streamed and the final message agree), one
      that did not gets :data:`~CallDelta` break text, and calls the stream did not see (a
      call written where no trigger applies) come whole.

    Both adapters and the server stream through it.
    """

    def __init__(self, forced: bool, tools: Sequence[Mapping[str, Any]] = (), hold_content: bool = False) -> None:
        self.raw, self.shown, self.holding = "", 0, forced or hold_content
        self.tools = ToolSet(tools)
        self.calls: list[_StreamedCall] = []
        self.pos = 0
        self.pending: list[CallDelta] = []

    @classmethod
    def for_request(cls, request: StructuredRequest) -> ReplyStream | None:
        """The stream for a request with tools; None when every delta is text (no tools, or ``"none"``)."""
        if not request.tools or request.choice == "none":
            return None
        return cls(forced=request.forced_call, tools=request.tools, hold_content=request.schema is not None)

    @property
    def text(self) -> str:
        """What has been shown so far."""
        return self.raw[:self.shown]

    @property
    def streamed_calls(self) -> bool:
        """Whether any call piece was sent."""
        return any(c.name is not None for c in self.calls)

    def push(self, delta: str) -> str:
        """Add a committed delta; return the content that may be shown now (call pieces wait in :attr:`pending`)."""
        text, calls = self.feed(delta)
        self.pending.extend(calls)
        return text

    def feed(self, delta: str) -> tuple[str, list[CallDelta]]:
        """Add a committed delta; return the content to show now and the call pieces to send now."""

        self.raw += delta
        pieces: list[CallDelta] = []
        first: int | None = None
        while True:
            call = self.calls[-1] if self.calls and self.calls[-1].end is None else None
            if call is not None:
                pieces.extend(self._advance(call))
                if call.end is None:
                    break
                self.pos = call.end
                continue
            found = find_text_trigger(self.raw, self.pos)
            if found is None:
                break
            fmt, m = found
            if first is None:
                first = m.start()
            self.calls.append(_StreamedCall(len(self.calls), new_call_id(), fmt, m.start("g")))
        return self._content(first), pieces

    def _content(self, first: int | None) -> str:

        if self.holding:
            return ""
        if first is not None:
            self.holding, end = True, first
        elif self.raw.lstrip().startswith("{"):
            self.holding = True
            return ""
        else:
            end = trigger_tail(self.raw)
        end = len(self.raw[:end].rstrip())
        if end <= self.shown:
            return ""
        out, self.shown = self.raw[self.shown:end], end
        return out

    def _advance(self, call: _StreamedCall) -> list[CallDelta]:
        """The pieces of ``call`` that the text now allows (see :class:`CallDelta`); marks its end."""

        text = self.raw[call.start:]
        out: list[CallDelta] = []
        if call.name is None or call.args_start is None:
            name, at = call_parts(text)
            if name is None:
                return out
            if call.name is None:
                call.name = name
                out.append(CallDelta(call.index, call.id, name))
            call.args_start = at
            if at is None:
                return out
        assert call.args_start is not None
        if call.args_end is None:
            closed = closed_value(text, call.args_start)
            if closed is not None:
                call.args_end = closed[1]
            piece = text[call.args_start + len(call.sent): call.args_end if closed else len(text)]
            if piece:
                call.sent += piece
                out.append(CallDelta(call.index, arguments=piece))
            if call.args_end is None:
                return out
        closer = {"hermes": "</tool_call>", "fence": "```"}.get(call.fmt.name)
        if closer is None:
            whole = closed_value(text, 0)
            if whole is not None:
                call.end = call.start + whole[1]
        else:
            at = text.find(closer, call.args_end)
            if at >= 0:
                call.end = call.start + at + len(closer)
        return out

    def finish(self, output: StructuredOutput | None) -> list[CallDelta]:
        """The closing pieces once the reply is parsed (see the class docstring); aligns ``output``'s ids."""
        pieces, self.pending = list(self.pending), []
        valid = list(output.tool_calls) if output is not None else []
        invalid = list(output.invalid_tool_calls) if output is not None else []
        used: set[int] = set()
        bad: set[int] = set()
        for call in self.calls:
            if call.name is None:
                continue
            args = self.raw[call.start:][call.args_start:call.args_end] if call.args_end is not None else None
            read = self.tools.read(call.name, args) if args is not None else None
            j = next((j for j, c in enumerate(valid) if j not in used and isinstance(read, ToolCall)
                      and c.name == read.name and c.arguments == read.arguments), None)
            if j is not None:
                used.add(j)
                valid[j] = ToolCall(valid[j].name, valid[j].arguments, call.id)
                continue
            pieces.append(CallDelta(call.index, arguments=_breaker(call.sent)))
            k = next((k for k, c in enumerate(invalid) if k not in bad and c.get("name") == call.name), None)
            if k is not None:
                bad.add(k)
                invalid[k] = {**invalid[k], "id": call.id}
        index = len(self.calls)
        for j, c in enumerate(valid):
            if j not in used:
                pieces.append(CallDelta(index, c.id, c.name, json.dumps(c.arguments, ensure_ascii=False)))
                index += 1
        if output is not None:
            output.tool_calls[:] = valid
            output.invalid_tool_calls[:] = invalid
        return pieces

    def content(self, text: str, output: StructuredOutput | None) -> str:
        """The reply's final content: without the calls once call pieces were streamed (they are not content),
        else :func:`reply_content`'s rule."""
        if output is not None and self.streamed_calls:
            return output.content
        return reply_content(text, output)

    def rest(self, content: str) -> str:
        """What to send after the streamed text so that the concatenation is ``content``."""
        return content[self.shown:] if content.startswith(self.text) else ""
