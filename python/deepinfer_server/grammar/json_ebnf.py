"""JSON values constrained by a JSON schema, as EBNF rules in xgrammar's dialect: tool parameters and a structured
answer beside tools (`JsonEbnf`). Numeric bounds cost a constant whatever their digits (`int_range`)."""

from __future__ import annotations

import json
import math
from typing import Any

from deepinfer_server.grammar.base import Budget, GrammarError


def lit(s: str) -> str:
    """An EBNF string literal (xgrammar's and GBNF's syntax)."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


JSON_BASE = r"""
ws ::= [ ]?
jvalue ::= jobject | jarray | jstring | jnumber | "true" | "false" | "null"
jobject ::= "{" ws ( jstring ws ":" ws jvalue ( ws "," ws jstring ws ":" ws jvalue )* )? ws "}"
jarray ::= "[" ws ( jvalue ( ws "," ws jvalue )* )? ws "]"
jstring ::= "\"" jchar* "\""
jchar ::= [^"\\\x00-\x1f] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] )
jinteger ::= "-"? ( "0" | [1-9] [0-9]* )
jnumber ::= jinteger ( "." [0-9]+ )? ( [eE] [-+]? [0-9]+ )?
rawtext ::= [^<｜]*
"""


class JsonEbnf:
    """JSON values constrained by a JSON schema, as EBNF rules (the subset tool parameters use; see `unsupported`)."""

    def __init__(self, root: dict[str, Any], prefix: str, budget: Budget) -> None:
        self.root = root
        self.prefix = prefix  # rule names of one tool's parameters
        self.budget = budget
        self.rules: dict[str, str] = {}
        self.names: dict[str, str] = {}
        self.refs: dict[str, str] = {}  # $ref -> its rule (numbered: a path may hold any character)

    def rule(self, body: str) -> str:
        name = self.names.get(body)
        if name is None:
            name = self.names[body] = f"{self.prefix}r{len(self.names)}"
            self.budget.charge(len(name) + len(body) + 6)
            self.rules[name] = body
        return name

    def value(self, s: Any) -> str:
        if s is True or s == {}:
            return "jvalue"
        if s is False or not isinstance(s, dict):
            raise GrammarError(f"schema {json.dumps(s)[:80]} accepts no value")
        if "$ref" in s:
            return self._ref(str(s["$ref"]))
        if "const" in s:
            return lit(json.dumps(s["const"], ensure_ascii=False))
        if "enum" in s:
            values = s["enum"]
            if not isinstance(values, list) or not values:
                raise GrammarError("'enum' must be a non-empty array")
            return self.rule(" | ".join(lit(json.dumps(v, ensure_ascii=False)) for v in values))
        for key in ("anyOf", "oneOf"):
            if key in s:
                options = s[key]
                if not isinstance(options, list) or not options:
                    raise GrammarError(f"'{key}' must be a non-empty array")
                return self.rule(" | ".join(self.value(o) for o in options))
        if "allOf" in s:
            parts = s["allOf"]
            if isinstance(parts, list) and len(parts) == 1:
                return self.value(parts[0])
            raise GrammarError("'allOf' with several schemas is not supported in tool parameters")
        kind = s.get("type")
        if isinstance(kind, list):
            return self.rule(" | ".join(self.value({**s, "type": k}) for k in kind))
        if kind is None:
            if "properties" in s:
                kind = "object"
            elif "items" in s or "prefixItems" in s:
                kind = "array"
            else:
                return "jvalue"
        if kind == "string":
            lo, hi = s.get("minLength"), s.get("maxLength")
            if lo is None and hi is None:
                return "jstring"
            return self.rule(f'"\\"" jchar{{{int(lo or 0)},{"" if hi is None else int(hi)}}} "\\""')
        if kind == "integer":
            return self._integer(s)
        if kind == "number":
            return "jnumber"
        if kind == "boolean":
            return self.rule('"true" | "false"')
        if kind == "null":
            return '"null"'
        if kind == "array":
            return self._array(s)
        if kind == "object":
            return self._object(s)
        raise GrammarError(f'unsupported type "{kind}"')

    def _integer(self, s: dict[str, Any]) -> str:
        lo, hi = s.get("minimum"), s.get("maximum")
        if isinstance(s.get("exclusiveMinimum"), (int, float)) and not isinstance(s.get("exclusiveMinimum"), bool):
            lo = s["exclusiveMinimum"] + 1 if lo is None else max(lo, s["exclusiveMinimum"] + 1)
        if isinstance(s.get("exclusiveMaximum"), (int, float)) and not isinstance(s.get("exclusiveMaximum"), bool):
            hi = s["exclusiveMaximum"] - 1 if hi is None else min(hi, s["exclusiveMaximum"] - 1)
        if lo is None and hi is None:
            return "jinteger"
        lo = None if lo is None else math.ceil(lo)
        hi = None if hi is None else math.floor(hi)
        if lo is not None and hi is not None and lo > hi:
            raise GrammarError("minimum is greater than maximum")
        return self.rule(" | ".join(int_range(lo, hi)))

    def _ref(self, ref: str) -> str:
        if not ref.startswith("#/"):
            raise GrammarError(f"$ref {ref!r}: only references inside the schema (#/...) are supported")
        name = self.refs.get(ref)
        if name is None:
            name = self.refs[ref] = f"{self.prefix}ref{len(self.refs)}"
            node: Any = self.root
            for part in ref[2:].split("/"):
                part = part.replace("~1", "/").replace("~0", "~")
                if not isinstance(node, dict) or part not in node:
                    raise GrammarError(f"$ref {ref!r} does not exist")
                node = node[part]
            self.rules[name] = ""  # placeholder: a recursive reference names the rule before it is written
            self.rules[name] = body = self.value(node)
            self.budget.charge(len(name) + len(body) + 6)
        return name

    def _array(self, s: dict[str, Any]) -> str:
        prefix = [self.value(p) for p in s.get("prefixItems") or []]
        items = s.get("items", not prefix)
        lo, hi = int(s.get("minItems") or 0), s.get("maxItems")
        seq = ' ws "," ws '.join(prefix)
        if items is False:
            if len(prefix) < lo:
                raise GrammarError("minItems is more than the array's prefixItems allow")
            return self.rule(f'"[" ws {seq} ws "]"' if prefix else '"[" ws "]"')
        item = self.value(items)
        more_lo = max(0, lo - len(prefix))
        more_hi = None if hi is None else int(hi) - len(prefix)
        if more_hi is not None and more_hi < more_lo:
            raise GrammarError("minItems is greater than maxItems")
        if prefix:
            tail = self._repeat(f'( ws "," ws {item} )', more_lo, more_hi)
            return self.rule(f'"[" ws {seq} {tail} ws "]"')
        if more_hi == 0:
            return self.rule('"[" ws "]"')
        rest = self._repeat(f'( ws "," ws {item} )', max(0, more_lo - 1), None if more_hi is None else more_hi - 1)
        body = f"{item} {rest}"
        return self.rule(f'"[" ws {body} ws "]"' if more_lo else f'"[" ws ( {body} )? ws "]"')

    @staticmethod
    def _repeat(expr: str, lo: int, hi: int | None) -> str:
        if hi is None:
            return f"{expr}*" if lo == 0 else f"{expr}{{{lo},}}"
        return "" if hi == 0 else f"{expr}{{{lo},{hi}}}"

    def _object(self, s: dict[str, Any]) -> str:
        props = s.get("properties") or {}
        if not isinstance(props, dict):
            raise GrammarError("'properties' must be an object")
        required = set(s.get("required") or [])
        extra = s.get("additionalProperties", not props)
        if not props:
            if extra is False:
                return self.rule('"{" ws "}"')
            value = "jvalue" if extra is True else self.value(extra)
            pair = f'jstring ws ":" ws {value}'
            return self.rule(f'"{{" ws ( {pair} ( ws "," ws {pair} )* )? ws "}}"')
        pairs = [(k, f'{lit(json.dumps(k, ensure_ascii=False))} ws ":" ws {self.value(v)}') for k, v in props.items()]
        # first_i: the properties from i on, the first one present without a comma; rest_i: each with one.
        rest = '""'
        first = '""'
        for key, pair in reversed(pairs):
            with_comma = f'ws "," ws {pair} {rest}'
            new_rest = self.rule(with_comma if key in required else f"{with_comma} | {rest}")
            new_first = self.rule(f"{pair} {rest}" if key in required else f"{pair} {rest} | {first}")
            rest, first = new_rest, new_first
        return self.rule(f'"{{" ws {first} ws "}}"')

    def text(self) -> str:
        return "\n".join(f"{name} ::= {body}" for name, body in self.rules.items() if body)


def _digits(x: str, y: str) -> list[str]:
    """EBNF sequences for the numbers from x to y, digit strings of one length (x <= y)."""
    n = len(x)
    if n == 1:
        return [f'"{x}"' if x == y else f"[{x}-{y}]"]
    if x[0] == y[0]:
        return [f'"{x[0]}" {p}' for p in _digits(x[1:], y[1:])]
    if x[1:] == "0" * (n - 1) and y[1:] == "9" * (n - 1):
        return [f"[{x[0]}-{y[0]}] [0-9]{{{n - 1}}}"]
    out = [f'"{x[0]}" {p}' for p in _digits(x[1:], "9" * (n - 1))]
    if int(x[0]) + 1 <= int(y[0]) - 1:
        out.append(f"[{int(x[0]) + 1}-{int(y[0]) - 1}] [0-9]{{{n - 1}}}")
    return out + [f'"{y[0]}" {p}' for p in _digits("0" * (n - 1), y[1:])]


def _nonneg(a: int, b: int | None) -> list[str]:
    """The numbers from a (>= 0) to b (None: no bound), without leading zeros: the partial lengths exactly, the
    whole lengths between them as one repetition (so the size does not grow with the digits)."""
    la = len(str(a))
    if b is not None and len(str(b)) == la:
        return _digits(str(a), str(b))
    out = _digits(str(a), "9" * la)
    if b is None:
        return [*out, f"[1-9] [0-9]{{{la},}}"]
    lb = len(str(b))
    if lb - la >= 2:
        out.append(f"[1-9] [0-9]{{{la},{lb - 2}}}")
    return out + _digits("1" + "0" * (lb - 1), str(b))


# Integer bounds with more digits than this are rounded outward to a whole number of digits (a bound of 1.2e300
# becomes "at most 301 digits"): the grammar then costs the same whatever the digits.
EXACT_DIGITS = 9


def _outward(bound: int | None, upper: bool) -> int | None:
    """`bound`, or for one with more than EXACT_DIGITS digits, the nearest whole-digit bound that contains it."""
    if bound is None or abs(bound) < 10**EXACT_DIGITS:
        return bound
    d = len(str(abs(bound)))
    widest, narrowest = int(10**d - 1), int(10 ** (d - 1))
    if bound > 0:
        return widest if upper else narrowest
    return -narrowest if upper else -widest


def int_range(lo: int | None, hi: int | None) -> list[str]:
    """EBNF alternatives for the integers in [lo, hi] (a None bound is open), bounds of many digits rounded
    outward (`_outward`)."""
    lo, hi = _outward(lo, upper=False), _outward(hi, upper=True)
    out = []
    if lo is None or lo < 0:  # the negative ones: "-" and their magnitude
        if hi is not None and hi < 0:
            mags = _nonneg(-hi, None if lo is None else -lo)
        else:
            mags = _nonneg(1, None if lo is None else -lo)
        out += [f'"-" {m}' for m in mags]
    if hi is None or hi >= 0:
        out += _nonneg(max(0, lo if lo is not None else 0), hi)
    return [f"( {x} )" for x in out]
