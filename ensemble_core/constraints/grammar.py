"""Constrained decoding: JSON Schema and tool-call output that always parses, per member.

Every member decodes under *its own* tokenizer's token mask, while the grammar position of
every member follows the *committed text*, which may end in the middle of what would be one
token for that member. Three operations carry the ensemble methods:

* the mask of the next token (:meth:`ConstraintState.allowed`, :meth:`~ConstraintState.mask_logits`),
* advancing by a token (:meth:`~ConstraintState.accept_token`) or by any text, token-aligned or
  not (:meth:`~ConstraintState.accept_text`), and testing a candidate string without
  committing it (:meth:`~ConstraintState.accepts_text`),
* rolling a drafted run back (:meth:`~ConstraintState.checkpoint` / :meth:`~ConstraintState.restore`,
  :meth:`~ConstraintState.rollback`).

The engine is `llguidance <https://github.com/guidance-ai/llguidance>`_ (``pip install
llguidance``; the ``agents`` extra). It was chosen over xgrammar and outlines-core (measured
on the three bundled tokenizers) because it has no dependencies (xgrammar pulls triton, ~1 GB),
never allows special tokens inside JSON text (xgrammar 0.2.9 allows ``<|im_start|>`` or Gemma's
``<end_of_turn>`` inside a string under transformers 5), compiles any schema in milliseconds
(outlines-core: 4-60 s per schema on a 262k vocabulary, and it ignores ``minimum``/``maximum``),
and works on bytes, so a grammar position can follow text that ends inside a token.

Conventions (documented here because the ensemble relies on them):

* The output is one JSON value and nothing else: no whitespace before it and none after
  it; between tokens of the value up to :data:`MAX_WHITESPACE` characters of JSON whitespace
  are allowed (models write ``{"a": 1}`` and pretty-printed JSON; an unbounded run would
  let a weak model loop on newlines). Strip a chat format's reply lead before
  :meth:`~ConstraintState.accept_text`.
* Properties are produced in the order the schema lists them (the engine's rule); optional
  ones may be skipped. Extra properties follow JSON Schema (allowed unless
  ``additionalProperties`` is false); :func:`tool_call_constraint` forbids them in arguments.
* Integers stay within ±(2**53 - 1) unless the schema gives its own bounds: the range that
  every JSON reader represents exactly (I-JSON, RFC 7493, 2.2). Without a bound the grammar
  would let a weak model write digits until the token budget cuts the reply (seen on the
  bundled pair: ``"days": 3000000000000…`` in 9 of 60 forced calls over three methods); with it the
  number must end after 16 digits.
* Tokens that would continue a repeat of the output (``"Léa", "Léa", "Léa", …``) lose logits
  in :meth:`~ConstraintState.mask_logits`, more with every repeated byte
  (:mod:`ensemble_core.constraints.repetition`; ``start(LoopPenalty(multiplier=0))`` turns it off): the
  mask keeps every continuation legal, the penalty makes a looping member end the value.
* Near the end of the token budget (:meth:`~ConstraintState.set_budget`) tokens that only
  close a string, list or object gain logits and blank ones lose them
  (:mod:`ensemble_core.constraints.closing`), so that a member that keeps adding new items ends the
  value before the budget cuts it.
* The member's EOS ids are allowed exactly when the value is complete (:attr:`~ConstraintState.can_end`);
  special tokens are never allowed inside the value; rows of the model beyond the tokenizer's
  vocabulary (padding) are never allowed.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ensemble_core.constraints.closing import check_margin, closing_bonus, closing_factors, closing_signs, in_string
from ensemble_core.constraints.repetition import (
    LoopPenalty,
    first_visible_bytes,
    loop_penalties,
    penalty_vector,
    text_factors,
)
from ensemble_core.constraints.schemas import map_subschemas
from ensemble_core.constraints.structured import (
    StructuredRequest,
    chosen_names,
    structured_request,
    tool_choice_parts,
    unique_names,
)
from ensemble_core.constraints.tool_parsers import located, tool_parameters
from ensemble_core.errors import (
    ConstraintError,
    InvalidOptionError,
    InvalidSchemaError,
    MissingDependencyError,
    UnsupportedSchemaFeatureError,
    UnsupportedTokenizerError,
)
from ensemble_core.transfer import to_device

__all__ = [
    "MAX_SAFE_INTEGER",
    "Checkpoint",
    "CompiledConstraint",
    "ConstraintState",
    "GrammarConstraint",
    "JsonConstraint",
    "bounded_integers",
    "call_format_constraint",
    "call_schema",
    "compile_constraint",
    "compile_for_member",
    "check_tools",
    "engine_schema",
    "tool_call_constraint",
]

#: What to install for constrained decoding (also the ``agents`` extra of this project).
INSTALL = "pip install 'llguidance>=1.9,<2'  (or the project's [agents] extra)"
#: Longest run of JSON whitespace between two tokens of the value (see the module docstring).
MAX_WHITESPACE = 20
_COMPILE_OPTIONS: dict[str, Any] = {"whitespace_pattern": rf"[\x20\x0A\x0D\x09]{{0,{MAX_WHITESPACE}}}"}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
#: The largest integer every JSON reader holds exactly (I-JSON, RFC 7493): the default bound of integers.
MAX_SAFE_INTEGER = 2**53 - 1
_SCHEMA_FIX = (
    "Simplify the schema: remove or rewrite the keyword the message names. Supported: type, properties, "
    "required, additionalProperties, items/prefixItems, enum, const, anyOf, oneOf (branches that no value "
    "can match twice, e.g. with a 'const' tag each), allOf, $ref/$defs, minimum/maximum, minLength/maxLength, "
    "pattern (no look-around or back-references), minItems/maxItems and format (date-time, date, time, "
    "duration, email, hostname, ipv4, ipv6, uuid, uri enforced; other formats are ignored); "
    "not supported: not, if/then/else, dependentRequired/dependentSchemas, uniqueItems."
)
_ONE_OF_FIX = (
    "Use anyOf instead (the same values, without the exactly-one rule), or make the branches disjoint, e.g. a "
    "property with a different 'const' (a tag) in each branch, as pydantic's discriminated unions write."
)
_BACKREFERENCE_FIX = "Rewrite the pattern without back-references (\\1, \\k<name>), e.g. list the repeated part."


def _llguidance() -> Any:
    """Import llguidance lazily, so that the rest of the library works without it."""
    try:
        import llguidance
    except ImportError as e:  # pragma: no cover - exercised by monkeypatching sys.modules
        raise MissingDependencyError("llguidance", "constrained decoding (JSON Schema / tool calls)", INSTALL) from e
    return llguidance


def bounded_integers(schema: Any) -> Any:
    """A copy of ``schema`` whose unbounded integers get the I-JSON range (see the module docstring).

    A bound the schema sets (``minimum``/``exclusiveMinimum``, ``maximum``/``exclusiveMaximum``)
    is kept; only a missing side gets ``∓ MAX_SAFE_INTEGER``.
    """
    return map_subschemas(schema, _bound_integer)


def _bound_integer(node: dict[str, Any]) -> dict[str, Any]:
    kind = node.get("type")
    if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
        if "minimum" not in node and "exclusiveMinimum" not in node:
            node["minimum"] = -MAX_SAFE_INTEGER
        if "maximum" not in node and "exclusiveMaximum" not in node:
            node["maximum"] = MAX_SAFE_INTEGER
    return node


def engine_schema(schema: Any) -> Any:
    """The copy of ``schema`` the grammar engine compiles: integers bounded (:func:`bounded_integers`), and the
    ``format`` values the engine does not implement dropped.

    JSON Schema (2020-12, "format-annotation") treats a ``format`` as an annotation unless the
    validator knows it, so pydantic's ``path`` (``pathlib.Path``), ``binary`` (``bytes``),
    ``password`` (``SecretStr``), ``ipvanyaddress`` and the like must not refuse the schema: the
    grammar leaves such a string free, as the argument validator (``jsonschema``) does. A ``date-time`` or
    ``time`` gets no second ``60`` (:data:`_NO_LEAP_SECOND`).
    """
    return map_subschemas(schema, lambda node: _drop_unknown_format(_bound_integer(node)))


#: Added beside ``format: date-time`` / ``time`` (where the schema has no pattern of its own): second ``60``
#: (an RFC 3339 leap second) is legal in the engine's format, but pydantic's ``datetime`` / ``time`` and most
#: readers refuse it, so the grammar leaves it out.
_NO_LEAP_SECOND = r"^.*:[0-5][0-9](\.[0-9]+)?([Zz]|[+-][0-9]{2}:[0-9]{2})$"


def _drop_unknown_format(node: dict[str, Any]) -> dict[str, Any]:
    fmt = node.get("format")
    if isinstance(fmt, str) and not _engine_format(fmt):
        del node["format"]
    elif fmt in ("date-time", "time") and "pattern" not in node:
        node["pattern"] = _NO_LEAP_SECOND
    return node


@functools.lru_cache(maxsize=256)
def _engine_format(fmt: str) -> bool:
    """Whether the grammar engine enforces string format ``fmt`` (llguidance 1.9: date-time, date, time, duration,
    email, hostname, ipv4, ipv6, uuid, uri; asked once per name, so a newer engine's formats count too)."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema({"type": "string", "format": fmt})
        return not llg.LLMatcher.validate_grammar_with_warnings(grammar)[0]
    except (ValueError, TypeError):
        return False


_UNIMPLEMENTED = re.compile(r"Unimplemented keys: \[([^\]]*)\]")


def _unsupported_feature(problem: str) -> tuple[str, str, str] | None:
    """(feature, problem, fix) for what the engine names as unsupported (keywords such as ``not``, ``oneOf`` it
    cannot prove disjoint, look-around or back-references in a pattern), if any; the problem and fix in words a
    user of this library can act on (the engine's own may name its options)."""
    keys = _UNIMPLEMENTED.search(problem)
    if keys:
        return ", ".join(k.strip().strip('"') for k in keys.group(1).split(",") if k.strip()), problem, _SCHEMA_FIX
    if "oneOf" in problem and "not supported" in problem:
        return ("oneOf", "oneOf whose branches a value could match more than one of is not supported (the grammar "
                "cannot enforce 'exactly one')", _ONE_OF_FIX)
    if "backreferences are not supported" in problem:
        lines = problem.splitlines()
        pattern = repr(lines[1].strip()) + " " if len(lines) > 1 else ""
        return "backreference", f"pattern {pattern}uses a back-reference, which is not supported", _BACKREFERENCE_FIX
    if "look-around" in problem:
        return "look-around in pattern", problem, _SCHEMA_FIX
    return None


def _check_grammar(schema: Mapping[str, Any]) -> str:
    """The llguidance grammar of ``schema``; an unsupported or malformed schema raises here."""
    llg = _llguidance()
    try:
        grammar = llg.LLMatcher.grammar_from_json_schema(engine_schema(schema), defaults=_COMPILE_OPTIONS)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
    except (ValueError, TypeError) as e:
        is_error, messages = True, [str(e)]
    if is_error:
        problem = messages[0] if messages else "the grammar engine rejected it"
        unsupported = _unsupported_feature(problem)
        if unsupported is not None:
            raise UnsupportedSchemaFeatureError(*unsupported)
        raise InvalidSchemaError(problem, _SCHEMA_FIX)
    return grammar


# ----------------------------------------------------------------------------- constraints
@dataclass(frozen=True)
class JsonConstraint:
    """What the output must match: a JSON Schema (dict), or any JSON object (``schema=None``).

    The schema is copied (so later changes by the caller do not change a compiled grammar)
    and checked when the constraint is made, not when a request is half way through: a
    malformed schema or one with keywords the engine cannot enforce raises
    :class:`~ensemble_core.errors.InvalidSchemaError` naming the problem.
    """

    schema: dict[str, Any] | None = field(default=None, compare=False)
    #: The schema as JSON text: the identity of the constraint (cache key, ``==``, ``hash``).
    #: Key order is kept, not sorted: the engine produces properties in the order listed.
    key: str = field(init=False, repr=False)
    #: The llguidance grammar compiled from the schema (tokenizer-independent, plain text).
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        schema = self.schema
        if schema is not None and not isinstance(schema, Mapping):
            hint = " For a Pydantic model pass Model.model_json_schema()." if hasattr(schema, "model_json_schema") else ""
            raise InvalidSchemaError(
                f"expected a dict (a JSON Schema) or None, got {type(schema).__name__}",
                "Pass the schema as a dict, e.g. {'type': 'object', 'properties': {...}}; for any JSON object pass "
                "schema=None." + hint)
        try:
            key = json.dumps(_ANY_OBJECT if schema is None else schema, allow_nan=False, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise InvalidSchemaError(f"it is not JSON ({e})", "Use only dicts, lists, strings, numbers, booleans "
                                     "and None in the schema.") from e
        object.__setattr__(self, "schema", None if schema is None else json.loads(key))
        object.__setattr__(self, "key", key)
        object.__setattr__(self, "grammar", _check_grammar(json.loads(key)))

    def __hash__(self) -> int:
        return hash(self.key)


def _tool_spec(tool: Any) -> dict[str, Any]:
    if not isinstance(tool, Mapping):
        raise ConstraintError(f"A tool must be a dict (an OpenAI-style function spec), got {type(tool).__name__}. "
                              "Pass {'type': 'function', 'function': {'name': ..., 'parameters': {...}}}.")
    spec = tool.get("function", tool) if tool.get("type", "function") == "function" else tool
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str) or not spec["name"]:
        raise ConstraintError(f"A tool has no name: {json.dumps(tool, default=str)[:200]}. Give every tool a non-empty "
                              "'name' (in 'function' for OpenAI-style specs).")
    return dict(spec)


def tool_call_constraint(tools: Sequence[Mapping[str, Any]], choice: str | Mapping[str, Any] | None = None) -> JsonConstraint:
    """The constraint for one tool call, as ``{"name": <tool name>, "arguments": {...}}``.

    That object is this library's one tool-call format (the keys of OpenAI's ``function``
    field); ``"name"`` comes first, so the arguments' schema is fixed once the name is.

    ``tools`` are OpenAI-style specs (``{"type": "function", "function": {"name",
    "description", "parameters"}}``) or the bare function dicts. ``choice`` is None,
    ``"any"`` or ``"required"`` (a call of any of the tools), a tool name,
    ``{"type": "function", "function": {"name": ...}}``, or ``{"type": "allowed_tools", "allowed_tools":
    {"mode": "required", "tools": [...]}}`` (a call of one of those; :func:`~.structured.tool_choice_parts`).
    ``"auto"`` and ``"none"`` are not constraints (the model may answer in prose) and raise: do not
    constrain those requests.

    Arguments may hold only the parameters a tool declares (``additionalProperties`` is set
    to false where the tool's schema does not say): a function cannot accept others.
    """
    specs = [_tool_spec(t) for t in tools]
    if not specs:
        raise ConstraintError("tool_call_constraint needs at least one tool. Pass tools=[...] or do not constrain.")
    names = unique_names(specs)
    choice, allowed = tool_choice_parts(choice)
    if choice in ("auto", "none"):
        raise ConstraintError(f"tool_choice={choice!r} does not require a tool call, so there is nothing to constrain. "
                              "Decode without a constraint, or pass choice='required' or a tool name.")
    wanted = chosen_names(choice, allowed, names)
    if wanted:
        specs = [s for s in specs if s["name"] in wanted]
    return JsonConstraint(call_schema(specs))


def call_schema(specs: Sequence[Mapping[str, Any]], root: str = "#") -> dict[str, Any]:
    """The JSON Schema of one call ``{"name": <tool>, "arguments": {...}}`` of one of the bare function ``specs``.

    Shared by the forced call (:func:`tool_call_constraint`, the whole reply) and the lazy
    grammar of ``tool_choice="auto"`` (:func:`call_format_constraint`, the call inside free
    text), so that a call the model chose is held to the same rule as a forced one. ``root``
    is where the schema sits in the final grammar (its ``$ref`` pointers are rebased there).
    Each tool's parameters are checked on their own first, so that an error names the tool.
    """
    branches = []
    for spec in specs:
        params = tool_parameters(spec)  # the schema validation checks free calls against too
        try:
            JsonConstraint(params)  # names the tool when its parameters are the problem
        except InvalidSchemaError as e:
            raise located(e, f"tool {spec['name']!r} parameters") from e
        where = f"{root}/properties/arguments" if len(specs) == 1 else f"{root}/anyOf/{len(branches)}/properties/arguments"
        branches.append({"type": "object", "properties": {"name": {"const": spec["name"]}, "arguments": _rebased(params, where)},
                         "required": ["name", "arguments"], "additionalProperties": False})
    return branches[0] if len(branches) == 1 else {"anyOf": branches}


@dataclass(frozen=True)
class GrammarConstraint:
    """A constraint given as a Lark grammar in llguidance's dialect (``%json {...}`` embeds a JSON Schema).

    What the lazy tool-call grammar uses for a call *inside* free text: the call's opener or
    closer around its JSON (``<tool_call>`` ... ``</tool_call>``, a fence), see
    :func:`call_format_constraint`. Checked when made, like :class:`JsonConstraint`;
    compiled per member by :func:`compile_constraint`.
    """

    lark: str
    key: str = field(init=False, repr=False)
    grammar: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        llg = _llguidance()
        grammar = llg.LLMatcher.grammar_from_lark(self.lark)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar)
        if is_error:
            raise InvalidSchemaError(messages[0] if messages else "the grammar engine rejected it", _SCHEMA_FIX)
        object.__setattr__(self, "key", self.lark)
        object.__setattr__(self, "grammar", grammar)

    def __hash__(self) -> int:
        return hash(self.key)


