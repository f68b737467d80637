"""Structured output: deepseek-recipe's output constraint -> the grammar DeepInfer enforces, checked before admission.

deepseek-recipe turns `response_format`, strict tools and forced tool choices into `InferenceOptions.output_constraint`
(kinds `json`, `regex`, `tool_call`, `tool_call_required`); it enforces nothing. This module maps each one to
DeepInfer's `SamplingParams.so_args` (`schema_type` json, regex or ebnf, `schema`, `trigger_token_ids`), which the
engine compiles with xgrammar (`compile_json_schema(schema, strict_mode=True)`, `compile_regex`, `compile_grammar`):

* `json`: the schema as deepseek-recipe normalized it; a bare `json_object` ("" from deepseek-recipe) is any object.
* `regex`: the pattern.
* tool calls: an EBNF grammar of deepseek-recipe's DSML tool-call block (`tool_calls_ebnf`), one `invoke` per call
  with the tool's parameters; non-string values are JSON constrained by their schema (`_JsonEbnf`).

With thinking on, the grammar starts after `</think>` (the trigger), so the reasoning stays free. Before admission
the grammar is compiled with llguidance, with xgrammar's strict-mode semantics applied to the schema
(`strict_schema`): a malformed or unsupported grammar is a 400 naming the field, never a late engine failure.
Results are cached by grammar text in an LRU bounded in bytes. The simulated engine compiles the same so_args with
the same functions (`llguidance_grammar`), so what it honours is what DeepInfer is sent.

A client writes the schema, so grammar work is bounded (`GrammarLimits`): the text handed to the engine has a size
limit, checked while the tool-call grammar is built (it stops at the limit, not after it); building and checking
have a limit in CPU seconds; numeric bounds cost a constant whatever their digits (`_int_range`); and the EBNF goes
to llguidance through `ebnf_to_lark`, a linear rewrite of the dialect this module writes, not llguidance's general
GBNF parser (pure Python, about 2.5 µs per byte, with the GIL held).
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits

# so_args' schema_type names, as the ring codes them (rust/ring/records.rs SCHEMA_*).
SCHEMA_JSON, SCHEMA_REGEX, SCHEMA_EBNF = 1, 2, 3
SCHEMA_NAMES = {SCHEMA_JSON: "json", SCHEMA_REGEX: "regex", SCHEMA_EBNF: "ebnf"}

# `json_object`: any JSON object. xgrammar's strict mode would allow only `{}` for a bare {"type": "object"}.
ANY_OBJECT = '{"type":"object","additionalProperties":true}'

DSML = "｜DSML｜"
CALLS_OPEN = f"\n\n<{DSML} calls>\n"
CALLS_CLOSE = f"</{DSML} calls>"

# llguidance options closest to xgrammar's compile_json_schema: unknown keywords and formats are ignored (xgrammar
# warns and goes on), whitespace between tokens is free (any_whitespace=True).
_JSON_OPTIONS: Any = {"lenient": True}


class GrammarError(ValueError):
    """A grammar that cannot be compiled or is not supported; the message says why."""


class GrammarTooCostly(GrammarError):
    """A grammar over a limit (its size, or the CPU time to build and check it): the client's to simplify."""


@dataclass(frozen=True)
class GrammarLimits:
    """What one request's grammar may cost (`--max-grammar-bytes`, `--grammar-cpu-seconds`,
    `--grammar-cache-bytes`). The defaults fit OpenAI's own structured-output limits and 128 tools of ten
    parameters each (about 200 KB of EBNF, 0.1 s to build and check)."""

    max_bytes: int = 256 << 10
    cpu_seconds: float = 0.5
    cache_bytes: int = 32 << 20

    def parser_limits(self) -> LLParserLimits:
        # llguidance counts grammar symbols, not bytes: a byte of text is at most a symbol or so.
        return LLParserLimits(max_grammar_size=max(4096, 2 * self.max_bytes))


class _Budget:
    """The size and CPU-time budget of one grammar being built: charged as rules are written."""

    __slots__ = ("deadline", "limits", "used")

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        self.used = 0
        self.deadline = time.thread_time() + limits.cpu_seconds

    def charge(self, n: int) -> None:
        self.used += n
        if self.used > self.limits.max_bytes:
            raise GrammarTooCostly(
                f"the grammar is over {self.limits.max_bytes} bytes (the server's --max-grammar-bytes); "
                "use fewer or simpler tools or schemas"
            )
        if time.thread_time() > self.deadline:
            raise GrammarTooCostly(cpu_message(self.limits))


