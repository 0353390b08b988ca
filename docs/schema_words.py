"""A JSON schema in a few words, for the Reference's tables (docs/gen_reference.py): types, bounds, defaults."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any


def cell(text: Any) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ").strip()


def literal(value: Any) -> str:
    return f"`{json.dumps(value)}`"


def ref_name(schema: dict) -> str | None:
    ref = schema.get("$ref")
    return ref.rsplit("/", 1)[-1] if ref else None


def type_of(schema: dict, link: Callable[[str], str] = lambda name: name) -> str:
    """A schema's type in a few words: `int`, `"ddp" or "fsdp"`, `list[str]`, `Resources` (linked)."""
    if name := ref_name(schema):
        return link(name)
    if "const" in schema:
        return literal(schema["const"])
    if "enum" in schema:
        return " or ".join(literal(v) for v in schema["enum"])
    for key in ("anyOf", "oneOf"):
        if key in schema:
            parts = [type_of(s, link) for s in schema[key] if s.get("type") != "null"]
            nullable = any(s.get("type") == "null" for s in schema[key])
            return " or ".join(dict.fromkeys(parts)) + (" or null" if nullable else "")
    kind = schema.get("type")
    if kind == "array":
        if "prefixItems" in schema:
            return "[" + ", ".join(type_of(s, link) for s in schema["prefixItems"]) + "]"
        return f"list[{type_of(schema.get('items', {}), link)}]"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"dict[str, {type_of(schema['additionalProperties'], link)}]"
    if kind == "object" and schema.get("patternProperties"):
        return f"dict[str, {type_of(next(iter(schema['patternProperties'].values())), link)}]"
    names = {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "object": "object"}
    if isinstance(kind, list):
        return " or ".join(names.get(k, k) for k in kind)
    return names.get(kind, "any")


def number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() and abs(value) < 1e18 else f"{value:g}"


def bounds_of(schema: dict) -> str:
    """A schema's bounds: `1 ≤ x ≤ 64`, `length 1–128`, `at most 32 items`, its pattern."""
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return "; ".join(b for s in schema[key] if (b := bounds_of(s)))
    out = []
    low = (f"{number(schema['minimum'])} ≤ " if "minimum" in schema
           else f"{number(schema['exclusiveMinimum'])} < " if "exclusiveMinimum" in schema else "")
    high = (f" ≤ {number(schema['maximum'])}" if "maximum" in schema
            else f" < {number(schema['exclusiveMaximum'])}" if "exclusiveMaximum" in schema else "")
    if low or high:
        out.append(f"{low}x{high}")
    if "minLength" in schema or "maxLength" in schema:
        out.append(f"length {schema.get('minLength', 0)}–{schema.get('maxLength', '∞')}")
    if "pattern" in schema:
        out.append(f"pattern `{schema['pattern']}`")
    for key, word in (("minItems", "at least {} items"), ("maxItems", "at most {} items"),
                      ("minProperties", "at least {} entries"), ("maxProperties", "at most {} entries")):
        if key in schema:
            out.append(word.format(schema[key]))
    for key, word in (("items", "each"), ("additionalProperties", "each value"), ("propertyNames", "each key")):
        if isinstance(schema.get(key), dict) and not ref_name(schema[key]) and (inner := bounds_of(schema[key])):
            out.append(f"{word}: {inner}")
    for pattern, inner in schema.get("patternProperties", {}).items():
        out.append(f"each key: pattern `{pattern}`" + (f"; each value: {b}" if (b := bounds_of(inner)) else ""))
    if "prefixItems" in schema:
        out.extend(f"item {i}: {b}" for i, s in enumerate(schema["prefixItems"]) if (b := bounds_of(s)))
    return "; ".join(out)


def default_of(name: str, schema: dict, required: list[str], model: Any = None) -> str:
    """The default as JSON; a default made by a factory (a list, a section) from the model itself."""
    if name in required:
        return "required"
    if "default" in schema:
        return literal(schema["default"])
    field = getattr(model, "model_fields", {}).get(name)
    if field is not None:
        value = field.get_default(call_default_factory=True)
        if hasattr(value, "model_dump"):
            return "its fields' defaults"
        return literal(value)
    return "—"


def fields_table(schema: dict, *, prefix: str = "", link: Callable[[str], str] = lambda n: n,
                 model: Any = None) -> list[str]:
    """One row per property of an object schema (`model`: the pydantic class, for factory defaults)."""
    rows = ["| field | type | default | bounds | description |", "| --- | --- | --- | --- | --- |"]
    required = schema.get("required", [])
    for name, prop in schema.get("properties", {}).items():
        default = default_of(name, prop, required, model)
        rows.append(f"| `{prefix}{name}` | {cell(type_of(prop, link))} | {cell(default)} | "
                    f"{cell(bounds_of(prop))} | {cell(prop.get('description', ''))} |")
    return rows


def object_refs(schema: dict) -> list[str]:
    """The object schemas a property holds (itself, nullable, a union's variants, a dict's values)."""
    if name := ref_name(schema):
        return [name]
    found = []
    for key in ("anyOf", "oneOf"):
        for inner in schema.get(key, []):
            found += object_refs(inner)
    if isinstance(schema.get("additionalProperties"), dict):
        found += object_refs(schema["additionalProperties"])
    for inner in schema.get("patternProperties", {}).values():
        found += object_refs(inner)
    return found