def call_format_constraint(specs: Sequence[Mapping[str, Any]], before: str = "", after: str = "") -> GrammarConstraint:
    """One call of one of ``specs`` (bare function specs) as JSON, between ``before`` and ``after`` (Lark snippets).

    ``before`` / ``after`` are what the call format writes around the JSON, e.g. for
    Qwen's tags ``WS?`` and ``WS? "</tool_call>"`` (the opener is the trigger, already
    written when the grammar starts). ``WS`` is up to :data:`MAX_WHITESPACE` characters of
    JSON whitespace; inside the JSON the same conventions hold as for a forced call
    (property order, closed arguments, bounded integers).
    """
    schema = engine_schema(call_schema(specs))
    schema["x-guidance"] = dict(_COMPILE_OPTIONS)
    lark = (f"%llguidance {{}}\nstart: {before} call {after}\n"
            f"WS: /[ \\t\\r\\n]{{1,{MAX_WHITESPACE}}}/\n"
            f"call: %json {json.dumps(schema, ensure_ascii=False)}\n")
    return GrammarConstraint(lark)


def _rebased(schema: Any, root: str) -> Any:
    """``schema`` with its local ``$ref`` pointers (``#/$defs/X``) made to point below ``root``, where it now sits.

    A tool's parameters become a subschema of the call's schema, so ``#/$defs/Person`` (what
    Pydantic writes for nested models) would point at the root of the call, where nothing is.
    """
    if isinstance(schema, list):
        return [_rebased(s, root) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _rebased(v, root) for k, v in schema.items()}
    ref = schema.get("$ref")
    if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
        out["$ref"] = root + ref[1:]
    return out


