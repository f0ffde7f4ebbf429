"""Reading tool calls out of a reply: one parser per format models write, arguments checked by JSON Schema.

With ``tool_choice="auto"`` decoding is free, and models write a call the way their
training taught them, not the way the prompt asked. Seen on the bundled pair: Qwen writes
Hermes ``<tool_call>`` tags or a fenced ```` ```json ```` block, sometimes after a sentence
("Sure! {...}"); SmolLM2 a bare JSON object. Like vLLM's tool parsers, each format is
one :class:`ToolCallParser` (one class per model family, registered by name, see
:data:`PARSERS`), and :class:`AutoParser` tries them in an order where a more specific
marker wins over a more general one, so a reply in any of them is read without the user
naming the family:

1. :class:`HermesParser`: ``<tool_call>{json}</tool_call>`` (Hermes, Qwen2.5; several tags =
   parallel calls);
2. :class:`MistralParser`: ``[TOOL_CALLS] [{...}, ...]`` (and ``[TOOL_CALLS]name[ARGS]{...}``);
3. :class:`Llama3Parser`: ``<|python_tag|>`` and/or ``{"name": ..., "parameters": {...}}``
   objects separated by ``;`` (Llama 3.1-3.3);
4. :class:`JsonParser`: the generic rest: a bare call object, a list of them, one per line,
   fenced blocks, a call after (or between) sentences.

A reply in none of these formats (including text that merely shows braces, or JSON and code
that do not call a known tool) is text. Every call object may name its arguments
``"arguments"`` (OpenAI, Hermes) or ``"parameters"`` (Llama), and the arguments may be a JSON
string (OpenAI's wire format), which is decoded.

Every call, whatever path produced it (auto, forced, streamed, served), is checked by
:class:`ToolSet`: an unknown tool, arguments that are not an object, or arguments that
break the tool's JSON Schema (checked by ``jsonschema``, Draft 2020-12 unless the schema's
``$schema`` says otherwise, ``$defs``/``$ref`` resolved) make an :class:`InvalidCall` with
the validator's message, never a :class:`ToolCall`. The schema checked is the one the
grammar of forced calls enforces (:func:`tool_parameters`): a tool without parameters
accepts ``{}`` only, and a top-level object closes (``additionalProperties: false``) unless
the schema says otherwise.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import regex  # ECMA-262 patterns (Unicode properties, named groups): a dependency of transformers and of [agents]

from ensemble_core.errors import (
    InvalidOptionError,
    InvalidSchemaError,
    MissingDependencyError,
    UnsupportedSchemaFeatureError,
)

__all__ = [
    "PARSERS",
    "AutoParser",
    "HermesParser",
    "InvalidCall",
    "JsonParser",
    "Llama3Parser",
    "MistralParser",
    "ParsedCalls",
    "ToolCall",
    "ToolCallParser",
    "ToolSet",
    "get_parser",
    "json_sequence",
    "located",
    "schema_error",
    "schema_validator",
    "tool_parameters",
]

#: The parameters of a tool that declares none: an object with no properties (closed by :func:`tool_parameters`).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
#: The keys a call object may carry its arguments under (OpenAI / Hermes, Llama 3).
ARGUMENT_KEYS = ("arguments", "parameters")
INSTALL = "pip install 'jsonschema>=4.18'  (or the project's [agents] extra)"
_SCHEMA_FIX = ("Fix the schema where the message points (it must be a valid JSON Schema, Draft 2020-12 unless "
               "'$schema' names another draft).")
_CALL_SHAPE = '{"name": "<tool name>", "arguments": {<the arguments>}}'


def new_call_id() -> str:
    """A fresh call id in OpenAI's style (``call_`` + 24 hex digits)."""
    return "call_" + uuid.uuid4().hex[:24]


