"""JSON schemas as the engine and the doors read them: xgrammar's strict mode made explicit for llguidance
(`strict_schema`), and what Anthropic's structured outputs refuse (`anthropic_schema_problem`)."""

from __future__ import annotations

from typing import Any

_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMA_ONE = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "not", "propertyNames")


def strict_schema(schema: Any) -> Any:
    """The schema with xgrammar's `strict_mode=True` made explicit: an object allows no property it does not name
    (unless it says otherwise), an array with `prefixItems` no item past them."""
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_LISTS and isinstance(value, list):
            out[key] = [strict_schema(v) for v in value]
        elif key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            out[key] = {k: strict_schema(v) for k, v in value.items()}
        elif key in _SUBSCHEMA_ONE and isinstance(value, dict):
            out[key] = strict_schema(value)
        else:
            out[key] = value
    kind = out.get("type")
    is_object = kind == "object" or (kind is None and ("properties" in out or "required" in out))
    if is_object and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out


# Integer bounds the engine's grammar compilers enforce: llguidance works in 64-bit integers, refuses most bounds past
# them and crashed (a stack overflow) on ranges saturated next to -2^63, so bounds past 2^62 are refused up front.
INTEGER_BOUND_LIMIT = 2**62
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
_VALUES = ("enum", "const", "default", "examples")


def integer_bound_problem(schema: Any) -> str | None:
    """Why an integer schema's bound cannot be enforced (one past +-2^62), or None. Walks every subschema, not
    only the ones strict mode knows: a bound anywhere reaches the compiler."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        kind = node.get("type")
        if kind == "integer" or (isinstance(kind, list) and "integer" in kind):
            for key in _BOUNDS:
                bound = node.get(key)
                if (
                    isinstance(bound, (int, float))
                    and not isinstance(bound, bool)
                    and abs(bound) >= INTEGER_BOUND_LIMIT
                ):
                    return f"the integer bound {key}={bound:.6g} is out of range; bounds must lie within +-2^62"
        stack.extend(v for k, v in node.items() if k not in _VALUES)
    return None


# -- Anthropic's structured-output schema limits -----------------------------------------------------------------

# What Anthropic's structured outputs take (its documentation's "JSON Schema limitations"; the anthropic SDK's
# transform_schema moves everything else into descriptions): these keywords, plus annotations.
_ANTHROPIC_KEYWORDS = frozenset(
    {"type", "properties", "required", "additionalProperties", "items", "minItems", "enum", "const", "anyOf", "oneOf"}
    | {"allOf", "$ref", "$defs", "definitions", "format", "description", "title", "default", "examples"}
    | {"$schema", "$id", "$comment", "nullable"}
)
_ANTHROPIC_FORMATS = frozenset(
    {"date-time", "time", "date", "duration", "email", "hostname", "uri", "ipv4", "ipv6", "uuid"}
)


def anthropic_schema_problem(schema: Any) -> str | None:
    """Why Anthropic's API would refuse `schema` as an output format, or None: a keyword it does not support
    (numeric and string bounds, patterns, array sizes beyond minItems 0 or 1, ...), additionalProperties other than
    false, a format it does not know, a reference outside the schema, or a recursive schema."""

    def walk(node: Any, path: str) -> str | None:
        if isinstance(node, bool) or not isinstance(node, dict):
            return None if isinstance(node, bool) else f"{path} is not a schema"
        for key, value in node.items():
            where = f"{path}.{key}" if path else key
            if key not in _ANTHROPIC_KEYWORDS:
                return f"the keyword '{key}' (at {where}) is not supported in structured outputs"
            if key == "additionalProperties" and value is not False:
                return f"'additionalProperties' (at {where}) must be false"
            if key == "minItems" and value not in (0, 1):
                return f"'minItems' (at {where}) may only be 0 or 1"
            if key == "format" and value not in _ANTHROPIC_FORMATS:
                return f"the string format {str(value)[:40]!r} (at {where}) is not supported"
            if key == "$ref" and not str(value).startswith("#"):
                return f"only references inside the schema are supported ('{str(value)[:80]}' at {where})"
        for key in ("properties", "$defs", "definitions"):
            for name, sub in (node.get(key) or {}).items():
                if problem := walk(sub, f"{path}.{key}.{name}" if path else f"{key}.{name}"):
                    return problem
        for key in ("anyOf", "oneOf", "allOf"):
            for i, sub in enumerate(node.get(key) or []):
                if problem := walk(sub, f"{path}.{key}[{i}]" if path else f"{key}[{i}]"):
                    return problem
        if isinstance(node.get("items"), dict):
            return walk(node["items"], f"{path}.items" if path else "items")
        return None

    problem = walk(schema, "")
    if problem is None and _recursive(schema):
        problem = "recursive schemas are not supported in structured outputs"
    return problem


def _recursive(schema: Any) -> bool:
    """Whether following `$ref`s from the root can come back to a reference on its own path."""

    def resolve(ref: str) -> Any:
        node: Any = schema
        for part in ref.lstrip("#").strip("/").split("/") if ref not in ("#", "#/") else []:
            node = node.get(part.replace("~1", "/").replace("~0", "~")) if isinstance(node, dict) else None
        return node

    def visit(node: Any, active: frozenset[str]) -> bool:
        if isinstance(node, list):
            return any(visit(n, active) for n in node)
        if not isinstance(node, dict):
            return False
        ref = node.get("$ref")
        if isinstance(ref, str):
            if ref in active:
                return True
            if visit(resolve(ref), active | {ref}):
                return True
        return any(visit(v, active) for k, v in node.items() if k not in ("$ref", "$defs", "definitions"))

    return visit(schema, frozenset())
