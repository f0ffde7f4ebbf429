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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ensemble_core.constraints.tool_parsers import (
    AutoParser,
    ToolCall,
    ToolCallParser,
    ToolSet,
    json_sequence,
    schema_error,
    schema_validator,
)
from ensemble_core.errors import InputError, InvalidOptionError

__all__ = [
    "CALL_TAG", "JSON_INSTRUCTIONS", "SCHEMA_INSTRUCTIONS", "TOOL_CHOICES", "TOOL_INSTRUCTIONS",
    "ReplyStream", "StructuredOutput", "StructuredRequest", "ToolCall", "function_spec", "json_sequence",
    "parse_output", "reply_content", "schema_of", "structured_request", "tool_instructions", "with_instructions",
]

TOOL_CHOICES = ("auto", "none", "required", "any")

#: The system-prompt instruction for members whose template knows no tools.
TOOL_INSTRUCTIONS = (
    "You can call these tools:\n{tools}\n\n"
    "To call a tool, answer with one JSON object and nothing else: "
    '{{"name": "<tool name>", "arguments": {{<the arguments>}}}}. '
    "{when}"
)
SCHEMA_INSTRUCTIONS = "Answer with one JSON object that matches this JSON Schema, and nothing else:\n{schema}"
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
    requested JSON Schema (``{}`` for any JSON object) or None.
    """

    tools: tuple[dict[str, Any], ...] = ()
    choice: str = "auto"
    schema: dict[str, Any] | None = None

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
    return {"name": spec["name"], "description": str(spec.get("description") or ""), "parameters": dict(params)}


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
    if kind in (None, "object", "array", "string", "number", "integer", "boolean", "null") or any(
            k in response_format for k in ("properties", "anyOf", "oneOf", "allOf", "$ref", "enum", "const")):
        return dict(response_format)
    raise InvalidOptionError("response_format", response_format,
                             "a JSON Schema dict or {'type': 'json_schema' | 'json_object' | 'text', ...}")


def structured_request(tools: Any = None, tool_choice: Any = None, response_format: Any = None) -> StructuredRequest:
    """Validate a request's ``tools`` / ``tool_choice`` / ``response_format`` (typed errors name the problem).

    The tools' parameters and the response format's schema are compiled into their
    ``jsonschema`` validators here (cached), so that a schema the validator rejects raises
    :class:`~ensemble_core.errors.InvalidSchemaError` naming the tool when the request is
    made, not when a reply is read.
    """
    if tools is not None and (isinstance(tools, (str, Mapping)) or not isinstance(tools, Sequence)):
        raise InvalidOptionError("tools", tools, "a list of tool specs")
    specs = tuple(function_spec(t, i) for i, t in enumerate(tools or ()))
    names = [s["name"] for s in specs]
    if isinstance(tool_choice, Mapping):
        tool_choice = (tool_choice.get("function") or {}).get("name") or tool_choice.get("name")
    choice = "auto" if tool_choice is None else tool_choice
    if not isinstance(choice, str):
        raise InvalidOptionError("tool_choice", tool_choice, "'auto', 'none', 'required', 'any' or a tool name")
    if choice not in TOOL_CHOICES:
        if choice not in names:
            from ensemble_core.errors import UnknownToolError

            raise UnknownToolError(choice, names)
    if choice in ("required", "any") and not specs:
        raise InvalidOptionError("tool_choice", tool_choice, "'auto' or 'none' when no tools are given")
    if choice == "any":
        choice = "required"
    schema = schema_of(response_format)
    ToolSet(specs).check()
    if schema is not None:
        schema_validator(schema or _ANY_OBJECT, "response_format")
    return StructuredRequest(specs, choice, schema)


def tool_instructions(request: StructuredRequest) -> str:
    """The system-prompt text for members whose template does not render tools itself."""
    lines = [json.dumps(t, ensure_ascii=False) for t in request.tools]
    if request.choice == "required":
        when = "You must call one of the tools now."
    elif request.choice not in ("auto", "none"):
        when = f"You must call the tool {request.choice!r} now."
    else:
        when = "If no tool is needed, answer in plain text."
    return TOOL_INSTRUCTIONS.format(tools="\n".join(lines), when=when)


def with_instructions(messages: list[dict[str, Any]], request: StructuredRequest, native_tools: bool) -> list[dict[str, Any]]:
    """``messages`` with the request's instructions added to the (first) system message."""
    parts = []
    if request.tools and request.choice != "none" and not native_tools:
        parts.append(tool_instructions(request))
    if request.schema is not None and not request.forced_call:
        parts.append(SCHEMA_INSTRUCTIONS.format(schema=json.dumps(request.schema, ensure_ascii=False))
                     if request.schema else JSON_INSTRUCTIONS)
    if not parts:
        return messages
    text = "\n\n".join(parts)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


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
      (``parsed`` keeps the value, as before); None when it matches.
    """

    content: str
    tool_calls: list[ToolCall] = field(default_factory=list)
    parsed: Any = None
    invalid_tool_calls: list[dict[str, Any]] = field(default_factory=list)
    parse_error: str | None = None


def parse_output(text: str, request: StructuredRequest, parser: ToolCallParser | None = None) -> StructuredOutput:
    """Read a finished reply: its tool calls (forced or chosen in auto mode), or the requested JSON value.

    The one reader of every path (the generation loop calls it for every result; the
    adapters and the server read its :class:`StructuredOutput`). Calls are read by
    ``parser`` (default: every format, :class:`~ensemble_core.constraints.tool_parsers.AutoParser`)
    and checked against their tool's JSON Schema, forced ones too; ``tool_choice="none"``
    reads no calls. A response-format value is checked against its schema (``parse_error``).
    """
    if not request.active:
        return StructuredOutput(text)
    if request.tools and request.choice != "none":
        found = (parser or _DEFAULT_PARSER).parse(text, ToolSet(request.tools))
        if found is not None and found.found:
            return StructuredOutput(found.content, list(found.calls),
                                    invalid_tool_calls=[c.as_dict() for c in found.invalid])
    if request.schema is not None:
        return _value(text, request.schema)
    return StructuredOutput(text)


def _value(text: str, schema: Mapping[str, Any]) -> StructuredOutput:
    """A response-format reply: its JSON value, and why it is not a valid one (not JSON, or breaks the schema)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return StructuredOutput(text, parse_error=f"the reply is not valid JSON: {e}")
    error = schema_error(value, schema_validator(schema or _ANY_OBJECT, "response_format"))
    return StructuredOutput(text, parsed=value,
                            parse_error=None if error is None else f"the value does not match the schema: {error}")