def cpu_message(limits: GrammarLimits) -> str:
    return (
        f"building and checking the grammar took over {limits.cpu_seconds:g} s of CPU (the server's "
        "--grammar-cpu-seconds); use fewer or simpler tools or schemas"
    )


@dataclass(frozen=True)
class Constraint:
    """One request's grammar, as the SUBMIT record carries it to the rank."""

    schema_type: int
    schema: str
    triggers: tuple[int, ...] = ()
    bound: int | None = None

    def record(self) -> tuple[int, str, list[int], int | None]:
        return self.schema_type, self.schema, list(self.triggers), self.bound


# -- xgrammar's strict mode, for llguidance ---------------------------------------------------------------------

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


# -- the DSML tool-call grammar ---------------------------------------------------------------------------------


def _lit(s: str) -> str:
    """An EBNF string literal (xgrammar's and GBNF's syntax)."""
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n").replace("\t", "\\t") + '"'


_JSON_BASE = r"""
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


class _JsonEbnf:
    """JSON values constrained by a JSON schema, as EBNF rules (the subset tool parameters use; see `unsupported`)."""

    def __init__(self, root: dict[str, Any], prefix: str, budget: _Budget) -> None:
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
            return _lit(json.dumps(s["const"], ensure_ascii=False))
        if "enum" in s:
            values = s["enum"]
            if not isinstance(values, list) or not values:
                raise GrammarError("'enum' must be a non-empty array")
            return self.rule(" | ".join(_lit(json.dumps(v, ensure_ascii=False)) for v in values))
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
        return self.rule(" | ".join(_int_range(lo, hi)))

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
        pairs = [(k, f'{_lit(json.dumps(k, ensure_ascii=False))} ws ":" ws {self.value(v)}') for k, v in props.items()]
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


def _int_range(lo: int | None, hi: int | None) -> list[str]:
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


def _is_string_schema(s: Any) -> bool:
    if not isinstance(s, dict):
        return False
    if s.get("type") == "string":
        return True
    values = s.get("enum")
    return isinstance(values, list) and bool(values) and all(isinstance(v, str) for v in values) and "type" not in s


def tool_calls_ebnf(
    tools: list[dict[str, Any]],
    prefix: str,
    parallel: bool = True,
    limits: GrammarLimits | None = None,
    free: Collection[str] = (),
) -> str:
    """EBNF for deepseek-recipe's DSML tool-call block: `prefix` (what the grammar still has to write of the
    block's opening), one or more `invoke`s of the given tools (one if not `parallel`), then the closing tag.

    A parameter whose schema is a string is raw text (`string="true"`, without `<` or `｜`); any other is JSON
    constrained by its schema (`string="false"`). Required parameters come in schema order, optional ones may be
    left out. The tools named in `free` (non-strict ones beside strict ones) keep their names but take any
    parameters. Raises GrammarTooCostly as soon as the text passes `limits.max_bytes` or its CPU time."""
    budget = _Budget(limits or GrammarLimits())
    calls, lines = _calls(tools, parallel, budget, free)
    root = f"root ::= {_lit(prefix) + ' ' if prefix else ''}{calls} {_lit(CALLS_CLOSE)}"
    budget.charge(len(root))
    return "\n".join([root, *lines, _base(free)])


def answer_or_calls_ebnf(
    schema: str | None,
    tools: list[dict[str, Any]],
    parallel: bool = True,
    limits: GrammarLimits | None = None,
    free: Collection[str] = (),
) -> str:
    """EBNF for an output that is either an answer in the JSON `schema` (None: any JSON object), in xgrammar's strict
    mode, or a whole DSML tool-call block (`tool_calls_ebnf`): structured output beside tools, with `tool_choice`
    auto, as OpenAI serves it. The answer's schema is written as tool parameters are (`_JsonEbnf`)."""
    budget = _Budget(limits or GrammarLimits())
    if schema is None:
        answer, answer_rules = "jobject", ""
    else:
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
        conv = _JsonEbnf(parsed, "answer_", budget)
        answer, answer_rules = conv.value(parsed), conv.text()
    calls, lines = _calls(tools, parallel, budget, free)
    root = f"root ::= {answer} | {_lit(CALLS_OPEN)} {calls} {_lit(CALLS_CLOSE)}"
    budget.charge(len(root))
    return "\n".join([root, *([answer_rules] if answer_rules else []), *lines, _base(free)])


