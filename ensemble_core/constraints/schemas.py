"""JSON Schema rewrites: one walk over every (sub)schema, and the rewrites built on it; and a schema
written as the value it asks for (:func:`schema_sketch`), which is what the members read of it.

Used below the grammar engine (:func:`~ensemble_core.constraints.grammar.bounded_integers`),
by the adapters' strict mode (:func:`closed_schema`) and by the system prompt of a
``response_format`` (:func:`~ensemble_core.constraints.structured.schema_instructions`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

# ----------------------------------------------------------------------------- schemas
#: Keywords whose value is a subschema or a list of them, and keywords whose value maps names to
#: subschemas (``not`` is left alone: a rewrite inside it would invert its meaning).
_SUBSCHEMA_KEYS = frozenset({"items", "prefixItems", "anyOf", "allOf", "oneOf", "additionalProperties", "contains"})


_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def map_subschemas(schema: Any, fix: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of a JSON Schema with ``fix`` applied to every (sub)schema, innermost first.

    The one walk behind every schema rewrite (:func:`closed_schema`,
    :func:`~ensemble_core.constraints.grammar.bounded_integers`, :func:`~ensemble_core.constraints.grammar.engine_schema`);
    ``fix`` gets a fresh dict it may change.
    """
    return _walk(schema, lambda node, _key: fix(node), None)


def _walk(schema: Any, fix: Callable[[dict[str, Any], str | None], dict[str, Any]], key: str | None) -> Any:
    """:func:`map_subschemas`, telling ``fix`` the keyword each node stands under (None at the root)."""
    if isinstance(schema, list):
        return [_walk(s, fix, key) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: _walk(v, fix, k) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for name in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(name), Mapping):
            out[name] = {prop: _walk(sub, fix, name) for prop, sub in schema[name].items()}
    return fix(out, key)


#: Keywords beside which ``additionalProperties: false`` would refuse properties declared elsewhere (it sees only
#: its own node's ``properties``): such a node is left open.
_COMPOSED = frozenset({"allOf", "$ref", "unevaluatedProperties"})


def closed_schema(schema: Any) -> Any:
    """A copy of a JSON Schema whose objects allow no undeclared properties (where it does not say).

    What OpenAI's strict mode requires, and the adapters' default for tool parameters and
    schemas (``strict=None``): a schema that lists properties almost always means "these
    fields", a small model left free to add keys spends the token budget on them (seen with
    the bundled pair: the schema's own keywords written as extra keys), and a function or a
    pydantic class accepts only what it declares. ``additionalProperties: true`` in the
    schema (or ``strict=False`` in the adapters) keeps extra keys allowed.

    Only objects that list their own ``properties`` are closed, so that closing never changes
    what a satisfiable schema means: a free-form ``{"type": "object"}`` (no properties) stays
    any object, the branches of an ``allOf`` stay open (each would refuse the others' keys), and
    so does a node beside ``allOf`` / ``$ref`` (the properties it sees are not all it declares).
    """
    return _walk(schema, _close, None)


def _close(node: dict[str, Any], key: str | None) -> dict[str, Any]:
    if (key != "allOf" and isinstance(node.get("properties"), Mapping) and "additionalProperties" not in node
            and not _COMPOSED & node.keys()):
        node["additionalProperties"] = False
    return node


def strict_tools(specs: Sequence[Mapping[str, Any]], strict: bool | None = None) -> list[dict[str, Any]]:
    """OpenAI-style tool specs with their parameters closed (:func:`closed_schema`) unless ``strict`` is False.

    The adapters' ``bind_tools`` / ``chat_with_tools`` default (``strict=None``): see
    :func:`closed_schema` for why. A spec without a ``function`` field is left as it is.
    """
    if strict is False:
        return [dict(s) for s in specs]
    out = []
    for spec in specs:
        function = spec.get("function")
        if isinstance(function, Mapping):
            spec = {**spec, "function": {**function, "parameters": closed_schema(function.get("parameters") or {})}}
        out.append(dict(spec))
    return out


