"""What one client may cost the server: the flags of the limits rust/limits declares (name, type, default, help:
`_native.LIMITS`), their checks, and the values handed back. `media_args` and `state_args` list theirs through
`add_declared`.

The defaults never refuse what the SDKs, agents and benchmarks send (the tests are the judge); each bounds something
a stranger controls: bytes, time, grammar work, connections, or output a client does not read.
"""

from __future__ import annotations

import argparse
import logging
import resource

from deepinfer_server._native import LIMITS, Limit, Limits
from deepinfer_server.grammar import GrammarLimits

log = logging.getLogger("deepinfer_server")

KIB = 1 << 10
# File descriptors kept for everything that is not a client connection: rings, the ranks' pipes, image fetches,
# logs, the tokenizer, Python's imports.
RESERVED_FDS = 256


# A flag's metavar, by the unit its limit counts.
METAVARS = {"bytes": "BYTES", "count": "N", "seconds": "SECONDS"}


def dest(limit: Limit) -> str:
    """The attribute argparse gives a settable limit's flag."""
    assert limit.flag is not None
    return limit.flag.removeprefix("--").replace("-", "_")


def add_declared(p: argparse._ArgumentGroup, group: str) -> None:
    """The flags of the limits declared (rust/limits) in `group`: their type, default and help are the
    declaration's. A `derived` default is None here, worked out in `resolve`."""
    for limit in LIMITS:
        if limit.flag is not None and limit.group == group:
            p.add_argument(
                limit.flag,
                type=type(limit.default),
                default=None if limit.derived else limit.default,
                metavar=METAVARS[limit.unit],
                help=limit.help,
            )


def add_arguments(p: argparse._ArgumentGroup) -> None:
    add_declared(p, "limits")


def resolve(args: argparse.Namespace) -> str | None:
    """Check the limits, and fill in --max-connections from the open-file limit; an error message, or None."""
    if args.max_request_body_bytes < 1024:
        return "--max-request-body-bytes must be at least 1024"
    if args.client_timeout <= 0:
        return "--client-timeout must be positive"
    if args.max_json_elements < 1000 or not 8 <= args.max_json_depth <= 127:
        return "--max-json-elements must be at least 1000 and --max-json-depth from 8 to 127"
    if args.max_batch_line_bytes is None:
        args.max_batch_line_bytes = args.max_request_body_bytes
    if args.max_batch_line_bytes < 1024:
        return "--max-batch-line-bytes must be at least 1024"
    if args.max_stream_buffer_bytes < 64 * KIB:
        return "--max-stream-buffer-bytes must be at least 65536"
    if args.max_grammar_bytes < 4 * KIB or args.grammar_cpu_seconds <= 0:
        return "--max-grammar-bytes must be at least 4096 and --grammar-cpu-seconds positive"
    if args.grammar_cache_bytes < args.max_grammar_bytes:
        return "--grammar-cache-bytes must be at least --max-grammar-bytes"
    if args.max_connections is not None and args.max_connections < 1:
        return "--max-connections must be at least 1"
    return None


def raise_open_file_limit() -> int:
    """Raise the soft open-file limit to the hard one, as vLLM and SGLang do at start (a host's common soft limit
    of 1,024 would stop `accept` at about a thousand connections); returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def max_connections(args: argparse.Namespace, open_files: int) -> int:
    """--max-connections, or what the open-file limit leaves for clients."""
    if args.max_connections is not None:
        if args.max_connections > open_files - RESERVED_FDS:
            log.warning(
                "--max-connections %d is more than the open-file limit %d allows (%d are kept for the server's "
                "own files): accept will fail before the limit is reached",
                args.max_connections,
                open_files,
                RESERVED_FDS,
            )
        return int(args.max_connections)
    return max(64, open_files - RESERVED_FDS)


def grammar_limits(args: argparse.Namespace) -> GrammarLimits:
    return GrammarLimits(args.max_grammar_bytes, args.grammar_cpu_seconds, args.grammar_cache_bytes)


def server_config(args: argparse.Namespace, open_files: int) -> Limits:
    """Every settable limit the Rust front end takes (`rust/limits`'s `Limits`), by its declared name."""
    values = {limit.name: getattr(args, dest(limit)) for limit in LIMITS if limit.flag is not None}
    values["max_connections"] = max_connections(args, open_files)
    return Limits(**values)