# Parameters of a tool called freely: any name, either kind, any value up to the closing tag.
_FREE_PARAM_OPEN = _lit(f'<{DSML} parameter name="')
_FREE_PARAM_KIND = _lit('" string="') + ' ( "true" | "false" ) ' + _lit('">')
_FREE_PARAM_CLOSE = _lit(f"</{DSML} parameter>\n")
_FREE_BASE = f"""
freeparam ::= {_FREE_PARAM_OPEN} [^"<｜]+ {_FREE_PARAM_KIND} freevalue {_FREE_PARAM_CLOSE}
freevalue ::= ( [^<] | "<" [^/] )*
"""


def _base(free: Collection[str]) -> str:
    return (_JSON_BASE + (_FREE_BASE if free else "")).strip()


def _calls(
    tools: list[dict[str, Any]], parallel: bool, budget: _Budget, free: Collection[str]
) -> tuple[str, list[str]]:
    """One or more invokes of `tools` (one if not `parallel`), and the rules they use."""
    budget.charge(len(_JSON_BASE) + (len(_FREE_BASE) if free else 0))
    invokes: list[str] = []
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        name = str(fn.get("name", ""))
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise GrammarError(f"the parameters of tool {name!r} are not a schema object")
        rule = f"invoke{len(invokes)}"
        head = _lit(f'<{DSML} invoke name="{name}">\n')
        tail = _lit(f"</{DSML} invoke>" + chr(10))
        budget.charge(len(head) + len(tail) + 40)
        invokes.append(rule)
        if name in free:
            lines.append(f"{rule} ::= {head} freeparam* {tail}")
            continue
        conv = _JsonEbnf(params, f"{rule}_", budget)
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for key, sub in props.items():
            if _is_string_schema(sub):
                values = sub.get("enum")
                value = " | ".join(_lit(v) for v in values) if values else "rawtext"
                flag = "true"
            else:
                value, flag = conv.value(sub), "false"
            open_tag = f'<{DSML} parameter name="{key}" string="{flag}">'
            part = f"{_lit(open_tag)} ( {value} ) {_lit(f'</{DSML} parameter>' + chr(10))}"
            budget.charge(len(part) + 6)
            parts.append(part if key in required else f"( {part} )?")
        lines.append(f"{rule} ::= {head} {' '.join(parts)} {tail}")
        body = conv.text()
        if body:
            lines.append(body)
    if not invokes:
        raise GrammarError("a forced tool call needs at least one tool")
    one = " | ".join(invokes)
    return (f"( {one} )+" if parallel else f"( {one} )"), lines


# -- from this module's EBNF to llguidance's Lark ----------------------------------------------------------------

