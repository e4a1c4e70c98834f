"""Checking a tool call's arguments against its JSON Schema, for `strict` tools.

OpenAI's strict mode guarantees that a call's arguments match the tool's schema; it allows a subset of
JSON Schema (objects with `properties`, `required` and `additionalProperties: false`, the scalar types,
arrays with `items`, `enum`, `const`, `anyOf`, local `$ref`s into `$defs`). This server does not constrain
decoding, so it keeps the guarantee by checking: a call of a strict tool whose arguments break the schema
is not a call (it stays text). Keywords outside that subset are not checked.
"""

from __future__ import annotations

from typing import Any

_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}


def _type_ok(value: Any, kind: str) -> bool:
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    expected = _TYPES.get(kind)
    return expected is None or isinstance(value, expected)


def schema_errors(value: Any, schema: Any, root: dict[str, Any] | None = None, where: str = "arguments") -> list[str]:
    """What in `value` breaks `schema` (empty: it conforms), each naming where."""
    if not isinstance(schema, dict):
        return []
    root = schema if root is None else root
    ref = schema.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/"):
        target: Any = root
        for part in ref[2:].split("/"):
            target = target.get(part, {}) if isinstance(target, dict) else {}
        return schema_errors(value, target, root, where)
    if "anyOf" in schema:
        options = [schema_errors(value, s, root, where) for s in schema["anyOf"]]
        if all(options):
            return [f"{where} matches none of anyOf"]
    kinds = schema.get("type")
    kinds = [kinds] if isinstance(kinds, str) else kinds
    if isinstance(kinds, list) and not any(_type_ok(value, k) for k in kinds):
        return [f"{where} must be {' or '.join(kinds)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where} must be one of {schema['enum']}"]
    if "const" in schema and value != schema["const"]:
        return [f"{where} must be {schema['const']!r}"]
    errors: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else {}
        errors += [f"{where}.{k} is required" for k in schema.get("required", []) if k not in value]
        if schema.get("additionalProperties") is False:
            errors += [f"{where}.{k} is not allowed" for k in value if k not in props]
        for k, v in value.items():
            if k in props:
                errors += schema_errors(v, props[k], root, f"{where}.{k}")
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, v in enumerate(value):
            errors += schema_errors(v, schema["items"], root, f"{where}[{i}]")
    return errors