def check_tools(tools: Sequence[Mapping[str, Any]], tool_choice: Any = None) -> StructuredRequest:
    """Validate tools and a tool choice when they are bound, not at the first call.

    Typed errors name the problem: an unknown name in ``tool_choice`` raises
    :class:`~ensemble_core.errors.UnknownToolError`, parameters that the argument validator
    (``jsonschema``, in :func:`structured_request`) rejects or the grammar engine cannot
    compile raise :class:`~ensemble_core.errors.InvalidSchemaError` naming the tool, whatever
    the choice (an "auto" request could not be constrained later either). Without llguidance
    only a forced choice needs the engine (and raises :class:`MissingDependencyError`).
    Both adapters' ``bind_tools`` / ``chat_with_tools`` call it.
    """
    request = structured_request(list(tools), tool_choice)
    try:  # one tool at a time, so that the error names the tool (repeated names are the call's concern)
        for spec in request.tools:
            tool_call_constraint([{"type": "function", "function": spec}], "required")
    except MissingDependencyError:
        if request.forced_call:
            raise
    return request


# ----------------------------------------------------------------------------- tokenizers
_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_decode_map() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {c: b for b, c in bytes_to_unicode().items()}


def _decoder_kind(tokenizer: Any) -> str | None:
    """'byte_level' (GPT-2 style), 'sentencepiece' (▁ + byte fallback) or None (let llguidance parse it)."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.decoder.__getstate__())
    except Exception:  # noqa: BLE001 - any unusual tokenizer takes the general path
        return None
    if decoder.get("type") == "ByteLevel":
        return "byte_level"
    if decoder.get("type") == "Sequence":
        parts = [d.get("type") for d in decoder.get("decoders", [])]
        replace = [d for d in decoder["decoders"] if d.get("type") == "Replace"]
        if (parts in (["Replace", "ByteFallback", "Fuse"], ["Replace", "ByteFallback"]) and
                replace[0].get("pattern") == {"String": "\u2581"} and replace[0].get("content") == " "):
            return "sentencepiece"
    return None


def token_table(tokenizer: Any) -> tuple[list[bytes], list[int]] | None:
    """The bytes of every token id and the special ids, read from the vocabulary.

    Why not llguidance's own ``from_tokenizer``: it serializes the whole tokenizer to JSON
    and parses it again, 12-14 s for Gemma-3's 262k vocabulary against about 3 s here. The
    fast path covers the two decoders the bundled models use and returns None for anything
    else (the general path then runs). Added tokens are literal text; special ones and added
    ones that look like markup tags (``<start_of_image>``, ``<tool_call>``) are never allowed
    inside JSON, as llguidance itself decides.
    """
    kind = _decoder_kind(tokenizer)
    if kind is None:
        return None
    vocab = tokenizer.get_vocab()
    added = tokenizer.added_tokens_decoder
    tokens = [b""] * (max(vocab.values()) + 1)
    special: list[int] = []
    u2b = _byte_level_decode_map()
    for piece, i in vocab.items():
        extra = added.get(i)
        if extra is not None:
            tokens[i] = piece.encode()
            if extra.special or (piece.startswith("<") and piece.endswith(">")):
                special.append(i)
        elif kind == "byte_level":
            try:
                tokens[i] = bytes(u2b[c] for c in piece)
            except KeyError:
                return None
        else:
            m = _BYTE_PIECE.fullmatch(piece)
            tokens[i] = bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()
    return tokens, sorted(special)


class _Vocabulary:
    """What llguidance's ``TokenizerWrapper`` reads: token bytes, special ids and an encoder."""

    def __init__(self, tokenizer: Any, tokens: list[bytes], special: list[int]) -> None:
        self.eos_token_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else special[0]
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = tokens
        self.special_token_ids = special
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