# ----------------------------------------------------------------------------- results
@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is a dict; ``id`` is generated (``call_<hex>``)."""

    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "arguments": self.arguments}


@dataclass(frozen=True)
class InvalidCall:
    """A started call that cannot be run: ``args`` is the text the model wrote, ``error`` says why.

    The dict form (:meth:`as_dict`) is LangChain's ``InvalidToolCall`` without its ``type``.
    """

    name: str | None
    args: str | None
    error: str
    id: str = field(default_factory=new_call_id)

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "args": self.args, "id": self.id, "error": self.error}


Read = ToolCall | InvalidCall


@dataclass(frozen=True)
class ParsedCalls:
    """What a parser read: ``content`` (the reply's text outside the calls), the calls, the invalid ones."""

    content: str
    calls: tuple[ToolCall, ...] = ()
    invalid: tuple[InvalidCall, ...] = ()

    @classmethod
    def of(cls, content: str, items: Iterable[Read]) -> ParsedCalls:
        items = list(items)
        return cls(content, tuple(c for c in items if isinstance(c, ToolCall)),
                   tuple(c for c in items if isinstance(c, InvalidCall)))

    @property
    def found(self) -> bool:
        """Whether the reply holds a call at all (valid or not)."""
        return bool(self.calls or self.invalid)


# ----------------------------------------------------------------------------- schemas
def _jsonschema() -> Any:
    """Import jsonschema lazily: the core works without it until a request carries tools or a schema."""
    try:
        import jsonschema
    except ImportError as e:  # pragma: no cover - exercised by monkeypatching sys.modules
        raise MissingDependencyError("jsonschema", "checking tool-call arguments and JSON output against their "
                                     "schemas", INSTALL) from e
    return jsonschema


def tool_parameters(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The schema a tool's arguments must match, for the grammar of forced calls and for validation alike.

    Its ``parameters``, or an object without properties when it declares none; a top-level
    object gets ``additionalProperties: false`` unless the schema says: a function cannot
    accept parameters it does not declare. One function for both, so that a forced call and
    a call the model chose are held to the same rule.
    """
    params = spec.get("parameters") or NO_PARAMETERS
    if not isinstance(params, Mapping):
        raise InvalidSchemaError(f"tool {spec.get('name')!r} parameters: expected a dict (a JSON Schema), got "
                                 f"{type(params).__name__}", "Pass 'parameters' as a JSON Schema dict.")
    params = dict(params)
    if params.get("type") == "object" and "additionalProperties" not in params:
        params["additionalProperties"] = False
    return params


def _refs(schema: Any) -> Iterator[str]:
    """Every ``$ref`` string in a schema (keys of ``properties`` named ``$ref`` map to dicts, not strings)."""
    if isinstance(schema, Mapping):
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str):
                yield value
            else:
                yield from _refs(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from _refs(item)


def _check_refs(schema: Mapping[str, Any], draft: Any) -> None:
    """Every ``$ref`` must resolve inside the schema: a validator that fetches documents is not wanted here."""
    from referencing import Registry, Resource
    from referencing.exceptions import Unresolvable

    resolver = Registry().resolver_with_root(Resource.from_contents(schema, default_specification=draft))
    for ref in dict.fromkeys(_refs(schema)):
        try:
            resolver.lookup(ref)
        except Unresolvable as e:
            if ref.startswith("#"):
                raise InvalidSchemaError(f"$ref {ref!r} points to nothing in the schema ({e})",
                                         "Define what it names under '$defs' or fix the reference.") from e
            raise UnsupportedSchemaFeatureError(
                "$ref to another document", f"$ref {ref!r} names another document, which is not fetched",
                "Copy that schema under '$defs' and refer to it as '#/$defs/<name>'.") from e


@functools.lru_cache(maxsize=512)
def _compiled(schema_json: str) -> Any:
    jsonschema = _jsonschema()
    from referencing import Registry
    from referencing.jsonschema import DRAFT202012, specification_with

    schema = json.loads(schema_json)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    checker = _ecma_format_checker(cls)
    try:
        cls.check_schema(schema, format_checker=checker)
    except jsonschema.exceptions.SchemaError as e:
        where = "" if e.json_path == "$" else f" (at {e.json_path})"
        raise InvalidSchemaError(f"{e.message}{where}", _SCHEMA_FIX) from e
    if isinstance(schema, Mapping):
        _check_refs(schema, specification_with(cls.META_SCHEMA["$schema"], default=DRAFT202012))
    # An empty registry: a $ref is resolved inside the schema, never fetched (checked above).
    return _ecma_validator(cls)(schema, registry=Registry(), format_checker=checker)


_ECMA_CODEPOINT = re.compile(r"(?<!\\)\\u\{([0-9A-Fa-f]{1,6})\}")
_ECMA_NAMED_GROUP = re.compile(r"\(\?<(?![=!])")


@functools.lru_cache(maxsize=512)
def ecma_regex(pattern: str) -> Any:
    """A ``pattern`` (JSON Schema's dialect: ECMA-262) compiled for Python, as the grammar engine reads it.

    Python's ``re`` lacks ``\\p{L}`` (Unicode properties), ``(?<name>...)`` and ``\\u{1F600}``; the
    ``regex`` module (the [agents] extra's dependency, and transformers') has the first two, the code point escape is
    rewritten. A pattern neither reads raises (``re.error`` / ``regex.error``).
    """
    text = _ECMA_CODEPOINT.sub(lambda m: regex.escape(chr(int(m.group(1), 16))), pattern)
    return regex.compile(_ECMA_NAMED_GROUP.sub("(?P<", text))


def _is_ecma_regex(instance: Any) -> bool:
    if isinstance(instance, str):
        ecma_regex(instance)
    return True


@functools.cache
def _ecma_format_checker(cls: Any) -> Any:
    """``cls``'s format checker with the ``regex`` format read as ECMA-262 (:func:`ecma_regex`), not Python's ``re``."""
    checker = _jsonschema().FormatChecker(formats=())
    checker.checkers = {**cls.FORMAT_CHECKER.checkers, "regex": (_is_ecma_regex, (Exception,))}
    return checker


def _ecma_pattern(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    if validator.is_type(instance, "string") and not ecma_regex(pattern).search(instance):
        yield _jsonschema().ValidationError(f"{instance!r} does not match {pattern!r}")


@functools.cache
def _ecma_validator(cls: Any) -> Any:
    """``cls`` whose ``pattern`` keyword reads ECMA-262 (:func:`ecma_regex`), as the grammar does."""
    return _jsonschema().validators.extend(cls, {"pattern": _ecma_pattern})


def schema_validator(schema: Any, where: str = "") -> Any:
    """The (cached) ``jsonschema`` validator of ``schema``; a schema it rejects raises a typed error here.

    ``where`` (e.g. ``"tool 'multiply' parameters"``) starts the error's problem, so that it
    names which schema of the request is wrong. Raises
    :class:`~ensemble_core.errors.InvalidSchemaError` (a malformed schema, a ``$ref`` to
    nothing) or :class:`~ensemble_core.errors.UnsupportedSchemaFeatureError` (a ``$ref`` to
    another document).
    """
    try:
        key = json.dumps(schema, allow_nan=False, ensure_ascii=False)
    except (TypeError, ValueError) as e:
        raise located(InvalidSchemaError(f"it is not JSON ({e})", "Use only dicts, lists, strings, numbers, booleans "
                                         "and None in the schema."), where) from e
    try:
        return _compiled(key)
    except InvalidSchemaError as e:
        raise located(e, where) from e


def located(error: InvalidSchemaError, where: str) -> InvalidSchemaError:
    """``error`` (same type) with ``where`` (e.g. ``"tool 'multiply' parameters"``) in front of its problem."""
    if not where:
        return error
    if isinstance(error, UnsupportedSchemaFeatureError):
        return UnsupportedSchemaFeatureError(error.feature, f"{where}: {error.problem}", error.fix)
    return InvalidSchemaError(f"{where}: {error.problem}", error.fix)


#: How many of the validator's messages an error quotes (the best one first).
MAX_SCHEMA_MESSAGES = 3


def schema_error(value: Any, validator: Any) -> str | None:
    """The validator's messages for ``value`` (where each applies), best match first; None when it matches.

    The best match (``jsonschema.exceptions.best_match``) leads; up to
    :data:`MAX_SCHEMA_MESSAGES` - 1 others follow, so that a model told why its call failed
    learns every key it got wrong, not only the first.
    """
    errors = list(validator.iter_errors(value))
    if not errors:
        return None
    best = _jsonschema().exceptions.best_match(errors)
    others = [e for e in errors if e is not best]
    return "; ".join(dict.fromkeys(_located_message(e) for e in [best, *others][:MAX_SCHEMA_MESSAGES]))


def _located_message(error: Any) -> str:
    return error.message if error.json_path == "$" else f"{error.message} (at {error.json_path})"


class ToolSet:
    """The tools of a request by name, each with the validator of its arguments.

    :meth:`read` turns what a parser found (a name and arguments) into a :class:`ToolCall`
    or an :class:`InvalidCall`; :meth:`check` compiles every validator up front, so that a
    schema the validator rejects raises when the tools are bound, not when a reply is read.
    """

    def __init__(self, specs: Iterable[Mapping[str, Any]]) -> None:
        self.specs: dict[str, Mapping[str, Any]] = {}
        for spec in specs:
            self.specs.setdefault(spec["name"], spec)

    @property
    def names(self) -> list[str]:
        return list(self.specs)

    def validator(self, name: str) -> Any:
        return schema_validator(tool_parameters(self.specs[name]), f"tool {name!r} parameters")

    def check(self) -> None:
        """Compile every tool's validator (typed errors name the tool)."""
        for name in self.specs:
            self.validator(name)

    def read(self, name: Any, arguments: Any, raw: str | None = None) -> Read:
        """A call of ``name`` with ``arguments`` (a dict, or JSON text of one), checked against the tool's schema."""
        if not isinstance(name, str) or not name:
            return InvalidCall(None, raw, f"the call names no tool; write {_CALL_SHAPE}")
        if name not in self.specs:
            return InvalidCall(name, raw, f"unknown tool {name!r}; the tools are: {', '.join(self.names)}")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as e:
                return InvalidCall(name, arguments, f"the arguments of {name!r} are not valid JSON: {e}")
        text = _dumps(arguments)
        if not isinstance(arguments, Mapping):
            return InvalidCall(name, text, f"the arguments of {name!r} must be a JSON object, got {type(arguments).__name__}")
        error = schema_error(arguments, self.validator(name))
        if error is not None:
            return InvalidCall(name, text, f"the arguments do not match the parameters of {name!r}: {error}")
        return ToolCall(name, dict(arguments))


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)


# ----------------------------------------------------------------------------- JSON helpers
_DECODER = json.JSONDecoder()
#: A call that was started: an object (or a list of objects) whose first key is a call's.
_STARTED = re.compile(r'\[?\s*\{\s*(?:"(?:name|function)"\s*:|"type"\s*:\s*"function")')
_NAME_HINT = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


def json_sequence(text: str) -> list[Any] | None:
    """The JSON values ``text`` consists of, separated by whitespace only (None if it is anything else)."""
    values, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return values or None
        try:
            value, i = _DECODER.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _json_error(text: str) -> str:
    """Why ``text`` is not JSON (for an invalid call's error)."""
    try:
        json.loads(text)
    except json.JSONDecodeError as e:
        start = min((p for p in (text.find("{"), text.find("[")) if p >= 0), default=-1)
        if start >= 0 and _balanced_end(text, start) is None:
            return f"the call is not valid JSON: it ends before the JSON does (cut by the token budget?): {e.msg}"
        return f"the call is not valid JSON: {e}"
    return "the call is not valid JSON"


def _balanced_end(text: str, start: int) -> int | None:
    """The index after the bracket that closes the one at ``start`` (strings respected), None if it never closes."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def _broken(text: str) -> InvalidCall:
    """A started call whose JSON does not parse; the name is recovered when it was written."""
    hint = _NAME_HINT.search(text)
    name = None
    if hint:
        try:
            name = json.loads(f'"{hint.group(1)}"')
        except json.JSONDecodeError:
            name = hint.group(1)
    return InvalidCall(name, text, _json_error(text))


#: Where a call was cut out of the text (a character no reply holds).
_CUT = "\x00"


def _join(pieces: Iterable[str]) -> str:
    """The text outside the calls: the pieces between them, trimmed where a call was cut out."""
    return "\n".join(p.strip() for p in pieces if p.strip())


# ----------------------------------------------------------------------------- reading call objects
def read_call(value: Any, tools: ToolSet) -> Read | None:
    """A call object → a call (valid or not); any other JSON value → None (it is not a call).

    A call object has a string ``"name"`` and its arguments under ``"arguments"`` or
    ``"parameters"`` (OpenAI's ``{"type": "function", "function": {...}}`` is unwrapped). A
    known tool's name alone is a call without arguments; a known name beside other keys is
    a call whose arguments were written in the wrong place (invalid, the error shows the
    shape). An object with an unknown name and no arguments is data, e.g. ``{"name": "Ada"}``.
    """
    if not isinstance(value, Mapping):
        return None
    if isinstance(value.get("function"), Mapping) and value.get("type", "function") == "function":
        value = value["function"]
    name = value.get("name")
    if not isinstance(name, str):
        return None
    key = next((k for k in ARGUMENT_KEYS if k in value), None)
    if key is not None:
        return tools.read(name, value[key], _dumps(value[key]))
    if name not in tools.specs:
        return None
    extra = sorted(set(value) - {"name", "type", "id"})
    if extra:
        found = ", ".join(map(repr, extra))
        return InvalidCall(name, _dumps(dict(value)),
                           f'the arguments of {name!r} must be under "arguments" (found {found} beside the name); '
                           f"write {_CALL_SHAPE}")
    return tools.read(name, {})


def read_calls(values: Sequence[Any], tools: ToolSet) -> list[Read] | None:
    """Calls from JSON values (a list of call objects counts as its items); None unless every value is a call."""
    out: list[Read] = []
    for value in values:
        items = value if isinstance(value, list) and value else [value]
        for item in items:
            call = read_call(item, tools)
            if call is None:
                return None
            out.append(call)
    return out or None


def _read_body(body: str, tools: ToolSet) -> list[Read]:
    """The calls inside a marker that says "this is a call" (a tag, ``[TOOL_CALLS]``): anything else is invalid."""
    body = _unfence(body.strip())
    if not body:
        return [InvalidCall(None, body, f"the call is empty; write {_CALL_SHAPE}")]
    values = json_sequence(body)
    if values is None:
        return [_broken(body)]
    calls = read_calls(values, tools)
    if calls is None:
        return [InvalidCall(None, body, f"the call is JSON but not a call object; write {_CALL_SHAPE}")]
    return calls


_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[ \t]*\n?(.*?)(```|\Z)", re.S)


def _unfence(text: str) -> str:
    """The inside of ``text`` when it is one fenced block, else ``text``."""
    m = _FENCE.fullmatch(text.strip())
    return m.group(2).strip() if m else text


# ----------------------------------------------------------------------------- parsers
class ToolCallParser(ABC):
    """Reads the calls of one format out of a finished reply (one subclass per model family).

    :meth:`parse` returns None when the reply is not in this format (so that another parser
    may try), else what it read: the calls, the started calls that cannot run, and the text
    outside them. Subclasses register by ``name`` in :data:`PARSERS`.
    """

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str, tools: ToolSet) -> ParsedCalls | None:
        """The calls in ``text``, or None when ``text`` holds no call in this format."""


#: Parsers by name (``"auto"``: every format, in :class:`AutoParser`'s order).
PARSERS: dict[str, type[ToolCallParser]] = {}


def register(cls: type[ToolCallParser]) -> type[ToolCallParser]:
    """Class decorator: make a parser available by its ``name`` (:func:`get_parser`)."""
    PARSERS[cls.name] = cls
    return cls


@register
class HermesParser(ToolCallParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``: Hermes, Qwen2.5 (its chat template asks for it).

    Several tags are parallel calls. A tag that is never closed is read to the end of the
    reply: a complete call there is a call, JSON that stops short (the token budget cut the
    reply) is an invalid call. A fenced block inside a tag is read as its content.
    """

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    _TAG = re.compile(re.escape(OPEN) + r"(.*?)(?:" + re.escape(CLOSE) + r"|\Z)", re.S)
    #: A fence around the tags (Qwen sometimes fences them): its ends are left when the tags are cut out.
    _FENCE_OPENS, _FENCE_CLOSES = re.compile(r"```[\w+.-]*\s*\Z"), re.compile(r"\A\s*```")

    def parse(self, text: str, tools: ToolSet) -> ParsedCalls | None:
        if self.OPEN not in text:
            return None
        items: list[Read] = []
        pieces, last = [], 0
        for m in self._TAG.finditer(text):
            items.extend(_read_body(m.group(1), tools))
            pieces.append(text[last:m.start()])
            last = m.end()
        pieces.append(text[last:])
        for k in range(len(pieces)):
            if k < len(pieces) - 1:
                pieces[k] = self._FENCE_OPENS.sub("", pieces[k])
            if k > 0:
                pieces[k] = self._FENCE_CLOSES.sub("", pieces[k])
        return ParsedCalls.of(_join(p.replace(self.CLOSE, "") for p in pieces), items)


@register
class MistralParser(ToolCallParser):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (Mistral v3 tokenizers), and the newer
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11). Text before the marker is content."""

    name = "mistral"
    MARKER = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([\w.\-]+)\s*(?:\[CALL_ID\]\s*\w+\s*)?\[ARGS\](.*)", re.S)

    def parse(self, text: str, tools: ToolSet) -> ParsedCalls | None:
        if self.MARKER not in text:
            return None
        head, *parts = text.split(self.MARKER)
        items: list[Read] = []
        pieces = [head]
        for part in parts:
            named = self._NAMED.match(part)
            if named:
                args = named.group(2).strip()
                body, rest = _leading_json(args)
                items.append(tools.read(named.group(1), body) if body is not None else _broken(args))
                pieces.append(rest)
                continue
            start = len(part) - len(part.lstrip())
            end = _balanced_end(part, start) if part[start:start + 1] in ("[", "{") else None
            items.extend(_read_body(part[:end] if end else part, tools))
            pieces.append(part[end:] if end else "")
        return ParsedCalls.of(_join(pieces), items)


def _leading_json(text: str) -> tuple[Any, str]:
    """The JSON value at the start of ``text`` and the text after it; (None, text) when it does not parse."""
    try:
        value, end = _DECODER.raw_decode(text)
    except json.JSONDecodeError:
        return None, text
    return value, text[end:]


@register
class Llama3Parser(ToolCallParser):
    """Llama 3.1-3.3: ``<|python_tag|>`` (optional) then ``{"name": ..., "parameters": {...}}`` objects, ``;`` between them.

    Without the tag the reply must start with such an object (``"parameters"``, Llama's key),
    so that other JSON is left to :class:`JsonParser`.
    """

    name = "llama3"
    TAG = "<|python_tag|>"
    _SEPARATOR = re.compile(r"[\s;]*")

    def parse(self, text: str, tools: ToolSet) -> ParsedCalls | None:
        head, tagged, body = text.partition(self.TAG)
        if not tagged:
            head, body = "", text
            value, _ = _leading_json(body.strip())
            if not (isinstance(value, Mapping) and "parameters" in value and "name" in value):
                return None
        items: list[Read] = []
        rest, i = "", self._SEPARATOR.match(body).end()
        while i < len(body):
            try:
                value, end = _DECODER.raw_decode(body, i)
            except json.JSONDecodeError:
                if tagged or _STARTED.match(body, i):
                    items.append(_broken(body[i:].strip()))
                else:
                    rest = body[i:]
                break
            calls = read_calls([value], tools)
            if calls is not None:
                items.extend(calls)
            elif tagged:  # after the tag the model meant a call
                items.append(InvalidCall(None, _dumps(value), f"the call is JSON but not a call object; write {_CALL_SHAPE}"))
            else:
                rest = body[i:]
                break
            i = self._SEPARATOR.match(body, end).end()
        return ParsedCalls.of(_join([head, rest]), items)


@register
class JsonParser(ToolCallParser):
    """The generic JSON call: what the library's own instructions ask for, and what many small models write.

    Reads call objects (``{"name", "arguments"}``; ``"parameters"`` too), lists of them and
    several one after another (one per line), whole or inside fenced blocks (```` ```json ````
    or bare ```` ``` ````), anywhere in the reply: text before, between and after the calls
    ("Sure! {...}") is the content. A fence or an object that starts like a call
    (``{"name": ...``) but whose JSON breaks or ends early is an invalid call. JSON that is not
    a call and fenced code that is not JSON stay in the content as they are.
    """

    name = "json"

    def parse(self, text: str, tools: ToolSet) -> ParsedCalls | None:
        items: list[Read] = []
        pieces: list[str] = []
        last = 0
        for m in _FENCE.finditer(text):
            outside = text[last:m.start()]
            body = m.group(2).strip()
            values = json_sequence(body)
            calls = read_calls(values, tools) if values is not None else None
            if calls is None and values is None and _STARTED.match(body):
                calls = [_broken(body)]
            found, rest = self._bare(outside, tools)
            items.extend(found)
            pieces.extend(rest)
            if calls is None:  # code or data, not a call: kept as it is (and not searched for calls)
                pieces.append(m.group(0))
            else:
                items.extend(calls)
                pieces.append(_CUT)
            last = m.end()
        found, rest = self._bare(text[last:], tools)
        items.extend(found)
        pieces.extend(rest)
        if not items:
            return None
        return ParsedCalls.of(_join("".join(pieces).split(_CUT)), items)

    @staticmethod
    def _bare(text: str, tools: ToolSet) -> tuple[list[Read], list[str]]:
        """Calls written in ``text`` without a fence, and the text around them (one piece per gap)."""
        items: list[Read] = []
        pieces: list[str] = []
        last = i = 0
        while True:
            starts = [p for p in (text.find("{", i), text.find("[", i)) if p >= 0]
            if not starts:
                break
            start = min(starts)
            try:
                value, end = _DECODER.raw_decode(text, start)
            except json.JSONDecodeError:
                if not _STARTED.match(text, start):
                    i = start + 1
                    continue
                end = _balanced_end(text, start) or len(text)
                calls: list[Read] | None = [_broken(text[start:end])]
            else:
                calls = read_calls([value], tools)
                if calls is None:  # other JSON: skip it whole, so that objects nested in data are not calls
                    i = end
                    continue
            items.extend(calls)
            pieces.extend([text[last:start], _CUT])
            last = i = end
        pieces.append(text[last:])
        return items, pieces


class AutoParser(ToolCallParser):
    """Every format, the most specific marker first: Hermes tags, Mistral's marker, Llama 3, then generic JSON.

    The first parser that finds a call (valid or not) decides: a reply holds one format.
    The default of :func:`~ensemble_core.constraints.structured.parse_output`.
    """

    name = "auto"
    ORDER: ClassVar[tuple[str, ...]] = ("hermes", "mistral", "llama3", "json")

    def __init__(self, parsers: Sequence[ToolCallParser] | None = None) -> None:
        self.parsers = list(parsers) if parsers is not None else [PARSERS[n]() for n in self.ORDER]

    def parse(self, text: str, tools: ToolSet) -> ParsedCalls | None:
        for parser in self.parsers:
            found = parser.parse(text, tools)
            if found is not None and found.found:
                return found
        return None


PARSERS[AutoParser.name] = AutoParser


def get_parser(name: str = "auto") -> ToolCallParser:
    """The parser registered as ``name`` (``"auto"``, ``"hermes"``, ``"json"``, ``"llama3"``, ``"mistral"``)."""
    if name not in PARSERS:
        raise InvalidOptionError("tool_parser", name, "one of " + ", ".join(repr(n) for n in PARSERS))
    return PARSERS[name]()
