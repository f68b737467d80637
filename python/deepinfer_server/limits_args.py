"""What one client may cost the server: every limit a request or a connection can hit, with its flag, its default
and its check, in one place. Media limits are in `media_args`; the rest are here.

The defaults never refuse what the SDKs, agents and benchmarks send (the tests are the judge); each bounds something
a stranger controls: bytes, time, grammar work, connections, or output a client does not read.
"""

from __future__ import annotations

import argparse
import logging
import resource
from typing import Any

from deepinfer_server.grammar import GrammarLimits

log = logging.getLogger("deepinfer_server")

KIB, MIB = 1 << 10, 1 << 20
# File descriptors kept for everything that is not a client connection: rings, the ranks' pipes, image fetches,
# logs, the tokenizer, Python's imports.
RESERVED_FDS = 256


def add_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--max-request-body-bytes", type=int, default=16 * MIB, help="Largest request body; a larger one gets 413."
    )
    p.add_argument(
        "--max-json-elements",
        type=int,
        default=2_000_000,
        help="Most values a JSON request body (or a batch line) may hold, at any depth, unknown keys included; "
        "past it a 413, decided in one pass over the bytes before anything is built from them. The default is "
        "more than any body of real requests within 16 MiB holds (a Message Batch of 100,000 two-turn requests "
        "is about 1.3 million) and refuses a body of millions of bare values, which costs 50 bytes each to hold.",
    )
    p.add_argument(
        "--max-json-depth",
        type=int,
        default=64,
        help="Deepest a JSON request body (or a batch line) may nest, at most 127 (the parser's own limit is "
        "128); deeper is a 400. Tool schemas and transcripts nest a dozen levels.",
    )
    p.add_argument(
        "--max-batch-line-bytes",
        type=int,
        default=None,
        help="Longest line of a batch's input file (a line is one request). A purpose=batch upload with a longer "
        "line is a 400 naming it, as is a batch created on such a file; the runner never reads more of one line. "
        "Default: --max-request-body-bytes, as one request's body is bounded when it is sent alone.",
    )
    p.add_argument(
        "--client-timeout",
        type=float,
        default=30.0,
        help="Seconds a client has to send a request's headers, and again its body (each a total deadline, not "
        "reset by every byte: 408 for a body), to leave a keep-alive connection idle, and to take 16 KiB of a "
        "response it is being sent; past it the connection is closed.",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="Client connections open at once; past it new ones wait in the listen backlog until one closes. "
        "Default: the open-file limit (raised to its hard limit at start) less 256 kept for the server's own files.",
    )
    p.add_argument(
        "--max-stream-buffer-bytes",
        type=int,
        default=1 * MIB,
        help="Bytes of one response the server holds for a client that reads slower than they are made; a client "
        "further behind is disconnected and its request aborted. Bounds what a slow reader can hold, whatever "
        "its max_tokens and top_logprobs.",
    )
    p.add_argument(
        "--max-grammar-bytes",
        type=int,
        default=GrammarLimits.max_bytes,
        help="Largest grammar (JSON schema, regex, or the tool-call grammar the server writes) handed to the "
        "engine for one request; a larger one is a 400 naming the field, decided before any work on it.",
    )
    p.add_argument(
        "--grammar-cpu-seconds",
        type=float,
        default=GrammarLimits.cpu_seconds,
        help="CPU time building a request's grammar, and again checking it, may take; past it the request is a "
        "400 naming the field. Grammars are built and checked on a thread of their own, never the codec's.",
    )
    p.add_argument(
        "--grammar-cache-bytes",
        type=int,
        default=GrammarLimits.cache_bytes,
        help="Memory for checked grammars, reused by requests that send the same schema or tools (LRU).",
    )


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


def server_config(args: argparse.Namespace, open_files: int) -> dict[str, Any]:
    """The limits the Rust front end enforces (rust/config.rs)."""
    return {
        "max_body_bytes": args.max_request_body_bytes,
        "max_json_elements": args.max_json_elements,
        "max_json_depth": args.max_json_depth,
        "max_batch_line_bytes": args.max_batch_line_bytes,
        "client_timeout_s": args.client_timeout,
        "max_connections": max_connections(args, open_files),
        "max_stream_buffer_bytes": args.max_stream_buffer_bytes,
    }
