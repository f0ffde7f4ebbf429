"""Lazy tool-call grammars: free text until a call starts, then the call's grammar to its end.

With ``tool_choice="auto"`` the model decides whether to call a tool, so the reply cannot be
constrained from its first token (a forced call can, :func:`~.grammar.request_constraint`).
Left free, the bundled models write calls that do not parse (a call cut short, a fenced
block with two objects, arguments of the wrong type). The lazy grammar keeps the decision
free and makes a *started* call complete: every member's pipeline
(:class:`~ensemble_core.decoding.pipeline.TokenPipeline`) scans the text it accepts and
commits for a **trigger**, and from there decodes under the grammar of one call of the
request's tools, in its own tokenizer, to the call's end; then the text is free again (more
calls, text, or the end). This is llama.cpp's lazy grammar (trigger patterns over the
accumulated text, the grammar fed from a group of the match) and the idea of xgrammar's
structural tags, applied per member.

Triggers (:data:`FORMATS`, one per way the members write calls), in every member's pipeline,
because the text is shared (a Qwen drafter's ``<tool_call>`` is the verifiers' text too):

* ``hermes``: Qwen's (and Hermes') ``<tool_call>`` anywhere; the grammar starts after it:
  JSON whitespace, the call, ``</tool_call>``;
* ``fence``: a ```` ```json ```` (or bare ```` ``` ````) fence whose content starts a call
  object (``{"name"``); the grammar covers the fence: the call, then the closing fence;
* ``json``: a call object ``{"name"`` at the start of a line (the reply's first line, or
  the line after a call): what members instructed by the system prompt write
  (:func:`~.structured.tool_instructions`); the grammar covers the object.

The call is :func:`~.grammar.call_schema`'s (the forced call's): a known tool name, then
arguments that match that tool's parameters, closed. A ``{"name"`` object that was data
(``{"name": "Ada"}``) becomes a call of one of the tools: with tools bound and ``auto``, an
object starting with ``"name"`` on its own line is read as a call anyway.

Why a trigger scan here rather than llguidance's own lazy lexemes (``%llguidance {}`` with
a lazy text rule, ``StructTag``): the text before the call would run through the engine for
every token of every member (a mask per token over Gemma's 262k vocabulary), the loop
penalty and closing pressure of :class:`~.grammar.ConstraintState` would apply to free
text, and a trigger that is a special token for one member (Qwen's ``<tool_call>``) is
plain text for another; a byte scan of the committed text is the same for every tokenizer,
costs nothing until a trigger, and after it each member's mask is exact in its own
vocabulary because the grammar follows the committed *bytes* (:meth:`ConstraintState.accept_text`
starts at the trigger's group, which may lie inside one of the member's tokens).

**After a call, only calls.** Once a call is complete, the text that follows may be whitespace,
another call (a trigger, then its grammar) or the end of the reply, as in llama.cpp, whose lazy
grammar holds everything after its trigger to ``tool_call+``: prose after a call is never the
answer (the tool has not run yet) and goes into the history, where the members imitate it in
later turns. Seen with SpecEM in LlamaIndex (the agent suite's task 21): SmolLM2's segment
``\n```\n\nYou can use the `celsius_to_fahrenheit` function ...`` won after Qwen's fenced call,
and in the answer turn both members wrote that sentence again instead of the tool's result.
A member whose most likely token after a call would start prose ends its reply there, rather than
being pushed to its best token that is not prose (a call it did not choose). Each member's tokens are checked
among its :data:`AFTER_CALL_TOP_K` most likely (the end of the reply is always allowed after a
call); text before the first call stays free.

**A value or calls.** With a ``response_format`` next to the tools (LangChain's
``create_agent(..., response_format=Model)`` binds both on every model call), the reply is
either calls or the schema's value; prose is neither (the caller reads the answer as the
value). Before any call, each member's tokens are those the value's grammar allows (its mask,
loop penalty and closing pressure, :class:`~.grammar.ConstraintState`, fed the text after any
leading whitespace) and, where the member's first choice keeps the text whitespace then the start
of a call, the call's tokens it ranks above anything else: a call is the member's own choice, the
value the rule's; the reply may end once the value is complete. A
trigger makes the reply calls (a ``{"name"`` line is read as a call here as anywhere, even
where the schema's first property is ``name``). Seen on Qwen2.5-Coder-0.5B after the tool's
result (``12 * 34``): it wrote the schema back (``{"description": "The final answer ...",
"properties": {"answer": {"description": "408", ...``), which the answer turn of
:func:`~ensemble_core.serving.runtime.settle` then had to ask for again; under the rule the
reply itself is ``{"answer": "408"}``. Text committed without the mask that is neither
(``unvalued``) leaves the rule, and the answer turn still catches a reply that is not a value.

Two more rules live here:

* **Answered calls are answered, not repeated** (``GenerationConfig.exclude_repeated_calls``,
  on by default). The bundled models' failure mode in agents: after the tool's result they
  write the same call again, until the agent's step limit, or feed the result back into the
  tool. A grammar cannot forbid it without harm: JSON Schema's ``not`` is not supported by
  llguidance, and masking the token that would close the repeated arguments (tried first)
  only made Qwen write ``"b": 340`` instead of ``34``, a wrong call whose result misleads the
  next step. So a call equal (name, and arguments by value: ``7`` = ``7.0``) to one whose
  result is in the history, or to such a call fed its own result (:func:`answered_calls`), or
  to one made earlier in the reply may close, and then the reply **ends** (only the member's
  end-of-reply tokens are allowed: nothing it writes after such a call is needed). The
  adapters and the server then drop the repeated call and ask the ensemble for the answer
  instead (:func:`~ensemble_core.serving.runtime.settle`): the same conversation with calls
  forbidden (``tool_choice="none"``) and one more user turn, :data:`ANSWER_REQUEST`. (Making
  the member write its answer right after its repeated call, tried second, gave ``408.0`` for
  numbers but ``2021-04-14 14:45:45`` for "the capital of Kenya"; asked in a turn of its own,
  Qwen2.5-Coder-0.5B answered 4 of 4 probes right.) Every member follows the same text, so
  all end at once.
* ``tool_choice="none"``: the tools are not offered, and no trigger may be completed: a
  token that would complete one among the member's 64 most likely is masked, so the
  member answers in text instead of imitating the calls of the history.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ensemble_core.constraints.grammar import (
    ConstraintState,
    JsonConstraint,
    call_format_constraint,
    call_schema,
    compile_for_member,
)
from ensemble_core.constraints.repetition import LoopPenalty
from ensemble_core.constraints.structured import unique_names
from ensemble_core.constraints.triggers import (
    CALL_SHAPES,
    FORMATS,
    TRIGGER_SPAN,
    CallFormat,
    call_parts,
    closed_value,
    find_trigger,
    format_named,
    trigger_tail,
)
from ensemble_core.errors import MissingDependencyError
from ensemble_core.text.chat import normalize_messages
from ensemble_core.text.distributions import member_table

__all__ = [
    "ANSWER_REQUEST",
    "FORMATS",
    "CallFormat",
    "LazyCalls",
    "LazyState",
    "answered_calls",
    "canonical_arguments",
    "drop_repeated_calls",
    "find_trigger",
    "lazy_calls",
    "trigger_tail",
]

#: The user turn that asks for the answer once a reply only repeated answered calls (see the module docstring).
ANSWER_REQUEST = "Answer my question in one sentence, using the tool results above."
#: How many of a member's most likely tokens ``tool_choice="none"`` checks for a completed trigger.
FORBID_TOP_K = 64
#: How many of a member's most likely tokens are checked after a call (only whitespace, a call or the end).
AFTER_CALL_TOP_K = 64



# ----------------------------------------------------------------------------- calls and arguments
def canonical_arguments(arguments: Any) -> str:
    """Arguments as comparable text: keys sorted, every number a float (``7`` equals ``7.0``)."""
    return json.dumps(_normalized(arguments), sort_keys=True, ensure_ascii=False)


def _normalized(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, Mapping):
        return {str(k): _normalized(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_normalized(v) for v in value]
    return value


def answered_calls(messages: Sequence[Mapping[str, Any]]) -> tuple[tuple[str, str], ...]:
    """``(name, canonical arguments)`` of the calls that would only repeat what the history already has.

    ``messages`` are normalised (:func:`~ensemble_core.text.chat.normalize_messages`). A call is
    answered when a later ``tool`` message names its id, or, for calls without an id (or
    results without one), when any ``tool`` message follows its assistant turn. Excluded are
    every answered call, and the answered call *fed its own result*: the same tool with one
    argument replaced by the result and the others unchanged (``subtract(900, 357)`` = 543,
    then ``subtract(543, 357)``; ``reverse_text("stressed")`` = "desserts", then
    ``reverse_text("desserts")``): Qwen2.5-Coder-0.5B's other way of not answering, seen in the
    agent suite (docs/agents.md).
    """
    out: dict[tuple[str, str], None] = {}
    for i, message in enumerate(messages):
        if message.get("role") != "assistant" or not message.get("tool_calls"):
            continue
        later = [m for m in messages[i + 1:] if m.get("role") == "tool"]
        ids = {m.get("tool_call_id") for m in later if m.get("tool_call_id")}
        for k, call in enumerate(message["tool_calls"]):
            answer = next((m for m in later if call.get("id") and m.get("tool_call_id") == call["id"]), None)
            if answer is None and later and (not call.get("id") or not ids):
                answer = later[min(k, len(later) - 1)]
            if answer is None:
                continue
            arguments = dict(call.get("arguments") or {})
            out[(call["name"], canonical_arguments(arguments))] = None
            result = _result_value(answer.get("content"))
            for key, value in arguments.items():
                if _same_kind(value, result):
                    out[(call["name"], canonical_arguments({**arguments, key: result}))] = None
    return tuple(out)


def _same_kind(value: Any, result: Any) -> bool:
    """Both numbers (not booleans), or both strings: a result that could stand for that argument."""
    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) and not isinstance(x, bool)

    return (number(value) and number(result)) or (isinstance(value, str) and isinstance(result, str))


def _result_value(content: Any) -> Any:
    """A tool result as an argument value: a number when it reads as one, else the stripped text (None: empty)."""
    text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False) if content else ""
    text = text.strip()
    if not text:
        return None
    try:
        number = float(text)
    except ValueError:
        return text
    return number if number == number else text


def drop_repeated_calls(output: Any, prompt: Any) -> list[Any]:
    """Remove from ``output`` (a :class:`~.structured.StructuredOutput`) the calls that repeat an answered one.

    A call equal to one whose result is in ``prompt``'s history (or to such a call fed its own
    result, :func:`answered_calls`), or to an earlier call of the same reply, would only fetch a
    result the conversation already has. The calls go to ``output.repeated_tool_calls``;
    returns them. When no call is left, the answer is asked for in a turn of its own
    (:func:`~ensemble_core.serving.runtime.settle`).
    """
    if output is None or not output.tool_calls:
        return []
    seen = set(answered_calls(normalize_messages(prompt)))
    keep, dropped = [], []
    for call in output.tool_calls:
        key = (call.name, canonical_arguments(call.arguments))
        (dropped if key in seen else keep).append(call)
        seen.add(key)
    if dropped:
        output.tool_calls[:] = keep
        output.repeated_tool_calls.extend(dropped)
    return dropped


# ----------------------------------------------------------------------------- request level
@dataclass(frozen=True)
class LazyCalls:
    """What one request's members decode under in ``auto`` / ``none`` mode (see the module docstring).

    ``tools``: the bare function specs; ``forbid``: ``tool_choice="none"`` (triggers masked,
    no grammar); ``excluded``: ``(name, canonical arguments)`` calls that may not be made again;
    ``answer``: the grammar of the request's ``response_format`` (None: free text), under which a
    reply is calls or that value, never prose (see the module docstring, "A value or calls");
    ``single``: at most one call (``parallel_tool_calls=False``): the reply ends after it.
    """

    tools: tuple[dict[str, Any], ...]
    forbid: bool = False
    excluded: tuple[tuple[str, str], ...] = ()
    answer: JsonConstraint | None = None
    single: bool = False

    def constraint(self, fmt: CallFormat) -> Any:
        """The (cached) grammar of one call in format ``fmt``."""
        return _format_constraint(json.dumps(self.tools, sort_keys=True, ensure_ascii=False), fmt.name)

    def start(self, member: Any, loops: LoopPenalty | None = None, close_margin: int = 0,
              budget: int | None = None) -> LazyState:
        """One member's lazy state at the start of its reply."""
        return LazyState(self, member, loops, close_margin, budget)


