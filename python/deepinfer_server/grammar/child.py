"""The grammar sandbox's child process (`python -m deepinfer_server.grammar.child PARENT_PID MAX_BYTES CPU_SECONDS
CACHE_BYTES`): reads `[schema_type, schema]` lines, answers `[grammar, error]` lines (grammar/sandbox.py). A
module of its own, which the package does not import, so that running it does not import it twice."""

from __future__ import annotations

import json
import resource
import sys

from deepinfer_server.grammar.base import GrammarLimits
from deepinfer_server.grammar.check import compile_checked
from deepinfer_server.grammar.sandbox import CHILD_ADDRESS_SPACE
from deepinfer_server.reaper import die_with_parent


def main() -> None:
    die_with_parent(int(sys.argv[1]))
    limits = GrammarLimits(int(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4]))
    resource.setrlimit(resource.RLIMIT_AS, (CHILD_ADDRESS_SPACE, CHILD_ADDRESS_SPACE))
    parser_limits = limits.parser_limits()
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        schema_type, schema = json.loads(line)
        out.write(json.dumps(list(compile_checked(schema_type, schema, limits, parser_limits))).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
