"""Grammars compiled and checked with llguidance, as the engine would compile them with xgrammar: this module's EBNF
through `ebnf_to_lark` (a linear rewrite, not llguidance's general GBNF parser), JSON schemas in xgrammar's strict
mode, regexes (`compile_checked`, which the sandbox's child runs)."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import llguidance
from llguidance import LLMatcher, LLParserLimits

from deepinfer_server.grammar.base import GrammarError, GrammarLimits, cpu_message
from deepinfer_server.grammar.schemas import integer_bound_problem, strict_schema

# llguidance options closest to xgrammar's compile_json_schema: unknown keywords and formats are ignored (xgrammar
# warns and goes on), whitespace between tokens is free (any_whitespace=True).
_JSON_OPTIONS: Any = {"lenient": True}

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
        if problem := integer_bound_problem(parsed):
            raise GrammarError(problem)
        return LLMatcher.grammar_from_json_schema(json.dumps(strict_schema(parsed)), _JSON_OPTIONS)
    if schema_type == "regex":
        return LLMatcher.grammar_from_regex(schema)
    if schema_type == "ebnf":
        try:
            return ebnf_to_lark(schema)
        except ValueError as e:
            raise GrammarError(str(e)) from None
    raise GrammarError(f"unsupported schema_type {schema_type!r}")


def compile_checked(
    schema_type: str, schema: str, limits: GrammarLimits, parser_limits: LLParserLimits
) -> tuple[str | None, str | None]:
    """(grammar, None) or (None, why), within the CPU-time limit (a grammar past it is refused)."""
    started = time.thread_time()
    try:
        grammar = llguidance_grammar(schema_type, schema)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, limits=parser_limits)
    except ValueError as e:  # GrammarError included
        return None, str(e)
    if is_error:
        return None, _first_line(messages[0] if messages else "invalid grammar")
    if time.thread_time() - started > limits.cpu_seconds:
        return None, cpu_message(limits)
    return grammar, None


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip() and not ln.strip().startswith("^")]
    return " ".join(lines[:3])[:500]
