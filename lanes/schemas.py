"""JSON-schema defaults applied before a tool's parameters or a ``json_schema`` response format
become a grammar.

Object schemas that list ``properties`` but do not say ``additionalProperties`` are *closed* by
default (as OpenAI's strict mode and the common grammar engines' strict defaults treat them):
frameworks such as LangChain write tool schemas without it, and under an open object a small
model keeps inventing keys until ``max_tokens``. A bare ``{"type": "object"}`` (no ``properties``)
is a free-form object by intent and stays open. A schema that says ``additionalProperties`` (or ``patternProperties``
/ ``unevaluatedProperties``) keeps its own rule. A request may ask for open objects with
``additional_properties_default: true``; a lane's default is ``additional_properties_default``
in its config (docs/gateway.md, "Structured outputs and tools").

Objects that take part in ``allOf`` composition stay as written: closing one member (or the
node that combines them) would reject the keys the other members add.
"""

from __future__ import annotations

from typing import Any

__all__ = ["close_objects"]

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "dependentSchemas", "patternProperties")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONES = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "additionalItems",
                "unevaluatedItems", "propertyNames")


def _is_object(node: dict[str, Any]) -> bool:
    """An object schema that lists its keys (``properties``, even ``{}``): a bare ``{"type": "object"}``
    is a free-form object by intent and stays open."""
    t = node.get("type")
    return "properties" in node and (t is None or t == "object" or (isinstance(t, list) and "object" in t))


def close_objects(schema: Any, *, _in_all_of: bool = False) -> Any:
    """A copy of ``schema`` with ``"additionalProperties": false`` on every object schema that leaves
    extra keys unsaid (the input is not changed; anything that is not a schema passes through)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        sub = out.get(key)
        if isinstance(sub, dict):
            out[key] = {k: close_objects(v) for k, v in sub.items()}
    for key in _SCHEMA_LISTS:
        sub = out.get(key)
        if isinstance(sub, list):
            out[key] = [close_objects(v) for v in sub]
    for key in _SCHEMA_ONES:
        sub = out.get(key)
        if isinstance(sub, dict):
            out[key] = close_objects(sub)
        elif key == "items" and isinstance(sub, list):  # draft-4 tuple form
            out[key] = [close_objects(v) for v in sub]
    all_of = out.get("allOf")
    if isinstance(all_of, list):
        out["allOf"] = [close_objects(v, _in_all_of=True) for v in all_of]
    if (_is_object(out) and not _in_all_of and "allOf" not in out and "$ref" not in out
            and not any(k in out for k in _OPEN_KEYS)):
        out["additionalProperties"] = False
    return out