def reply_content(text: str, output: StructuredOutput | None) -> str:
    """A reply's message text: the reply, without the calls when it holds tool calls.

    A reply with only invalid calls keeps its whole text: the user (or the agent loop)
    sees what the model wrote, and ``invalid_tool_calls`` says why it did not run.
    """
    return output.content if output is not None and output.tool_calls else text


# ----------------------------------------------------------------------------- streaming
def _tag_start(text: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of :data:`CALL_TAG`."""
    for k in range(min(len(CALL_TAG) - 1, len(text)), 0, -1):
        if text.endswith(CALL_TAG[:k]):
            return k
    return 0


class ReplyStream:
    """Which committed text of a request with tools may be streamed as content, and when.

    * A forced call (``tool_choice`` "any" / "required" / a name) is never text: nothing is
      streamed, the call arrives whole at the end.
    * ``tool_choice="auto"``: text is streamed as it comes while the reply cannot (yet) be a
      call. A reply that starts with ``{`` is held back to the end (it may be a call); text
      from a ``<tool_call>`` tag on is held back too, as is a tail that may still become
      that tag, and trailing whitespace (the parsed content is stripped).

    Both adapters and the server stream through it; :meth:`rest` gives the text that
    completes what was streamed to the final content.
    """

    def __init__(self, forced: bool) -> None:
        self.raw, self.shown, self.holding = "", 0, forced

    @classmethod
    def for_request(cls, request: StructuredRequest) -> ReplyStream | None:
        """The hold-back for a request with tools; None when every delta is text (no tools, or ``"none"``)."""
        if not request.tools or request.choice == "none":
            return None
        return cls(forced=request.forced_call)

    @property
    def text(self) -> str:
        """What has been shown so far."""
        return self.raw[:self.shown]

    def push(self, delta: str) -> str:
        """Add a committed delta; return the part that may be shown now (possibly empty)."""
        self.raw += delta
        if self.holding:
            return ""
        if self.raw.lstrip().startswith("{"):
            self.holding = True
            return ""
        tag = self.raw.find(CALL_TAG)
        if tag >= 0:
            self.holding, end = True, tag
        else:
            end = len(self.raw) - _tag_start(self.raw)
        end = len(self.raw[:end].rstrip())
        if end <= self.shown:
            return ""
        out, self.shown = self.raw[self.shown:end], end
        return out

    def rest(self, content: str) -> str:
        """What to send after the streamed text so that the concatenation is ``content``."""
        return content[self.shown:] if content.startswith(self.text) else ""
