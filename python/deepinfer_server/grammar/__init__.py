"""Structured output: deepseek-recipe's output constraint -> the grammar DeepInfer enforces, checked before admission.

deepseek-recipe turns `response_format`, strict tools and forced tool choices into `InferenceOptions.output_constraint`
(kinds `json`, `regex`, `tool_call`, `tool_call_required`); it enforces nothing. This package maps each one to
DeepInfer's `SamplingParams.so_args` (`schema_type` json, regex or ebnf, `schema`, `trigger_token_ids`), which the
engine compiles with xgrammar (`compile_json_schema(schema, strict_mode=True)`, `compile_regex`, `compile_grammar`):

* `json`: the schema as deepseek-recipe normalized it; a bare `json_object` ("" from deepseek-recipe) is any object.
* `regex`: the pattern.
* tool calls: an EBNF grammar of deepseek-recipe's DSML tool-call block (`tool_calls_ebnf`), one `invoke` per call
  with the tool's parameters; non-string values are JSON constrained by their schema (`json_ebnf`).

With thinking on, the grammar starts after `</think>` (the trigger), so the reasoning stays free. Before admission
the grammar is compiled with llguidance, with xgrammar's strict-mode semantics applied to the schema
(`strict_schema`): a malformed or unsupported grammar is a 400 naming the field, never a late engine failure.
Results are cached by grammar text in an LRU bounded in bytes. The simulated engine compiles the same so_args with
the same functions (`llguidance_grammar`), so what it honours is what DeepInfer is sent.

A client writes the schema, so grammar work is bounded (`GrammarLimits`): the text handed to the engine has a size
limit, checked while the tool-call grammar is built (it stops at the limit, not after it); building and checking
have a limit in CPU seconds; numeric bounds cost a constant whatever their digits (`int_range`); and the EBNF goes
to llguidance through `ebnf_to_lark`, a linear rewrite of the dialect this package writes, not llguidance's general
GBNF parser (pure Python, about 2.5 µs per byte, with the GIL held).

llguidance is native code, so the server checks a client's grammar in a child process (`sandbox`): one that
crashes it or runs past the wall limit is a 400 for that request, and the child is replaced.

Its parts: `base` (schema types, errors, limits), `schemas` (strict mode, Anthropic's limits, integer bounds),
`json_ebnf` and `tool_calls` (the EBNF it writes), `check` (compiling with llguidance), `cache` (checked grammars),
`sandbox` and `child` (the child process the server's checks run in). Which grammar a request gets is
request_grammar.py's business.
"""

from deepinfer_server.grammar.base import (
    ANY_OBJECT,
    CALLS_CLOSE,
    CALLS_OPEN,
    SCHEMA_EBNF,
    SCHEMA_JSON,
    SCHEMA_NAMES,
    SCHEMA_REGEX,
    Constraint,
    GrammarError,
    GrammarLimits,
    GrammarTooCostly,
)
from deepinfer_server.grammar.cache import GrammarCache
from deepinfer_server.grammar.check import ebnf_to_lark, llguidance_grammar
from deepinfer_server.grammar.schemas import anthropic_schema_problem, strict_schema
from deepinfer_server.grammar.tool_calls import answer_or_calls_ebnf, tool_calls_ebnf
from deepinfer_server.vocabulary import DSML

__all__ = [
    "ANY_OBJECT",
    "CALLS_CLOSE",
    "CALLS_OPEN",
    "DSML",
    "SCHEMA_EBNF",
    "SCHEMA_JSON",
    "SCHEMA_NAMES",
    "SCHEMA_REGEX",
    "Constraint",
    "GrammarCache",
    "GrammarError",
    "GrammarLimits",
    "GrammarTooCostly",
    "answer_or_calls_ebnf",
    "anthropic_schema_problem",
    "ebnf_to_lark",
    "llguidance_grammar",
    "strict_schema",
    "tool_calls_ebnf",
]