def json_schema_format(schema: Mapping[str, Any], name: str | None = None, strict: bool | None = None) -> dict[str, Any]:
    """OpenAI's ``response_format`` for a JSON Schema: ``{"type": "json_schema", "json_schema": {...}}``.

    What the adapters' structured output sends to the core (LangChain's ``with_structured_output``,
    LlamaIndex's ``structured_predict``): the schema closed (:func:`closed_schema`) unless ``strict``
    is False, named by its ``title``, else ``name`` (a class's), else ``"response"``.
    """
    if strict is not False:
        schema = closed_schema(schema)
    return {"type": "json_schema", "json_schema": {"name": str(schema.get("title") or name or "response"),
                                                   "schema": dict(schema), "strict": strict is not False}}


# ----------------------------------------------------------------------------- the schema as a form
#: A description longer than this is cut (with "...") inside a placeholder: the form stays a form.
SKETCH_DESCRIPTION_CHARS = 120
#: An enum shows this many of its values, then "...".
SKETCH_ENUM_VALUES = 20


def schema_sketch(schema: Mapping[str, Any]) -> str:
    """A JSON Schema written as the value it asks for, with placeholders: ``{"answer": "<the answer>"}``.

    Why: the members read the instruction, the grammar enforces the schema. Shown the schema itself
    (``{"properties": {"answer": {"description": ..., "type": "string"}}, ...}``), Qwen2.5-Coder-0.5B
    (no grammar) wrote the schema back, or one more call, after a tool's result on 24 of 24 agent
    tasks, and with tools offered called ``capital_of("USA")`` for "What is 1234 plus 5678?"; shown
    this form it answered ``{"answer": "6912"}`` (docs/agents.md, "The schema as a form"). A
    placeholder names the field's description or type, and what the grammar will hold it to (an
    enum's values, up to :data:`SKETCH_ENUM_VALUES` of them, a range, a format, a pattern, optional
    keys, list bounds); ``$ref`` s are followed into ``$defs``, a recursive one once (its second use
    is a placeholder named after it). Any mapping is accepted: what is not understood reads as
    ``<any JSON value>``.
    """
    return _sketch(schema, schema, ())


def _sketch(node: Any, root: Mapping[str, Any], seen: tuple[str, ...]) -> str:
    if not isinstance(node, Mapping):
        return "<any JSON value>" if node is not False else "<nothing>"
    ref = node.get("$ref")
    if isinstance(ref, str):
        target = _resolve(ref, root)
        if target is None or ref in seen:
            return "<" + (_described(node) or ref.rsplit("/", 1)[-1] or "value") + ">"
        merged = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
        return _sketch(merged, root, (*seen, ref))
    if "const" in node:
        return json.dumps(node["const"], ensure_ascii=False)
    if isinstance(node.get("enum"), list) and node["enum"]:
        values = [json.dumps(v, ensure_ascii=False) for v in node["enum"][:SKETCH_ENUM_VALUES]]
        return "<one of " + ", ".join(values + ["..."] * (len(node["enum"]) > SKETCH_ENUM_VALUES)) + ">"
    for key in ("anyOf", "oneOf"):
        options = node.get(key)
        if isinstance(options, list) and options:
            return _union(node, options, root, seen)
    parts = node.get("allOf")
    if isinstance(parts, list) and len(parts) == 1:
        return _sketch({**parts[0], **{k: v for k, v in node.items() if k != "allOf"}}, root, seen)
    kind = node.get("type")
    if isinstance(kind, list):
        kinds = [k for k in kind if k != "null"]
        text = " or ".join(_sketch({**node, "type": k}, root, seen) for k in kinds) or "null"
        return text + (" or null" if "null" in kind and kinds else "")
    if kind == "object" or "properties" in node:
        return _object(node, root, seen)
    if kind == "array" or "items" in node or "prefixItems" in node:
        return _array(node, root, seen)
    return _scalar(node, kind)


def _resolve(ref: str, root: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """A local ``$ref`` (``#/$defs/Name``, ``#/definitions/Name``, ``#``) in ``root``; None for others."""
    if ref == "#":
        return root
    if not ref.startswith("#/"):
        return None
    node: Any = root
    for part in ref[2:].split("/"):
        node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, Mapping) else None
    return node if isinstance(node, Mapping) else None