@functools.lru_cache(maxsize=64)
def _format_constraint(tools_json: str, fmt: str) -> Any:
    f = format_named(fmt)
    return call_format_constraint(json.loads(tools_json), f.before, f.after)


@functools.lru_cache(maxsize=64)
def check_call_schema(tools_json: str) -> None:
    """Check, when an ``auto`` request starts, that the call grammar of ``tools_json`` (bare specs) compiles.

    The check a forced call makes (:func:`~.grammar.call_schema`: each tool's parameters, then
    typed errors naming the tool), so that ``auto`` refuses up front exactly what ``required``
    refuses, instead of when a call starts mid-reply. Cached per tool set: an agent's later
    turns with the same tools compile nothing (the first costs one engine compile per tool);
    the per-format grammar is compiled at the first trigger (:func:`_format_constraint`).
    """
    call_schema(json.loads(tools_json))


def lazy_calls(request: Any, messages: Sequence[Mapping[str, Any]], exclude_repeated: bool = True,
               enabled: bool = True) -> LazyCalls | None:
    """The lazy grammar of a request (a :class:`~.structured.StructuredRequest`), or None.

    ``auto`` with tools: the call grammar behind triggers (``enabled``), with the answered
    calls of ``messages`` excluded (``exclude_repeated``); ``none`` with tools: triggers
    masked; a forced call or no tools: None (the eager grammar, or nothing, applies).
    """
    if not request.tools:
        return None
    if request.choice == "none":
        return LazyCalls(tuple(request.tools), forbid=True)
    if request.choice != "auto":
        return None
    unique_names(request.tools)  # as a forced call's grammar does (a call names its tool)
    try:  # the call grammar's schema, checked now: a tool the engine cannot compile raises before any text
        check_call_schema(json.dumps(request.tools, sort_keys=True, ensure_ascii=False))
    except MissingDependencyError:
        if enabled:
            raise
    if not enabled:
        return None
    answer = None if request.schema is None else JsonConstraint(request.schema or None)
    return LazyCalls(tuple(request.tools), excluded=answered_calls(messages) if exclude_repeated else (), answer=answer,
                     single=not request.parallel)


