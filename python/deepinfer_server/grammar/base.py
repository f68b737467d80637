"""What every part of the grammar work shares: so_args' schema types, the DSML markup the tool-call grammars write,
the errors, and the limits a client's grammar is held to (`GrammarLimits`, charged as it is built by a `Budget`)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from llguidance import LLParserLimits

from deepinfer_server import _native
from deepinfer_server.vocabulary import DSML

# so_args' schema_type names, as the ring codes them (rust/ring/records.rs SCHEMA_*).
SCHEMA_JSON, SCHEMA_REGEX, SCHEMA_EBNF = 1, 2, 3
SCHEMA_NAMES = {SCHEMA_JSON: "json", SCHEMA_REGEX: "regex", SCHEMA_EBNF: "ebnf"}

# `json_object`: any JSON object. xgrammar's strict mode would allow only `{}` for a bare {"type": "object"}.
ANY_OBJECT = '{"type":"object","additionalProperties":true}'

CALLS_OPEN = f"\n\n<{DSML} calls>\n"
CALLS_CLOSE = f"</{DSML} calls>"


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


class Budget:
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

    def record(self) -> _native.SubmitConstraint:
        return _native.SubmitConstraint(
            schema_type=self.schema_type, schema=self.schema, triggers=list(self.triggers), bound=self.bound
        )