def _described(node: Mapping[str, Any]) -> str:
    text = " ".join(str(node.get("description") or "").split())
    return text if len(text) <= SKETCH_DESCRIPTION_CHARS else text[: SKETCH_DESCRIPTION_CHARS - 3].rstrip() + "..."


def _union(node: Mapping[str, Any], options: list[Any], root: Mapping[str, Any], seen: tuple[str, ...]) -> str:
    """``anyOf`` / ``oneOf``: each option's form joined by "or" (an optional field: its form "or null")."""
    outer = {k: v for k, v in node.items() if k not in ("anyOf", "oneOf")}
    kinds = [o for o in options if not (isinstance(o, Mapping) and o.get("type") == "null")]
    forms = [_sketch({**outer, **o} if isinstance(o, Mapping) else o, root, seen) for o in kinds]
    return " or ".join(dict.fromkeys(forms)) + (" or null" if len(kinds) < len(options) and forms else "") or "null"


def _object(node: Mapping[str, Any], root: Mapping[str, Any], seen: tuple[str, ...]) -> str:
    properties = node.get("properties") if isinstance(node.get("properties"), Mapping) else {}
    required = set(node["required"]) if isinstance(node.get("required"), list) else set()
    fields = []
    for name, sub in properties.items():
        form = _sketch(sub, root, seen)
        if name not in required:
            form = _noted(form, "optional")
        fields.append(f"{json.dumps(name, ensure_ascii=False)}: {form}")
    extra = node.get("additionalProperties")
    if isinstance(extra, Mapping) or (not properties and extra is not False):
        fields.append(f'"<key>": {_sketch(extra if isinstance(extra, Mapping) else True, root, seen)}, ...')
    return "{" + ", ".join(fields) + "}"


def _array(node: Mapping[str, Any], root: Mapping[str, Any], seen: tuple[str, ...]) -> str:
    first = [_sketch(s, root, seen) for s in node.get("prefixItems") or ()]
    items = node.get("items")
    more = [] if items is False else [_sketch(items if items is not None else True, root, seen), "..."]
    bounds = _bounds(node.get("minItems"), node.get("maxItems"), "items")
    form = "[" + ", ".join(first + more) + "]"
    return _noted(form, bounds) if bounds else form


def _noted(form: str, note: str) -> str:
    """``form`` with ``note`` inside its placeholder (``"<text, note>"``, ``<number, note>``), else after it."""
    if form.endswith('>"'):
        return f'{form[:-2]}, {note}>"'
    if form.endswith(">") and form.startswith("<"):
        return f"{form[:-1]}, {note}>"
    return f"{form} ({note})"


def _bounds(low: Any, high: Any, unit: str = "") -> str:
    unit = f" {unit}" if unit else ""
    if low is not None and high is not None:
        return f"{low} to {high}{unit}"
    if low is not None:
        return f"at least {low}{unit}"
    return f"at most {high}{unit}" if high is not None else ""


def _scalar(node: Mapping[str, Any], kind: Any) -> str:
    """A string, number, integer, boolean or null placeholder: its description (or type) and its limits."""
    notes = []
    if kind in ("integer", "number"):
        low = node.get("minimum", node.get("exclusiveMinimum"))
        high = node.get("maximum", node.get("exclusiveMaximum"))
        notes.append(_bounds(low, high))
    elif kind == "string":
        notes += [str(node.get("format") or ""), _bounds(node.get("minLength"), node.get("maxLength"), "characters")]
        if node.get("pattern"):
            notes.append(f"matching {node['pattern']}")
    elif kind == "boolean":
        notes.append("true or false")
    elif kind == "null":
        return "null"
    head = _described(node) or (kind if isinstance(kind, str) and kind != "boolean" else "")
    text = ", ".join(n for n in [head, *notes] if n) or "any JSON value"
    return f'"<{text}>"' if kind == "string" else f"<{text}>"