# One rule per line, `name ::= body`, as `tool_calls_ebnf` writes them (and `#` comment lines).
_EBNF_RULE = re.compile(r"([a-z][a-z0-9_]*) ::= (.*)")
# A body's pieces: a string literal, a character class, a rule name, or anything else (operators, parentheses,
# repetition counts, spaces).
_EBNF_PIECE = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[a-z][a-z0-9_]*|[^"\[a-z]+')


def ebnf_to_lark(ebnf: str) -> str:
    """The Lark grammar (llguidance's syntax) of an EBNF grammar, in one linear pass for the dialect
    `tool_calls_ebnf` writes, else through llguidance's general GBNF converter. As that converter does, `root`
    becomes `start`, a character class a regex, and a rule built only of literals, classes and such rules a
    terminal (upper case: one lexeme)."""
    rules: dict[str, list[str]] = {}
    for line in ebnf.split("\n"):
        if not line.strip() or line.startswith("#"):
            continue
        m = _EBNF_RULE.fullmatch(line)
        if m is None or m.group(1) in rules:
            return str(llguidance.grammar_from("ebnf", ebnf))
        pieces = _EBNF_PIECE.findall(m.group(2))
        if "".join(pieces) != m.group(2):
            return str(llguidance.grammar_from("ebnf", ebnf))
        rules[m.group(1)] = pieces
    if "root" not in rules:
        return str(llguidance.grammar_from("ebnf", ebnf))
    refs = {name: {p for p in pieces if p[0].isalpha()} for name, pieces in rules.items()}
    if any(not r <= rules.keys() for r in refs.values()):
        return str(llguidance.grammar_from("ebnf", ebnf))
    terminal: set[str] = set()
    changed = True
    while changed:
        changed = False
        for name, r in refs.items():
            if name != "root" and name not in terminal and r <= terminal:
                terminal.add(name)
                changed = True
    rename = {name: "start" if name == "root" else name.upper() if name in terminal else name for name in rules}
    out = ["%llguidance {}", ""]
    for name, pieces in rules.items():
        body = "".join(rename[p] if p[0].isalpha() else _lark_class(p) if p[0] == "[" else p for p in pieces)
        out.append(f"{rename[name]}: {body}")
    return "\n".join(out) + "\n"


def _lark_class(cls: str) -> str:
    """An EBNF character class as a Lark regex: `/` and an inner `[` escaped, escapes kept."""
    out, i = ["/["], 1
    while i < len(cls) - 1:
        c = cls[i]
        if c == "\\":
            out.append(cls[i : i + 2])
            i += 2
            continue
        out.append("\\" + c if c in "/[" else c)
        i += 1
    out.append("]/")
    return "".join(out)


# -- compiling, with a bounded cache -----------------------------------------------------------------------------


def llguidance_grammar(schema_type: str, schema: str) -> str:
    """The llguidance grammar for DeepInfer's so_args (json with xgrammar's strict mode, regex, or ebnf)."""
    if schema_type == "json":
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
        if not isinstance(parsed, (dict, bool)):
            raise GrammarError("a JSON schema must be an object or a boolean")
        return LLMatcher.grammar_from_json_schema(json.dumps(strict_schema(parsed)), _JSON_OPTIONS)
    if schema_type == "regex":
        return LLMatcher.grammar_from_regex(schema)
    if schema_type == "ebnf":
        try:
            return ebnf_to_lark(schema)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    raise GrammarError(f"unsupported schema_type {schema_type!r}")


class GrammarCache:
    """Checked grammars by (schema_type, schema): the llguidance grammar, or why it failed. An LRU bounded in
    bytes (`limits.cache_bytes`); a grammar over `limits.max_bytes` is refused before any work."""

    def __init__(self, limits: GrammarLimits | None = None) -> None:
        self.limits = limits or GrammarLimits()
        self.parser_limits = self.limits.parser_limits()
        self.entries: OrderedDict[tuple[str, str], tuple[str | None, str | None]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()
        self.hits = self.misses = 0

    def check(self, schema_type: str, schema: str) -> str:
        """The compiled grammar; raises GrammarError (cached too) for one that fails."""
        size = len(schema.encode())
        if size > self.limits.max_bytes:
            raise GrammarTooCostly(
                f"the grammar is {size} bytes; this server takes at most {self.limits.max_bytes} (--max-grammar-bytes)"
            )
        key = (schema_type, schema)
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
                self.hits += 1
        if hit is None:
            self.misses += 1
            hit = self._compile(schema_type, schema)
            self._store(key, hit)
        grammar, error = hit
        if error is not None:
            raise GrammarError(error)
        assert grammar is not None
        return grammar

    def _compile(self, schema_type: str, schema: str) -> tuple[str | None, str | None]:
        """(grammar, None) or (None, why), within the CPU-time limit (a grammar past it is refused)."""
        started = time.thread_time()
        try:
            grammar = llguidance_grammar(schema_type, schema)
            is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=self.parser_limits)
        except ValueError as e:  # GrammarError included
            return None, str(e)
        if is_error:
            return None, _first_line(messages[0] if messages else "invalid grammar")
        if time.thread_time() - started > self.limits.cpu_seconds:
            return None, cpu_message(self.limits)
        return grammar, None

    def _store(self, key: tuple[str, str], hit: tuple[str | None, str | None]) -> None:
        cost = _entry_bytes(key, hit)
        if cost > self.limits.cache_bytes:
            return
        with self.lock:
            if key in self.entries:
                return
            self.entries[key] = hit
            self.bytes += cost
            while self.bytes > self.limits.cache_bytes:
                old_key, old = self.entries.popitem(last=False)
                self.bytes -= _entry_bytes(old_key, old)


def _entry_bytes(key: tuple[str, str], hit: tuple[str | None, str | None]) -> int:
    """What an entry holds: its key's text and its grammar or error (Python strings, about a byte a character)."""
    return 128 + len(key[1]) + len(hit[0] or "") + len(hit[1] or "")


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip() and not ln.strip().startswith("^")]
    return " ".join(lines[:3])[:500]