@functools.lru_cache(maxsize=16)
def _lltokenizer(tokenizer: Any) -> Any:
    """llguidance's view of ``tokenizer`` (the expensive part: one per tokenizer, shared by every vocab size)."""
    llg = _llguidance()
    table = token_table(tokenizer)
    if table is not None:
        tokens, special = table
        return llg.LLTokenizer(llg.TokenizerWrapper(_Vocabulary(tokenizer, tokens, special)), n_vocab=len(tokens))
    import llguidance.hf

    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=_tokenizer_size(tokenizer))
    except ValueError as e:
        raise UnsupportedTokenizerError(
            f"Constrained decoding needs a fast (Rust) Hugging Face tokenizer; {type(tokenizer).__name__} is not one "
            f"({e}). Load the tokenizer with AutoTokenizer.from_pretrained(..., use_fast=True).") from e


def _tokenizer_size(tokenizer: Any) -> int:
    return max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)


# ----------------------------------------------------------------------------- compiled
class CompiledConstraint:
    """A constraint compiled for one tokenizer and one model vocabulary size (shareable, thread-safe).

    Made by :func:`compile_constraint`, which caches it, so repeated requests with the same
    schema and member do not compile again. :meth:`start` gives a fresh per-request
    :class:`ConstraintState` in microseconds (a copy of a pristine matcher).
    """

    def __init__(self, constraint: JsonConstraint | GrammarConstraint, tokenizer: Any, vocab_size: int,
                 eos_token_ids: frozenset[int]) -> None:
        llg = _llguidance()
        self.constraint = constraint
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = frozenset(i for i in eos_token_ids if 0 <= i < self.vocab_size)
        if not self.eos_token_ids:
            raise ConstraintError(f"None of the EOS ids {sorted(eos_token_ids)} is below vocab_size={vocab_size}, so a "
                                  "constrained reply could never end. Pass the member's EOS ids (Member.eos_token_ids).")
        self.tokenizer = tokenizer
        self._lltok = _lltokenizer(tokenizer)
        self._n_engine = int(self._lltok.vocab_size)  # rows the engine knows; model rows beyond are padding
        self._n_shared = min(self._n_engine, self.vocab_size)
        self._engine_eos = [int(i) for i in self._lltok.eos_tokens if 0 <= int(i) < self._n_shared]
        self._template = llg.LLMatcher(self._lltok, constraint.grammar, log_level=0)
        if self._template.is_error():
            raise InvalidSchemaError(self._template.get_error(), _SCHEMA_FIX)
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"CompiledConstraint({self.constraint!r}, vocab_size={self.vocab_size})"

    def start(self, loops: LoopPenalty | None = None, close_margin: int = 0) -> ConstraintState:
        """A grammar position at the start of the output, for one member in one request.

        ``loops``: the penalty on continuing a repeat (:mod:`ensemble_core.constraints.repetition`; default
        :class:`~ensemble_core.constraints.repetition.LoopPenalty`, ``LoopPenalty(multiplier=0)`` turns it off).
        ``close_margin``: budget tokens before the end where closing tokens gain logits
        (:mod:`ensemble_core.constraints.closing`; 0, the default here, turns it off).
        """
        with self._lock:
            matcher = self._template.deep_copy()
        if check_margin(close_margin) is None:
            raise InvalidOptionError("close_margin", close_margin, "a number of tokens here (resolve None first: "
                                     "ensemble_core.constraints.closing.resolve_margin)")
        return ConstraintState(self, matcher, LoopPenalty() if loops is None else loops, close_margin)

    @property
    def first_bytes(self) -> torch.Tensor:
        """Int16 ``[vocab_size]``: each token's first non-whitespace byte (-1: none), read once per tokenizer."""
        return _first_bytes(self.tokenizer, self.vocab_size, self.eos_token_ids)

    def closing_signs(self, inside: bool) -> torch.Tensor:
        """Int8 ``[vocab_size]``: +1 closing tokens, -1 blank ones (:mod:`~ensemble_core.constraints.closing`), per tokenizer."""
        return _closing_signs(self.tokenizer, self.vocab_size, self.eos_token_ids, inside)