# ----------------------------------------------------------------------------- member level
@dataclass(frozen=True)
class LazyMark:
    """A position of one :class:`LazyState` (see :meth:`LazyState.checkpoint`)."""

    length: int
    scan: int
    active: ConstraintState | None
    grammar: Any
    fmt: CallFormat | None
    start: int
    done: int
    counters: tuple[int, int, int, int, int, int, int]
    ended: bool
    accepts: int
    call_end: int | None
    owes: bool
    value: ConstraintState | None
    value_mark: Any


class LazyState:
    """One member's lazy call grammar within one request (not thread-safe: one per member and request).

    Follows the member's text (:meth:`accept` its tokens, :meth:`commit` committed text, both
    byte-exact), activates a :class:`~.grammar.ConstraintState` at a trigger and drops it when
    the call is complete. Counters (for tests and statistics): ``activations`` (calls started),
    ``completed`` (calls the grammar closed), ``broken`` (calls the committed text left, e.g. a
    method committed text without the mask), ``blocked`` (triggers committed where calls are
    forbidden), ``repeats`` (calls that repeated an excluded one; the reply has then ``ended``),
    ``strayed`` (text after a call that is neither whitespace nor another call, committed
    without the mask; the text is free again from there), ``unvalued`` (under a ``response_format``,
    text before any call that is neither the schema's value nor the start of a call, committed
    without the mask; free from there too).
    """

    def __init__(self, calls: LazyCalls, member: Any, loops: LoopPenalty | None = None, close_margin: int = 0,
                 budget: int | None = None) -> None:
        self.calls, self.member = calls, member
        self.loops, self.close_margin = loops, close_margin
        self.keys = member_table(member).keys
        self.ids_of = member_table(member).ids_of
        self.buf = bytearray()
        self.scan = 0
        self.active: ConstraintState | None = None
        self.fmt: CallFormat | None = None
        self.start = 0
        self.done: list[tuple[str, str]] = []
        self.activations = self.completed = self.broken = self.blocked = self.repeats = self.strayed = 0
        self.unvalued = 0
        self.ended = False
        self.accepts = 0
        #: Where the last completed call ends in :attr:`buf` (None: no call yet, or the rule was left, see
        #: :meth:`_check_after_call`): from there only whitespace, another call or the end.
        self.call_end: int | None = None
        self._budget: tuple[int, int] | None = None if budget is None else (int(budget), 0)
        self._excluded = set(calls.excluded)
        #: Under a ``response_format``: no call has started and the text has kept to the rule, so the reply must
        #: become the schema's value or a call (:meth:`_value_or_call`).
        self.owes = calls.answer is not None
        #: The schema value's grammar position while the text (after leading whitespace) may still be the value.
        self.value: ConstraintState | None = None
        if calls.answer is not None:
            self.value = compile_for_member(calls.answer, member).start(loops, close_margin)
            if budget is not None:
                self.value.set_budget(budget)

    # ------------------------------------------------------------------ queries
    @property
    def text(self) -> bytes:
        """The member's text so far, as it was accepted and committed."""
        return bytes(self.buf)

    def excluded(self) -> set[tuple[str, str]]:
        """Calls that may not be made now: answered in the history, or made earlier in this reply."""
        return self._excluded | set(self.done)

    def budget_left(self) -> int | None:
        if self._budget is None:
            return None
        left, at = self._budget
        return left - max(0, self.accepts - at)

    @property
    def free(self) -> bool:
        """Whether :meth:`process` leaves the logits as they are now (free text before any call, calls allowed,
        no value owed): a draft may then choose its tokens on the device and follow them after reading them,
        as long as it stops behind the first token that leaves this state (#38)."""
        return (self.active is None and not self.ended and not self.calls.forbid and not self.owes
                and self.call_end is None)

    def forced(self, limit: int) -> list[int]:
        """Inside a call, the tokens its grammar forces next (:meth:`~.grammar.ConstraintState.forced`); [] in
        free text (nothing is forced there: the member decides whether and where a call starts)."""
        return self.active.forced(limit) if self.active is not None else []

    # ------------------------------------------------------------------ choosing a token
    def process(self, logits: torch.Tensor) -> torch.Tensor:
        """Free logits unchanged; under an active call the grammar's mask, loop penalty and closing
        pressure, and the closer token; in ``none`` mode call-shaped text masked; after a repeated call
        only the end of the reply; after another call only whitespace, a call or the end (:meth:`_only_calls`);
        under a ``response_format`` before any call, the schema's value or a call (:meth:`_value_or_call`)."""
        if self.active is not None:
            return self._allow_closer(logits, self.active.mask_logits(logits))
        if self.ended:
            return self._only_the_end(logits)
        if self.calls.forbid:
            logits = self._forbid_triggers(logits)
        elif self.owes:
            logits = self._value_or_call(logits)
        elif self.call_end is not None:
            logits = self._only_calls(logits)
        return logits

    def _value_or_call(self, logits: torch.Tensor) -> torch.Tensor:
        """Under a ``response_format``, before any call: the tokens the schema value's grammar allows (with its
        loop penalty and closing pressure), and those of the :data:`AFTER_CALL_TOP_K` most likely tokens that
        keep the text whitespace, then the start of a call, and that the member ranks above every token that
        would not. A call goes on only as the member's own first choice; a member that would write prose
        (or, inside ``{"``, a key the schema does not have) writes the value. Why not the best call token
        below it: Qwen2.5-Coder-0.5B, held from writing the schema back (``{"description"``), ranked
        ``name`` above ``answer`` and made a stray call. The end of the reply waits for a complete value.
        Should nothing be allowed (text committed without the mask), the logits are free."""
        keep = self._first_choice_calls(logits, 0) if self._call_may_follow(bytes(self.buf), 0) else []
        if self.value is None and not keep:
            return logits
        out = torch.full_like(logits, float("-inf")) if self.value is None else self.value.mask_logits(logits)
        out[..., keep] = logits[..., keep]
        return out

    def _only_calls(self, logits: torch.Tensor) -> torch.Tensor:
        """After a call: the end of the reply, and those of the :data:`AFTER_CALL_TOP_K` most likely tokens that
        keep the text after the call whitespace or the start of another call and that the member ranks above
        every token that would not: a member that would go on in prose ends its reply instead of being pushed
        to its best other token (a call it did not choose)."""
        assert self.call_end is not None
        keep = [i for i in self.member.eos_token_ids if i < logits.shape[-1]]
        keep += self._first_choice_calls(logits, self.call_end)
        out = torch.full_like(logits, float("-inf"))
        out[..., keep] = logits[..., keep]
        return out

    def _first_choice_calls(self, logits: torch.Tensor, start: int) -> list[int]:
        """Of the member's :data:`AFTER_CALL_TOP_K` most likely tokens (best first), those that keep the text
        from ``start`` whitespace then the start of a call, up to the first that does not: a call goes on only
        where the member ranks it above any other text. Special tokens without text are skipped (the end of
        the reply is the caller's to allow)."""
        row = logits if logits.dim() == 1 else logits.max(dim=0).values
        text, keep = bytes(self.buf), []
        for i in torch.topk(row.float(), min(AFTER_CALL_TOP_K, row.shape[-1])).indices.tolist():
            key = self.keys[i] if i < len(self.keys) else None
            if not key:
                continue
            if not self._call_may_follow(text + key, start):
                break  # other text ranks here: nothing below it starts a call
            keep.append(i)
        return keep

    def _after_call_ok(self, text: bytes) -> bool:
        """Whether ``text`` (the member's whole text) holds only whitespace after the last call, then at most
        the start of another call (:meth:`_call_may_follow`)."""
        assert self.call_end is not None
        return self._call_may_follow(text, self.call_end)

    @staticmethod
    def _call_may_follow(text: bytes, start: int) -> bool:
        """Whether ``text[start:]`` is whitespace, then at most the start of a call: a whole trigger, or a tail
        that may still become one (:func:`trigger_tail`)."""
        stripped = text[start:].lstrip(b" \t\r\n")
        if not stripped:
            return True
        at = len(text) - len(stripped)  # where the first non-whitespace byte after ``start`` is
        found = find_trigger(text, start)  # a trigger may start at a line start before ``at`` (indentation)
        if found is not None and found[1].start() <= at < found[1].end():
            return True
        base = max(0, at - TRIGGER_SPAN)
        try:
            before, decoded = text[base:at].decode("utf-8"), text[base:].decode("utf-8")
        except UnicodeDecodeError:
            return False
        return trigger_tail(decoded) <= len(before)

    def _allow_closer(self, logits: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        assert self.active is not None and self.fmt is not None
        closer = self.fmt.closer
        ids = [i for i in self.ids_of.get(closer, ()) if i < logits.shape[-1]] if closer else []
        if not ids or not self.active.accepts_text(closer.decode(), end=True):
            return out
        out = out.clone()
        out[..., ids] = logits[..., ids]
        return out

    def _only_the_end(self, logits: torch.Tensor) -> torch.Tensor:
        """After a repeated call (or any call, with ``parallel_tool_calls=False``): the member's end-of-reply
        tokens only."""
        eos = [i for i in self.member.eos_token_ids if i < logits.shape[-1]]
        out = torch.full_like(logits, float("-inf"))
        out[..., eos] = logits[..., eos]
        return out

    def _forbid_triggers(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask, among the :data:`FORBID_TOP_K` most likely tokens, those that start call-shaped text."""
        row = logits if logits.dim() == 1 else logits.max(dim=0).values
        top = torch.topk(row.float(), min(FORBID_TOP_K, row.shape[-1])).indices.tolist()
        banned = [i for i in top if i < len(self.keys) and self._completes_trigger(self.keys[i])]
        if not banned:
            return logits
        out = logits.clone()
        out[..., banned] = float("-inf")
        return out

    def _completes_trigger(self, key: bytes | None) -> bool:
        """Whether ``key`` after the text completes call-shaped text (:data:`CALL_SHAPES`)."""
        if not key:
            return False
        text, start = bytes(self.buf) + key, max(self.scan, len(self.buf) - TRIGGER_SPAN)
        return any(p.search(text, start) is not None for p in CALL_SHAPES)

    # ------------------------------------------------------------------ following the text
    def accept(self, token: int) -> None:
        """Advance by one of this member's tokens (drafted or chosen)."""
        self.accepts += 1
        token = int(token)
        key = self.keys[token] if 0 <= token < len(self.keys) else None
        if self.active is not None:
            if key is None:
                self.active.accept_token(token)  # EOS: accepted only where the call may end
                return
            if not self.active.accept_token(token) and not self.active.accept_text(key.decode("utf-8", "replace")):
                self.buf += key
                self._give_up()
                return
            self.buf += key
            if self.active.finished:
                self._finish_call()
                self._scan()
            return
        if key is not None:
            self.buf += key
            self._follow_value()
            self._check_after_call()
            self._scan()

    def commit(self, text: str) -> None:
        """Advance by committed text (any member's; it need not end on a token boundary of this one)."""
        if not text:
            return
        self.buf += text.encode("utf-8")
        if self.active is not None:
            self._feed(text)
        else:
            self._follow_value()
            self._check_after_call()
            self._scan()

    def set_budget(self, left: int | None) -> None:
        self._budget = None if left is None else (int(left), self.accepts)
        if self.active is not None:
            self.active.set_budget(left)
        if self.value is not None:
            self.value.set_budget(left)

    def _scan(self) -> None:
        """Look for a trigger in the free text; activate the call grammar there (where calls are forbidden:
        count call-shaped text, :data:`CALL_SHAPES`)."""
        if self.calls.forbid or self.ended:
            hits = [m for m in (p.search(self.buf, self.scan) for p in CALL_SHAPES) if m is not None]
            if hits:
                self.blocked += 1
                self.scan = max(m.end() for m in hits)
            else:
                self._scanned()
            return
        while self.active is None:
            found = find_trigger(self.buf, self.scan)
            if found is None:
                self._scanned()
                return
            fmt, m = found
            try:
                text = bytes(self.buf[m.start("g"):]).decode("utf-8")
            except UnicodeDecodeError:  # the call text would start inside a character: not a call
                self.scan = m.end()
                continue
            compiled = compile_for_member(self.calls.constraint(fmt), self.member)
            state = compiled.start(self.loops, self.close_margin)
            left = self.budget_left()
            if left is not None:
                state.set_budget(left)
            self.active, self.fmt, self.start = state, fmt, m.start("g")
            self.activations += 1
            self.owes, self.value = False, None  # the reply is calls (a {"name" line read as one, as anywhere)
            self._feed(text)

    def _scanned(self) -> None:
        """No trigger up to the end of the text: the next scan starts where one could still begin (a
        trigger spans at most :data:`TRIGGER_SPAN` bytes), so following a reply costs the new bytes, not
        the whole text again on every token."""
        self.scan = max(self.scan, len(self.buf) - TRIGGER_SPAN)

    def _feed(self, text: str) -> None:
        """Advance the active call by ``text``; where the call ends inside it, the rest is free text again."""
        state = self.active
        assert state is not None
        if state.accept_text(text):
            if state.finished:
                self._finish_call()
                self._scan()
            return
        lo, hi = 0, len(text)  # the longest prefix the grammar accepts (acceptance is monotone in the prefix)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if state.accepts_text(text[:mid]):
                lo = mid
            else:
                hi = mid - 1
        if lo:
            state.accept_text(text[:lo])
        if state.finished:
            self._finish_call()
            self._scan()
        else:
            self._give_up()

    def _finish_call(self) -> None:
        state = self.active
        assert state is not None
        text = state.text.decode("utf-8", "replace")
        name, at = call_parts(text)
        closed = closed_value(text, at) if at is not None else None
        if name is not None and closed is not None:
            call = (name, canonical_arguments(closed[0]))
            if call in self.excluded():
                self.repeats += 1
                self.ended = True
            self.done.append(call)
        if self.calls.single:  # parallel_tool_calls=False: one call, then the end of the reply
            self.ended = True
        self.completed += 1
        self.scan = self.start + len(state.text)
        self.active, self.fmt = None, None
        if not self.ended:
            self.call_end = self.scan
            self._check_after_call()  # text committed with the call's end may already go on after it

    def _follow_value(self) -> None:
        """Under a ``response_format`` before any call: feed the value's grammar the text it has not seen
        (leading whitespace skipped: a call may follow it, a value may not start with it), dropping the value
        when the text leaves it; text that is neither the value nor the start of a call (committed without
        the mask) ends the rule (``unvalued``)."""
        if not self.owes:
            return
        if self.value is not None:
            rest = bytes(self.buf).lstrip(b" \t\r\n")
            new = rest[len(self.value.text):]
            if new and not self.value.accept_text(new):
                self.value = None
        if self.value is None and not self._call_may_follow(bytes(self.buf), 0):
            self.unvalued += 1
            self.owes = False

    def _check_after_call(self) -> None:
        """Text after a call that is neither whitespace nor another call (committed without the mask) ends the
        rule: the text is free from there (``strayed``)."""
        if self.call_end is not None and not self._after_call_ok(bytes(self.buf)):
            self.strayed += 1
            self.call_end = None

    def _give_up(self) -> None:
        """The committed text left the call's grammar (a method committed text without the mask): it stays free."""
        self.broken += 1
        self.scan = len(self.buf)
        self.active, self.fmt = None, None
        self.call_end = None

    # ------------------------------------------------------------------ drafts
    def checkpoint(self) -> LazyMark:
        return LazyMark(len(self.buf), self.scan, self.active, self.active.checkpoint() if self.active else None,
                        self.fmt, self.start, len(self.done),
                        (self.activations, self.completed, self.broken, self.blocked, self.repeats, self.strayed,
                         self.unvalued),
                        self.ended, self.accepts, self.call_end, self.owes, self.value,
                        self.value.checkpoint() if self.value is not None else None)

    def restore(self, mark: LazyMark) -> None:
        del self.buf[mark.length:]
        self.scan, self.active, self.fmt, self.start = mark.scan, mark.active, mark.fmt, mark.start
        if self.active is not None:
            self.active.restore(mark.grammar)
        del self.done[mark.done:]
        (self.activations, self.completed, self.broken, self.blocked, self.repeats, self.strayed,
         self.unvalued) = mark.counters
        self.ended = mark.ended
        self.accepts = mark.accepts
        self.call_end = mark.call_end
        self.owes, self.value = mark.owes, mark.value
        if self.value is not None:
            self.value.restore(mark.value_mark)

    # ------------------------------------------------------------------ ensemble points (texts)
    def allows(self, prefix: str, key: bytes | None) -> bool:
        """Whether committing ``prefix`` then ``key`` (None: the end of the reply) keeps every rule: a
        started call stays in its grammar (and the reply ends outside a call), after a call only
        whitespace or another call follows, no trigger is completed where calls are forbidden, after
        a repeated call nothing but the end follows, and under a ``response_format`` the reply is the
        schema's value (complete when it ends) or calls."""
        mark = self.checkpoint()
        try:
            before = (self.broken, self.blocked, self.strayed, self.unvalued)
            self.commit(prefix)
            if key is None:
                owed = self.owes and not (self.value is not None and self.value.can_end)
                return self.active is None and not owed and (self.broken, self.blocked, self.strayed,
                                                             self.unvalued) == before
            if self.ended:
                return False
            try:
                self.commit(key.decode("utf-8"))
            except UnicodeDecodeError:
                return self.active is None and not self.calls.forbid and self.call_end is None and not self.owes
            return (self.broken, self.blocked, self.strayed, self.unvalued) == before
        finally:
            self.restore(mark)

    def call_openers(self, prefix: str, keys: Sequence[bytes | None]) -> list[int]:
        """Which of ``keys`` (candidate texts after the committed text and ``prefix``; None: the end) start
        call-shaped text (:data:`CALL_SHAPES`) where a call may start now: one decision, whichever
        member's spelling it has (:meth:`~ensemble_core.text.distributions.Candidates.merged`)."""
        if self.active is not None or self.calls.forbid or self.ended:
            return []
        text = bytes(self.buf) + prefix.encode("utf-8")
        start = max(0, len(text) - TRIGGER_SPAN)
        out = []
        for i, key in enumerate(keys):
            if not key:
                continue
            whole = text + key
            if any((m := p.search(whole, start)) is not None and m.end() > len(text) for p in CALL_SHAPES):
                out.append(i)
        return out

    def factors(self, prefix: str, texts: Iterable[bytes | None]) -> torch.Tensor | None:
        """The loop penalty and closing pressure by text at an ensemble point inside a call or the schema's value
        (None outside them)."""
        state = self.active if self.active is not None else self.value if self.owes else None
        if state is None:
            return None
        return state.text_factors(prefix, list(texts))
