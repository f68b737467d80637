"""`deepinfer-server` command line: parse and check arguments, then hand over to the launcher."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from deepinfer_server import __version__, edge_args, limits_args, media_args, state_args, trace_args
from deepinfer_server._native import TIMING_DEFAULTS
from deepinfer_server.engine import sim_config
from deepinfer_server.engine.registry import ENGINES, Stepping
from deepinfer_server.prompt_encoder import CHOICES as PROMPT_ENCODERS

API_KEY_ENV = "DEEPINFER_SERVER_API_KEY"

# --dispatch-gather-ms when the ranks step together (rust/timing.rs, where every timing default is declared).
DEFAULT_GATHER_MS = TIMING_DEFAULTS["--dispatch-gather-ms"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="deepinfer-server",
        description="OpenAI-compatible Chat Completions server for DeepSeek's DeepInfer engine.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="Hugging Face checkpoint directory or repo id. Optional with --engine sim (then the bundled "
        "DeepSeek-V4.1 special-token tokenizer is used).",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="Model name(s) clients use, each listed in /v1/models. NAME=thinking or NAME=no-thinking pins that "
        "name's thinking mode whatever the request asks, as DeepSeek's deepseek-reasoner and deepseek-chat do "
        "(e.g. --served-model-name deepseek-v4.1-flash deepseek-chat=no-thinking deepseek-reasoner=thinking).",
    )
    p.add_argument(
        "--default-thinking",
        choices=["on", "off"],
        default="on",
        help="Thinking mode of a request that does not choose one (deepseek-recipe's default_thinking_mode): off "
        "serves clients that cannot send 'thinking' and read only 'content' (default: on).",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument(
        "--prefill-attempt-interval",
        type=int,
        default=None,
        help="DeepInfer: decode steps between prefill votes that need every DP rank to want a prefill "
        "(DEEPINFER_PREFILL_ATTEMPT_INTERVAL; default: that variable, else 1).",
    )
    p.add_argument(
        "--prefill-any-attempt-interval",
        type=int,
        default=None,
        help="DeepInfer: decode steps between prefill votes that one DP rank's waiting prompt wins; a lone "
        "request waits up to this many steps (DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL; default: that variable, else 1).",
    )
    p.add_argument(
        "--disable-log-stats",
        action="store_true",
        help="DeepInfer: turn off the engine's own periodic stats log (throughput, KV usage, acceptance), as vLLM's.",
    )
    p.add_argument("--expert-parallel-size", "--ep", dest="expert_parallel_size", type=int, default=None)
    p.add_argument("--data-parallel-size", "--dp", dest="data_parallel_size", type=int, default=None)
    p.add_argument("--context-parallel-size", "--cp", dest="context_parallel_size", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=32768, help="Context length (prompt + completion).")
    p.add_argument("--max-num-seqs", type=int, default=16, help="Running sequences per data-parallel rank.")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="Tokens per engine step per rank.")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--startup-timeout", type=float, default=3600.0, help="Seconds for every rank to become ready.")
    p.add_argument(
        "--exit-on-rank-failure",
        type=float,
        default=TIMING_DEFAULTS["--exit-on-rank-failure"],
        help="Seconds between a rank failure (health turns 503 at once) and exiting with status 1.",
    )
    p.add_argument(
        "--sse-keep-alive",
        type=float,
        default=TIMING_DEFAULTS["--sse-keep-alive"],
        help="Seconds of silence before an SSE keep-alive comment.",
    )
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=TIMING_DEFAULTS["--stream-interval-ms"],
        help="Shortest gap between two token events of one stream; tokens that come sooner leave together in the "
        "next event (fewer, fuller writes when the engine outpaces the client). Below the engine's step time it "
        "never delays a token. 0 sends tokens as they come.",
    )
    p.add_argument(
        "--malloc",
        default="auto",
        choices=("auto", "mimalloc", "system"),
        help="Memory allocator: auto preloads mimalloc when the system has it (libmimalloc2.0), else glibc's.",
    )
    p.add_argument(
        "--max-num-partial-prefills",
        type=int,
        default=0,
        help="Requests of one data-parallel rank in prefill at once; the rest wait in the rank, first come first "
        "served, before the engine sees them (vLLM's flag). A burst of long prompts then gets its first tokens one "
        "after another instead of all at the end, and running streams keep short steps. 0: no limit, every "
        "admitted prompt is handed to the engine at once.",
    )
    p.add_argument(
        "--max-long-partial-prefills",
        type=int,
        default=2,
        help="Like --max-num-partial-prefills, for prompts of --long-prefill-token-threshold tokens or more only "
        "(vLLM's flag): shorter prompts pass them and are never held. A burst of long prompts then gets its first "
        "tokens two by two instead of all at the end of their prefills. 0: no limit.",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=4096,
        help="Prompt tokens from which --max-long-partial-prefills counts a prompt as long.",
    )
    p.add_argument(
        "--dispatch-gather-ms",
        type=float,
        default=None,
        help="How long a long prompt waits, once encoded, for other long prompts to go to the ranks with it, so "
        "that a burst's prefills share one engine step instead of queueing behind each other's (ranks that step "
        "together pause every rank's decode for each prefill step). "
        f"Default: {DEFAULT_GATHER_MS:g} when the ranks step together (--engine deepinfer, --sim-lockstep), else 0 "
        "(off).",
    )
    p.add_argument(
        "--dispatch-gather-min-tokens",
        type=int,
        default=4096,
        help="Prompts shorter than this never wait for --dispatch-gather-ms: their prefill costs less than the wait.",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=TIMING_DEFAULTS["--drain-timeout"],
        help="Seconds to finish in-flight requests on SIGTERM.",
    )
    p.add_argument(
        "--watchdog-timeout",
        type=float,
        default=TIMING_DEFAULTS["--watchdog-timeout"],
        help="Seconds a rank with requests in flight may go without a heartbeat (one per engine step) before the "
        "server declares it hung, kills every rank and exits with status 1; 0 disables it. The default allows a "
        "first-step JIT compile and a 1M-token prefill.",
    )
    p.add_argument(
        "--rank-shutdown-timeout",
        type=float,
        default=30.0,
        help="Seconds the ranks get to close their engine when the server stops, before they and their children "
        "are killed (SIGKILL).",
    )
    p.add_argument(
        "--engine",
        choices=tuple(ENGINES),
        metavar="{" + ",".join(name for name, entry in ENGINES.items() if not entry.hidden) + "}",
        default=os.environ.get("DEEPINFER_SERVER_ENGINE", "sim"),
        help="Engine behind the ranks (default from DEEPINFER_SERVER_ENGINE; the container image sets deepinfer).",
    )
    p.add_argument(
        "--codec-threads", type=int, default=2, help="Threads converting and encoding requests (deepseek-recipe)."
    )
    p.add_argument(
        "--prompt-encoder",
        choices=PROMPT_ENCODERS,
        default="auto",
        help="Who tokenizes prompts after deepseek-recipe renders them: fastokens (tens of times faster) when it "
        "reproduces deepseek-recipe's IDs on start-up probes for this tokenizer (auto), always (fastokens: exit if it "
        "does not), or never (recipe).",
    )
    p.add_argument("--http-workers", type=int, default=2, help="Tokio worker threads serving HTTP.")
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    p.add_argument("--log-format", default="text", choices=("text", "json"), help="json: one JSON object per line.")
    p.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help="Require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on /v1/* and the worker metadata; "
        f"/health and /metrics stay open. Default from {API_KEY_ENV}. Given here, the key is moved to that "
        "variable at once (the process re-executes itself), so that ps does not show it; --api-key-file avoids "
        "the command line altogether. An empty key is refused.",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="Read the API keys from this file, one a line (a Kubernetes Secret mounted as a file). Each key is an "
        "owner of its own: its stored state and queued work count against its own share.",
    )
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="Order of the wait queue (--max-queued-requests): fcfs, first come first served, or priority, lower "
        "'priority' values first as in vLLM. With fcfs a request's 'priority' is ignored: any client could "
        "otherwise send itself to the head of the queue.",
    )
    limits_args.add_arguments(p.add_argument_group("limits on what one client may cost"))
    edge_args.add_arguments(p)  # TLS, --uds, --root-path; CORS
    media_args.add_arguments(p.add_argument_group("image input"))
    state_args.add_arguments(p.add_argument_group("state (stored responses)"))
    trace_args.add_arguments(p.add_argument_group("traces (OpenTelemetry)"))
    sim = p.add_argument_group("simulated engine (--engine sim)")
    sim_config.add_arguments(sim)  # its cost model, --sim-profile and the failures to inject
    return p


def resolve_parallelism(args: argparse.Namespace) -> str | None:
    """Fill in EP/DP/CP so that DP x CP = EP. Returns an error message, or None when consistent."""
    ep, dp, cp = args.expert_parallel_size, args.data_parallel_size, args.context_parallel_size
    for name, v in (("--expert-parallel-size", ep), ("--data-parallel-size", dp), ("--context-parallel-size", cp)):
        if v is not None and v < 1:
            return f"{name} must be at least 1, got {v}"
    if ep is None:
        ep = (dp or 1) * (cp or 1)
    if dp is None and cp is None:
        dp, cp = 1, ep
    elif cp is None:
        assert dp is not None
        if ep % dp:
            return f"--expert-parallel-size {ep} is not divisible by --data-parallel-size {dp} (need DP x CP = EP)"
        cp = ep // dp
    elif dp is None:
        if ep % cp:
            return f"--expert-parallel-size {ep} is not divisible by --context-parallel-size {cp} (need DP x CP = EP)"
        dp = ep // cp
    if dp * cp != ep:
        return f"DP x CP must equal EP: {dp} x {cp} != {ep}"
    args.expert_parallel_size, args.data_parallel_size, args.context_parallel_size = ep, dp, cp
    return None


def check_args(args: argparse.Namespace) -> str | None:
    """Every cross-field rule in one place; the message names the flags involved."""
    err = (
        resolve_parallelism(args)
        or sim_config.resolve(args)
        or media_args.resolve(args)
        or limits_args.resolve(args)
        or edge_args.resolve(args)
        or state_args.resolve(args)
        or trace_args.resolve(args)
    )
    if err:
        return err
    err = resolve_api_key(args)
    if err:
        return err
    engine = ENGINES.get(args.engine)
    if engine is None:  # argparse checks the choice on the command line, not the default from the environment
        return f"DEEPINFER_SERVER_ENGINE={args.engine!r} is not an engine ({', '.join(ENGINES)})"
    err = engine.check(args)
    if err:
        return err
    if args.max_model_len < 2:
        return "--max-model-len must be at least 2"
    if args.max_num_seqs < 1:
        return "--max-num-seqs must be at least 1"
    if args.max_num_batched_tokens is None:
        args.max_num_batched_tokens = max(args.max_model_len, 4096, args.max_num_seqs)
    if args.max_num_batched_tokens < args.max_num_seqs:
        return "--max-num-batched-tokens must be at least --max-num-seqs (one decode token per sequence)"
    if not 0 < args.gpu_memory_utilization <= 1:
        return "--gpu-memory-utilization must be in (0, 1]"
    if not 0 <= args.port < 65536:
        return "--port must be in 0..65535 (0 picks a free port)"
    for flag in (
        "max_queued_requests",
        "max_num_partial_prefills",
        "max_long_partial_prefills",
        "long_prefill_token_threshold",
        "queue_timeout",
        "startup_timeout",
        "request_timeout",
        "exit_on_rank_failure",
        "drain_timeout",
        "watchdog_timeout",
        "rank_shutdown_timeout",
        "stream_interval_ms",
        "sim_prefill_ms_per_1k_tokens",
        "sim_decode_step_ms",
        "sim_decode_ms_per_seq",
        "sim_prefill_chunk_tokens",
    ):
        if getattr(args, flag) < 0:
            return f"--{flag.replace('_', '-')} must not be negative"
    if args.sim_prefill_vote_ms is not None and args.sim_prefill_vote_ms < 0:
        return "--sim-prefill-vote-ms must not be negative"
    for flag in ("prefill_attempt_interval", "prefill_any_attempt_interval"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1"
    if args.sse_keep_alive <= 0:
        return "--sse-keep-alive must be positive"
    if args.dispatch_gather_ms is None:
        together = engine.stepping(args) is not Stepping.ALONE
        args.dispatch_gather_ms = DEFAULT_GATHER_MS if together else 0.0
    if args.dispatch_gather_ms < 0 or args.dispatch_gather_ms > 1000 or args.dispatch_gather_min_tokens < 0:
        return "--dispatch-gather-ms must be within 0-1000 and --dispatch-gather-min-tokens at least 0"
    if args.codec_threads < 1 or args.http_workers < 1:
        return "--codec-threads and --http-workers must be at least 1"
    return None


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """The key from --api-key-file when given; an empty key is an error, never authentication silently off."""
    if args.api_key_file is not None:
        if args.api_key is not None and os.environ.get(API_KEY_ENV) != args.api_key:
            return "--api-key and --api-key-file are exclusive"
        try:
            with open(args.api_key_file, encoding="utf-8") as f:
                keys = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
            args.api_key = "\n".join(keys)
        except OSError as e:
            return f"--api-key-file: {e.strerror}: {args.api_key_file}"
    if args.api_key is not None and not args.api_key.strip():
        return (
            f"the API key (--api-key, --api-key-file or {API_KEY_ENV}) is empty: give a key, or none to serve without"
        )
    return None


def argv_without_api_key(argv: Sequence[str]) -> list[str] | None:
    """`argv` with `--api-key KEY` / `--api-key=KEY` taken out, or None when it has neither."""
    out: list[str] = []
    skip = found = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--api-key":
            skip = found = True
        elif arg.startswith("--api-key="):
            found = True
        else:
            out.append(arg)
    return out if found else None


def main(argv: Sequence[str] | None = None) -> int:
    given = sys.argv[1:] if argv is None else list(argv)
    if given[:1] == ["run-batch"]:  # vLLM's offline form: a batch file through this server (run_batch.py)
        from deepinfer_server.run_batch import main as run_batch

        return run_batch(given[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    err = check_args(args)
    if err:
        parser.error(err)  # exits 2 with the usage line
    if argv is None:  # run as the program, not called in-process
        from deepinfer_server.malloc import reexec_on_mimalloc

        # A key on the command line is readable by every user of the host (ps, /proc/PID/cmdline); the process's
        # environment only by its own user. Move it there now, in the same re-execution as the allocator switch.
        hidden = argv_without_api_key(sys.orig_argv[1:])
        reexec_on_mimalloc(args.malloc, hidden, {API_KEY_ENV: args.api_key} if hidden is not None else None)
    from deepinfer_server.launcher import run

    return run(args)


if __name__ == "__main__":
    sys.exit(main())
