"""EBNF grammars of deepseek-recipe's DSML tool-call block (`tool_calls_ebnf`), and of an answer in a JSON schema or
such a block (`answer_or_calls_ebnf`): one `invoke` per call with the tool's parameters, string parameters as raw
text and the others as JSON constrained by their schema."""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Any

from deepinfer_server.grammar.base import CALLS_CLOSE, CALLS_OPEN, Budget, GrammarError, GrammarLimits
from deepinfer_server.grammar.json_ebnf import JSON_BASE, JsonEbnf, lit
from deepinfer_server.vocabulary import DSML


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
    budget = Budget(limits or GrammarLimits())
    calls, lines = _calls(tools, parallel, budget, free)
    root = f"root ::= {lit(prefix) + ' ' if prefix else ''}{calls} {lit(CALLS_CLOSE)}"
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
    auto, as OpenAI serves it. The answer's schema is written as tool parameters are (`JsonEbnf`)."""
    budget = Budget(limits or GrammarLimits())
    if schema is None:
        answer, answer_rules = "jobject", ""
    else:
        try:
            parsed = json.loads(schema)
        except ValueError as e:
            raise GrammarError(f"the schema is not valid JSON: {e}") from None
        conv = JsonEbnf(parsed, "answer_", budget)
        answer, answer_rules = conv.value(parsed), conv.text()
    calls, lines = _calls(tools, parallel, budget, free)
    root = f"root ::= {answer} | {lit(CALLS_OPEN)} {calls} {lit(CALLS_CLOSE)}"
    budget.charge(len(root))
    return "\n".join([root, *([answer_rules] if answer_rules else []), *lines, _base(free)])


# Parameters of a tool called freely: any name, either kind, any value up to the closing tag.
_FREE_PARAM_OPEN = lit(f'<{DSML} parameter name="')
_FREE_PARAM_KIND = lit('" string="') + ' ( "true" | "false" ) ' + lit('">')
_FREE_PARAM_CLOSE = lit(f"</{DSML} parameter>\n")
_FREE_BASE = f"""
freeparam ::= {_FREE_PARAM_OPEN} [^"<｜]+ {_FREE_PARAM_KIND} freevalue {_FREE_PARAM_CLOSE}
freevalue ::= ( [^<] | "<" [^/] )*
"""


def _base(free: Collection[str]) -> str:
    return (JSON_BASE + (_FREE_BASE if free else "")).strip()


def _calls(tools: list[dict[str, Any]], parallel: bool, budget: Budget, free: Collection[str]) -> tuple[str, list[str]]:
    """One or more invokes of `tools` (one if not `parallel`), and the rules they use."""
    budget.charge(len(JSON_BASE) + (len(_FREE_BASE) if free else 0))
    invokes: list[str] = []
    lines = []
    for tool in tools:
        fn = tool.get("function", tool)
        name = str(fn.get("name", ""))
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise GrammarError(f"the parameters of tool {name!r} are not a schema object")
        rule = f"invoke{len(invokes)}"
        head = lit(f'<{DSML} invoke name="{name}">\n')
        tail = lit(f"</{DSML} invoke>" + chr(10))
        budget.charge(len(head) + len(tail) + 40)
        invokes.append(rule)
        if name in free:
            lines.append(f"{rule} ::= {head} freeparam* {tail}")
            continue
        conv = JsonEbnf(params, f"{rule}_", budget)
        props = params.get("properties") or {}
        required = set(params.get("required") or [])
        parts = []
        for key, sub in props.items():
            if _is_string_schema(sub):
                values = sub.get("enum")
                value = " | ".join(lit(v) for v in values) if values else "rawtext"
                flag = "true"
            else:
                value, flag = conv.value(sub), "false"
            open_tag = f'<{DSML} parameter name="{key}" string="{flag}">'
            part = f"{lit(open_tag)} ( {value} ) {lit(f'</{DSML} parameter>' + chr(10))}"
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