@functools.lru_cache(maxsize=16)
def _first_bytes(tokenizer: Any, vocab_size: int, eos: frozenset[int]) -> torch.Tensor:
    from ensemble_core.text.distributions import token_table  # the fusion's token texts (cached per tokenizer)

    return first_visible_bytes(token_table(tokenizer, vocab_size, sorted(eos)).keys)


@functools.lru_cache(maxsize=16)
def _closing_signs(tokenizer: Any, vocab_size: int, eos: frozenset[int], inside: bool) -> torch.Tensor:
    from ensemble_core.text.distributions import token_table

    return closing_signs(token_table(tokenizer, vocab_size, sorted(eos)).keys, inside)


@functools.lru_cache(maxsize=128)
def _compile_cached(constraint: JsonConstraint | GrammarConstraint, tokenizer: Any, vocab_size: int,
                    eos: frozenset[int]) -> CompiledConstraint:
    return CompiledConstraint(constraint, tokenizer, vocab_size, eos)


def compile_constraint(constraint: JsonConstraint | GrammarConstraint, tokenizer: Any, vocab_size: int,
                       eos_token_ids: Iterable[int] | None = None) -> CompiledConstraint:
    """Compile (or fetch from the LRU cache) ``constraint`` for one member's tokenizer.

    ``vocab_size`` is the number of the model's output rows (``Member.vocab_size``), which
    may exceed the tokenizer's vocabulary; those extra rows are never allowed.
    ``eos_token_ids`` are the ids that end this member's reply (``Member.eos_token_ids``;
    default: the tokenizer's EOS). The first compile for a tokenizer reads its vocabulary
    (0.3 s for 49k tokens, about 3 s for 262k); later ones take milliseconds.
    """
    if not isinstance(constraint, (JsonConstraint, GrammarConstraint)):
        raise ConstraintError(f"Expected a JsonConstraint, got {type(constraint).__name__}. Wrap the schema: "
                              "JsonConstraint(schema) or tool_call_constraint(tools, choice).")
    if vocab_size <= 0:
        raise ConstraintError(f"vocab_size must be the model's number of output rows (> 0), got {vocab_size}.")
    eos = frozenset(int(i) for i in (eos_token_ids if eos_token_ids is not None else [tokenizer.eos_token_id])
                    if i is not None)
    if not eos:
        raise ConstraintError("The member has no EOS token id, so a constrained reply could never end. "
                              "Pass eos_token_ids=[...].")
    return _compile_cached(constraint, tokenizer, int(vocab_size), eos)


