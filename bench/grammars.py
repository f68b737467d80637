#!/usr/bin/env python3
"""Grammar check + compile latency, cold and cached, on a set of real-world schemas: what the codec does before
admission (`deepinfer_server.grammar.GrammarCache.check`: llguidance, xgrammar's strict mode), and what the sim
does per request (an `LLMatcher` over its tokenizer: cold = compile, cached = a copy of the compiled one).

Cold: each run gets a schema no cache has seen (a fresh `title`). Cached: the same schema again. The server's
check runs in the grammar sandbox's child process; "in process" is the same check without it (what it cost
before the sandbox), measured in the same rounds.

    python bench/grammars.py [--runs 200] [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from deepinfer_server.engine.constrained import SimGrammars
from deepinfer_server.engine.sampling import Spelling
from deepinfer_server.grammar import GrammarCache, tool_calls_ebnf
from deepinfer_server.launcher import BUNDLED_TOKENIZER
from deepinfer_server.vocabulary import Vocabulary

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[^@\\s]+@[^@\\s]+\\.[a-z]{2,}$"},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "manager": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["name", "age", "email", "role", "manager"],
    "additionalProperties": False,
}
INVOICE = {
    "type": "object",
    "$defs": {
        "line": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number", "minimum": 0},
            },
            "required": ["sku", "qty", "price"],
            "additionalProperties": False,
        },
        "address": {
            "type": "object",
            "properties": {k: {"type": "string"} for k in ("street", "city", "zip", "country")},
            "required": ["street", "city", "zip", "country"],
            "additionalProperties": False,
        },
    },
    "properties": {
        "number": {"type": "string"},
        "date": {"type": "string", "format": "date"},
        "bill_to": {"$ref": "#/$defs/address"},
        "ship_to": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
        "lines": {"type": "array", "items": {"$ref": "#/$defs/line"}, "minItems": 1, "maxItems": 50},
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
        "notes": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
    },
    "required": ["number", "date", "bill_to", "ship_to", "lines", "currency", "notes"],
    "additionalProperties": False,
}
ISSUE = {  # a GitHub-issue-like record with nested arrays of objects
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 120},
        "labels": {"type": "array", "items": {"type": "string", "enum": ["bug", "feature", "docs", "question"]}},
        "assignees": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"login": {"type": "string"}, "id": {"type": "integer"}},
                "required": ["login", "id"],
                "additionalProperties": False,
            },
        },
        "milestone": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"title": {"type": "string"}, "due": {"type": "string", "format": "date-time"}},
                    "required": ["title", "due"],
                    "additionalProperties": False,
                },
                {"type": "null"},
            ]
        },
        "state": {"type": "string", "enum": ["open", "closed"]},
        "comments": {"type": "integer", "minimum": 0},
    },
    "required": ["title", "labels", "assignees", "milestone", "state", "comments"],
    "additionalProperties": False,
}
TOOLS = [  # an agent's tool set: what a forced tool call compiles (EBNF of the DSML block)
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 14},
                },
                "required": ["city", "unit", "days"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_web",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string"},
                    "max_results": {"type": "integer"},
                    "sites": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
                },
                "required": ["query", "max_results", "sites"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "create_event",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "start": {"type": "string"},
                    "attendees": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "properties": {"email": {"type": "string"}, "optional": {"type": "boolean"}},
                            "required": ["email", "optional"],
                            "additionalProperties": False,
                        },
                    },
                },
                "required": ["title", "start", "attendees"],
                "additionalProperties": False,
            },
        },
    },
]


def cases(fresh: int) -> dict[str, tuple[str, str]]:
    """(schema_type, text) per case; `fresh` makes each text one no cache has seen."""

    def js(schema: dict[str, Any]) -> str:
        return json.dumps({**schema, "title": f"t{fresh}"}, separators=(",", ":"))

    tools = [{**t, "function": {**t["function"], "description": f"d{fresh}"}} for t in TOOLS]
    return {
        "person (json)": ("json", js(PERSON)),
        "invoice, $defs (json)": ("json", js(INVOICE)),
        "issue, nested (json)": ("json", js(ISSUE)),
        "json_object": ("json", json.dumps({"type": "object", "additionalProperties": True, "title": f"t{fresh}"})),
        "regex": ("regex", f"(yes|no): [a-z ]{{5,40}}\\. ref-{fresh}"),
        "3 tools, forced (ebnf)": ("ebnf", tool_calls_ebnf(tools, "\n\n<｜DSML｜ calls>\n") + f"\n# {fresh}"),
    }


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--tokenizer", default=str(BUNDLED_TOKENIZER))
    args = ap.parse_args()
    vocab = Vocabulary.load(args.tokenizer)
    sim = SimGrammars(args.tokenizer, vocab.eos_id, Spelling(vocab))
    print(f"tokenizer {args.tokenizer}: {sim.tokenizer.vocab_size} tokens; {args.runs} runs per figure, in ms")
    print(
        "| schema | check cold p50 | p99 | in process p50 | p99 | check cached p50 | p99 | sim compile cold p50 | p99 "
        "| sim cached p50 | p99 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    names = list(cases(0))
    for name in names:
        check_cold, in_process, check_hot, sim_cold, sim_hot = [], [], [], [], []
        cache, local = GrammarCache(), GrammarCache(isolated=False)
        for i in range(args.runs):
            kind, text = cases(i + 1)[name]
            t = time.perf_counter()
            local.check(kind, text)
            in_process.append(time.perf_counter() - t)
            t0 = time.perf_counter()
            cache.check(kind, text)
            t1 = time.perf_counter()
            cache.check(kind, text)
            t2 = time.perf_counter()
            m = sim.compile({"schema_type": kind, "schema": text})
            t3 = time.perf_counter()
            m2 = sim.compile({"schema_type": kind, "schema": text})
            t4 = time.perf_counter()
            assert not isinstance(m, str) and not isinstance(m2, str), m
            check_cold.append(t1 - t0)
            check_hot.append(t2 - t1)
            sim_cold.append(t3 - t2)
            sim_hot.append(t4 - t3)
        figures = (check_cold, in_process, check_hot, sim_cold, sim_hot)
        cells = [f"{pct(xs, p) * 1000:.3f}" for xs in figures for p in (50, 99)]
        print(f"| {name} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
