"""JSON Schema rewrites: one walk over every (sub)schema, and the rewrites built on it.

Used below the grammar engine (:func:`~ensemble_core.constraints.grammar.bounded_integers`)
and by the adapters' strict mode (:func:`closed_schema`).
"""

from __future__ import annotations

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
    :func:`ensemble_core.constraints.grammar.bounded_integers`); ``fix`` gets a fresh dict it may change.
    """
    if isinstance(schema, list):
        return [map_subschemas(s, fix) for s in schema]
    if not isinstance(schema, Mapping):
        return schema
    out = {k: map_subschemas(v, fix) if k in _SUBSCHEMA_KEYS else v for k, v in schema.items()}
    for key in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(key), Mapping):
            out[key] = {name: map_subschemas(sub, fix) for name, sub in schema[key].items()}
    return fix(out)


def _close(node: dict[str, Any]) -> dict[str, Any]:
    if (node.get("type") == "object" or "properties" in node) and "additionalProperties" not in node:
        node["additionalProperties"] = False
    return node


def closed_schema(schema: Any) -> Any:
    """A copy of a JSON Schema whose objects allow no undeclared properties (where it does not say).

    What OpenAI's strict mode requires, and the adapters' default for tool parameters and
    schemas (``strict=None``): a schema that lists properties almost always means "these
    fields", a small model left free to add keys spends the token budget on them (seen with
    the bundled pair: the schema's own keywords written as extra keys), and a function or a
    pydantic class accepts only what it declares. ``additionalProperties: true`` in the
    schema (or ``strict=False`` in the adapters) keeps extra keys allowed.
    """
    return map_subschemas(schema, _close)


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
