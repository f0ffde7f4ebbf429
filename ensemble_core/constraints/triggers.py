"""Where a tool call starts in free text: the trigger patterns of the formats models write calls in.

One place for what both sides of ``tool_choice="auto"`` need: the lazy grammar
(:mod:`~ensemble_core.constraints.lazy`) activates a call's grammar at a trigger in the
member's bytes, and streaming (:class:`~ensemble_core.constraints.structured.ReplyStream`)
stops streaming content there and streams the call's pieces instead. Pure text functions,
no grammar engine: both modules above import them, never the other way round.

Triggers (:data:`FORMATS`), the earliest in the text wins:

* ``hermes``: Qwen's (and Hermes') ``<tool_call>`` anywhere; the grammar starts after it;
* ``fence``: a ```` ```json ```` (or bare ```` ``` ````) fence whose content starts a call
  object (``{"name"``); the grammar covers the fence;
* ``json``: a call object ``{"name"`` at the start of a line.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "CALL_SHAPES",
    "FENCE",
    "FORMATS",
    "HERMES",
    "JSON_LINE",
    "TRIGGER_SPAN",
    "CallFormat",
    "call_parts",
    "closed_value",
    "find_text_trigger",
    "find_trigger",
    "format_named",
    "trigger_tail",
]

_WS = rb"[ \t\r\n]{0,20}"
_CALL_OBJECT = rb"\{" + _WS + rb'"name"'

#: Bytes before the end of the text that a trigger can span (the longest trigger is a fence with whitespace).
TRIGGER_SPAN = 96


@dataclass(frozen=True)
class CallFormat:
    """One way a call is written in free text: its trigger, and the grammar around the call's JSON.

    ``pattern`` is searched in the member's text (bytes); its group ``g`` is where the
    grammar starts (the trigger's own text is part of the grammar when the group covers it).
    ``before`` / ``after`` are Lark snippets around the call (:func:`~.grammar.call_format_constraint`).
    ``closer`` is a literal some tokenizers write as one added token (Qwen's ``</tool_call>``):
    the grammar engine never lets added tokens spell text, so the pipeline allows that token
    where the grammar accepts its text.
    """

    name: str
    pattern: re.Pattern[bytes]
    before: str = ""
    after: str = ""
    closer: bytes = b""
    text_pattern: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "text_pattern", re.compile(self.pattern.pattern.decode()))


HERMES = CallFormat("hermes", re.compile(rb"<tool_call>(?P<g>)"), "WS?", 'WS? "</tool_call>"', b"</tool_call>")
FENCE = CallFormat("fence", re.compile(rb"(?P<g>```(?:json|JSON)?" + _WS + _CALL_OBJECT + rb")"),
                   '"```" ("json" | "JSON")? WS?', 'WS? "```"')
#: Indentation before a ``{"name"`` line is bounded like the whitespace inside triggers, so that every trigger
#: spans at most :data:`TRIGGER_SPAN` bytes (scans then start that far back, not at the text's start).
_INDENT = rb"[ \t]{0,20}"
JSON_LINE = CallFormat("json", re.compile(rb"(?m)^" + _INDENT + rb"(?P<g>" + _CALL_OBJECT + rb")"))
#: Every call format, in no particular order (the earliest trigger in the text wins).
FORMATS: tuple[CallFormat, ...] = (HERMES, FENCE, JSON_LINE)
_BY_NAME = {f.name: f for f in FORMATS}


def format_named(name: str) -> CallFormat:
    """The call format called ``name`` (``"hermes"``, ``"fence"``, ``"json"``)."""
    return _BY_NAME[name]

#: Where calls are forbidden (``tool_choice="none"``, the answer asked for after a repeated call): what starts
#: call-shaped text at all, broader than the triggers: the bundled members imitate the calls of the
#: history as ``{"name}: ...`` or ``{"response": ...}`` when only ``{"name"`` is masked.
CALL_SHAPES: tuple[re.Pattern[bytes], ...] = (
    re.compile(rb"<tool_call>"), re.compile(rb"(?m)^" + _INDENT + rb"\{"), re.compile(rb"```(?:json|JSON)?" + _WS + rb"\{"))


def _earliest(text: Any, pos: int, pattern: Callable[[CallFormat], re.Pattern[Any]]) -> tuple[CallFormat, re.Match[Any]] | None:
    best: tuple[CallFormat, re.Match[Any]] | None = None
    for fmt in FORMATS:
        m = pattern(fmt).search(text, pos)
        if m is not None and (best is None or m.start() < best[1].start()):
            best = (fmt, m)
    return best


def find_trigger(text: bytes, pos: int = 0) -> tuple[CallFormat, re.Match[bytes]] | None:
    """The earliest trigger in ``text`` at or after ``pos`` (a line start is a line start of the whole text)."""
    return _earliest(text, pos, lambda f: f.pattern)


def find_text_trigger(text: str, pos: int = 0) -> tuple[CallFormat, re.Match[str]] | None:
    """:func:`find_trigger` on a ``str`` (what streaming sees)."""
    return _earliest(text, pos, lambda f: f.text_pattern)


_NAME_PREFIX = r'(?:"(?:n(?:a(?:m(?:e)?)?)?)?)?'
_OBJECT_PREFIX = r"(?:\{[ \t\r\n]*" + _NAME_PREFIX + r")?"
_PARTIAL = re.compile(
    r"(?m)(?:^[ \t]*\{[ \t\r\n]*" + _NAME_PREFIX + r"\Z)"  # a call object at a line start, not yet "name"
    r"|(?:<(?:t(?:o(?:o(?:l(?:_(?:c(?:a(?:l(?:l)?)?)?)?)?)?)?)?)?\Z)"  # part of <tool_call>
    r"|(?:`{1,2}\Z)|(?:```(?:j(?:s(?:o(?:n)?)?)?|J(?:S(?:O(?:N)?)?)?)?[ \t\r\n]*" + _OBJECT_PREFIX + r"\Z)")


def trigger_tail(text: str) -> int:
    """Where the tail of ``text`` that may still become a trigger starts (``len(text)`` when none may).

    Streaming holds that tail back: ``Let me <tool`` shows ``Let me `` until the next delta
    says whether a call starts.
    """
    start = max(0, len(text) - TRIGGER_SPAN)
    m = _PARTIAL.search(text, start)  # every alternative ends at the end of the text and is never empty
    return m.start() if m is not None else len(text)


_NAME_VALUE = re.compile(r'"name"[ \t\r\n]*:[ \t\r\n]*"((?:[^"\\]|\\.)*)"')
_ARGUMENTS_KEY = re.compile(r'"arguments"[ \t\r\n]*:[ \t\r\n]*')
_DECODER = json.JSONDecoder()


def call_parts(text: str) -> tuple[str | None, int | None]:
    """The tool name of a call's text so far (once its string is closed) and where its arguments value starts
    (its first character; None until it is written)."""
    name = _NAME_VALUE.search(text)
    if name is None:
        return None, None
    try:
        decoded = json.loads(f'"{name.group(1)}"')
    except json.JSONDecodeError:
        decoded = name.group(1)
    args = _ARGUMENTS_KEY.search(text, name.end())
    return decoded, args.end() if args and args.end() < len(text) else None


def closed_value(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value at ``start`` and the index after it, or None while it is incomplete."""
    try:
        return _DECODER.raw_decode(text, start)
    except json.JSONDecodeError:
        return None