def compile_for_member(constraint: JsonConstraint | GrammarConstraint, member: Any) -> CompiledConstraint:
    """:func:`compile_constraint` with a member's tokenizer, output rows and EOS ids."""
    return compile_constraint(constraint, member.tokenizer, member.vocab_size, member.eos_token_ids)


# ----------------------------------------------------------------------------- state
#: Row ``x`` holds the 8 bits of byte ``x``, lowest first: one index_select unpacks a bitmask
#: (0.2 ms for 262k tokens, 2.5x faster than shifting int32 words).
_BYTE_BITS = ((torch.arange(256).unsqueeze(1) >> torch.arange(8)) & 1).bool()
_LITTLE_ENDIAN = sys.byteorder == "little"


def _unpack(bits: torch.Tensor, n: int) -> torch.Tensor:
    """Bool ``[n]`` from llguidance's int32 bitmask (bit ``j`` of word ``w`` is token ``32 * w + j``)."""
    if _LITTLE_ENDIAN:
        return _BYTE_BITS.index_select(0, bits.view(torch.uint8).to(torch.int64)).flatten()[:n]
    return ((bits.unsqueeze(1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:n].bool()

_EOS_STEP = -1  # a history entry: the EOS that ended the value (no engine tokens)
_owners = itertools.count()


@dataclass(frozen=True)
class Checkpoint:
    """A position of one :class:`ConstraintState` to :meth:`~ConstraintState.restore` later."""

    owner: int
    steps: int


class ConstraintState:
    """One member's grammar position within one request (not thread-safe: one per member).

    A *step* is one successful :meth:`accept_token` or :meth:`accept_text`; :meth:`rollback`
    undoes steps and :meth:`restore` returns to a :meth:`checkpoint`, however many tokens or
    characters lie in between (drafted runs of any length). Rejected tokens or texts leave
    the state as it was.
    """

    def __init__(self, compiled: CompiledConstraint, matcher: Any, loops: LoopPenalty | None = None,
                 close_margin: int = 0) -> None:
        self.compiled = compiled
        self.loops = LoopPenalty() if loops is None else loops
        self.close_margin = close_margin
        self._budget: tuple[int, int] | None = None  # (tokens left, steps when told)
        self._m = matcher
        self._history: list[int] = []  # engine tokens consumed per step, or _EOS_STEP
        self._chunks: list[bytes] = []  # the bytes each step added (the output so far, for the loop penalty)
        self._penalty: tuple[tuple[int, int | None], torch.Tensor | None] | None = None
        self._ended = False
        self._version = 0
        self._owner = next(_owners)
        self._mask: tuple[int, torch.Tensor] | None = None
        self._bits = torch.zeros((compiled._n_engine + 31) // 32, dtype=torch.int32)

    # ------------------------------------------------------------------ queries
    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    @property
    def steps(self) -> int:
        """Steps accepted so far (what :meth:`rollback` can undo)."""
        return len(self._history)

    @property
    def can_end(self) -> bool:
        """The JSON value is complete here, so the member's EOS is allowed (True after the EOS too)."""
        return self._ended or bool(self._m.is_accepting())

    @property
    def finished(self) -> bool:
        """Nothing but EOS can follow (the value is closed), or the EOS was accepted."""
        return self._ended or bool(self._m.is_stopped())

    def allowed(self) -> torch.Tensor:
        """Bool ``[vocab_size]``: the tokens that keep the output valid (cached per position).

        EOS ids are allowed exactly when :attr:`can_end`; after the EOS only EOS ids are,
        so a masked row never becomes all ``-inf``. The tensor is cached and shared until the
        state moves: do not modify it in place.
        """
        if self._mask is not None and self._mask[0] == self._version:
            return self._mask[1]
        c = self.compiled
        mask = torch.zeros(c.vocab_size, dtype=torch.bool)
        if not self._ended:
            self._m.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
            self._raise_if_error()
            mask[: c._n_shared] = _unpack(self._bits, c._n_shared)
            mask[c._engine_eos] = False
        if self.can_end:
            mask[sorted(c.eos_token_ids)] = True
        self._mask = (self._version, mask)
        return mask

    @property
    def text(self) -> bytes:
        """The output bytes accepted so far (tokens and texts, as committed)."""
        return b"".join(self._chunks)

    def set_budget(self, left: int | None) -> None:
        """Tell the state how many budget tokens remain now (None: unknown); it counts its own steps from here."""
        self._budget = None if left is None else (int(left), self.steps)

    @property
    def budget_left(self) -> int | None:
        """Budget tokens left: the last :meth:`set_budget` minus the steps taken since (None: never told)."""
        if self._budget is None:
            return None
        left, at = self._budget
        return left - max(0, self.steps - at)

    def loop_penalties(self, ahead: str = "") -> dict[int, float]:
        """Penalty per next byte after the output and then ``ahead`` (:func:`~.repetition.loop_penalties`)."""
        return loop_penalties(self.text + ahead.encode("utf-8"), self.loops)

    def closing_bonus(self) -> float:
        """Logits for tokens that only close, here (:func:`~ensemble_core.constraints.closing.closing_bonus`)."""
        return closing_bonus(self.budget_left, self.close_margin)

    def text_factors(self, ahead: str, texts: Sequence[bytes | None]) -> torch.Tensor | None:
        """Both rules for a choice among candidate texts after ``ahead`` (an ensemble point, where no
        member's token space applies): ``exp(-penalty)`` of the loop penalty times ``exp(bonus)``
        for closing texts; None when neither applies."""
        penalties, bonus = self.loop_penalties(ahead), self.closing_bonus()
        if not penalties and not bonus:
            return None
        inside = in_string(self.text + ahead.encode("utf-8"))
        return text_factors(penalties, list(texts)) * closing_factors(bonus, texts, inside)

    def penalty(self) -> torch.Tensor | None:
        """Float ``[vocab_size]``: each token's loop penalty minus its closing bonus (plus it, for blank
        tokens) here, None when both are 0 (cached)."""
        key = (self._version, self.budget_left)
        if self._penalty is None or self._penalty[0] != key:
            vec = None
            if not self._ended:
                vec = penalty_vector(self.loop_penalties(), self.compiled.first_bytes)
                bonus = self.closing_bonus()
                if bonus:
                    signed = self.compiled.closing_signs(in_string(self.text)).to(torch.float32) * bonus
                    vec = -signed if vec is None else vec - signed
            self._penalty = (key, vec)
        return self._penalty[1]

    def mask_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` (``[V]`` or ``[n, V]``, every row at this position) with disallowed tokens at -inf.

        Tokens then lose their :meth:`penalty` (one that would continue a repeat loses logits,
        one that closes the value near the end of the budget gains some); an allowed token
        stays finite, so the grammar always has a way on.
        """
        if logits.shape[-1] != self.vocab_size:
            raise ConstraintError(f"The logits have {logits.shape[-1]} columns but the constraint was compiled for "
                                  f"vocab_size={self.vocab_size}. Compile it with the model's number of output rows "
                                  "(Member.vocab_size).")
        masked = logits.masked_fill(~to_device(self.allowed(), logits.device), float("-inf"))
        penalty = self.penalty()
        return masked if penalty is None else masked - to_device(penalty, masked.device).to(masked.dtype)

    def forced(self, limit: int) -> list[int]:
        """Up to ``limit`` of this member's tokens that spell the bytes the grammar forces next (llguidance's
        fast-forward tokens: a property name, the rest of the only tool's name), [] where nothing is forced.

        Why (#38): each of those tokens cost a forward pass of its own, and a read, although nothing is
        chosen there. A decoding loop feeds them as *guesses* with the pass of the token before them and
        keeps those it chooses anyway (:func:`~ensemble_core.decoding.drafting.next_guesses`), so the tokens stay
        the ones a token-by-token loop chooses (the member may spell forced bytes its own way) in fewer
        passes. Special and EOS ids are never forced (the engine's tokens are the member's ids).
        """
        if limit < 1 or self._ended:
            return []
        c = self.compiled
        ids = [int(t) for t in self._m.compute_ff_tokens()[:limit]]
        self._raise_if_error()
        n = next((i for i, t in enumerate(ids) if not 0 <= t < c._n_shared or t in c.eos_token_ids), len(ids))
        return ids[:n]

    def accepts_text(self, text: str, *, end: bool = False) -> bool:
        """Would ``text`` be accepted here (and, with ``end=True``, complete the value)? The state is unchanged.

        Without ``end`` this asks whether ``text`` is a valid continuation, i.e. whether the
        output can still be completed after it.
        """
        if self._ended:
            return text == "" and end
        ids = self._ids(text)
        if not end:
            return self._m.validate_tokens(ids) == len(ids)
        n = self._m.try_consume_tokens(ids)
        ok = n == len(ids) and bool(self._m.is_accepting())
        self._m.rollback(n)
        self._raise_if_error()
        return ok

    # ------------------------------------------------------------------ moves
    def accept_token(self, token_id: int) -> bool:
        """Advance by one of this member's token ids; False (state unchanged) if the grammar forbids it."""
        token_id = int(token_id)
        if token_id in self.compiled.eos_token_ids:
            if not self.can_end:
                return False
            self._push(_EOS_STEP, b"")
            self._ended = True
            return True
        if self._ended or not 0 <= token_id < self.compiled._n_shared:
            return False
        if self._m.try_consume_tokens([token_id]) != 1:
            self._raise_if_error()
            return False
        self._push(1, self.compiled._lltok.decode_bytes([token_id]))
        return True

    def accept_text(self, text: str | bytes) -> bool:
        """Advance by ``text`` (committed by any member; it need not end on a token boundary of this one).
        Bytes may end inside a character (a byte-level token's share of it); the next bytes complete it.

        Returns False and leaves the state unchanged if the grammar rejects the text.
        """
        if self._ended:
            return not text
        ids = self._ids(text)
        n = self._m.try_consume_tokens(ids)
        if n != len(ids):
            self._m.rollback(n)
            self._raise_if_error()
            return False
        self._push(len(ids), text if isinstance(text, bytes) else text.encode("utf-8"))
        return True

    def checkpoint(self) -> Checkpoint:
        """The current position, to :meth:`restore` after a rejected draft."""
        return Checkpoint(self._owner, len(self._history))

    def restore(self, checkpoint: Checkpoint) -> None:
        """Go back to ``checkpoint`` (taken from this state, at or before the current position)."""
        if checkpoint.owner != self._owner:
            raise ConstraintError("This checkpoint belongs to another ConstraintState; restore it on the state that "
                                  "made it.")
        if checkpoint.steps > len(self._history):
            raise ConstraintError(f"The checkpoint is {checkpoint.steps} steps in but the state has been rolled back "
                                  f"to {len(self._history)}; take a new checkpoint after rolling back.")
        self.rollback(len(self._history) - checkpoint.steps)

    def rollback(self, steps: int = 1) -> None:
        """Undo the last ``steps`` accepted tokens / texts."""
        if not 0 <= steps <= len(self._history):
            raise ConstraintError(f"Cannot roll back {steps} steps: {len(self._history)} were accepted.")
        if steps == 0:
            return
        undone = self._history[-steps:]
        del self._history[-steps:]
        del self._chunks[-steps:]
        if _EOS_STEP in undone:
            self._ended = False
        tokens = sum(n for n in undone if n > 0)
        if tokens:
            self._m.rollback(tokens)
        self._raise_if_error()
        self._version += 1

    # ------------------------------------------------------------------ internals
    def _push(self, entry: int, chunk: bytes) -> None:
        self._history.append(entry)
        self._chunks.append(chunk)
        self._version += 1

    def _ids(self, text: str | bytes) -> list[int]:
        """Engine tokens that spell exactly ``text`` (any split works on bytes: greedy over the vocabulary for a
        string, the tokenizer's own split for bytes, which may end inside a character)."""
        if not text:
            return []
        lltok = self.compiled._lltok
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        ids = lltok.tokenize_bytes(data) if isinstance(text, bytes) else lltok.greedy_tokenize(text)
        if lltok.decode_bytes(ids) != data:
            raise ConstraintError(f"The tokenizer of this member cannot spell {text[:40]!r} byte for byte (it lacks "
                                  "byte tokens), so its grammar position cannot follow the committed text. Use members "
                                  "with byte-level BPE or byte-fallback SentencePiece tokenizers.")
        return ids

    def _raise_if_error(self) -> None:
        if self._m.is_error():
            raise ConstraintError(f"The grammar engine stopped: {self._m.get_error()[:500]}. The schema is probably "
                                  "too complex for one step (deep nesting, huge enums); simplify it.")


def request_constraint(request: StructuredRequest) -> Any:
    """The grammar every member decodes under, or None for free decoding (checked when the request starts)."""
    if request.forced_call:
        return tool_call_constraint([{"type": "function", "function": t} for t in request.tools],
                                    None if request.choice == "required" else request.choice)
    if request.schema is not None and not (request.tools and request.choice == "auto"):
        return JsonConstraint(request.schema or None)
    return None

