"""Start-up and shutdown around the Rust front end.

Find the model, load the codec, start the ranks and their shared-memory rings (ranks.py), wait until every rank is
ready (the HTTP port opens only then), unlink the ring files once everyone has mapped them, and hand over to
`_native.serve`, which runs the HTTP server with the GIL released until shutdown.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import signal
import sys
from pathlib import Path

from deepinfer_server import _native, edge_args, limits_args, logs, media_args, state_args, trace_args
from deepinfer_server.codec import Codec, decode_batch
from deepinfer_server.images import Images
from deepinfer_server.malloc import PRELOADED, returning_freed_memory
from deepinfer_server.ranks import Ranks, StartupError
from deepinfer_server.shm import clean_stale_segments
from deepinfer_server.vocabulary import system_fingerprint

log = logging.getLogger("deepinfer_server")

BUNDLED_TOKENIZER = Path(__file__).with_name("tokenizer") / "tokenizer.json"
OPENAPI = Path(__file__).with_name("openapi.json")
DEFAULT_MODEL_NAME = "deepseek-v4.1-flash"
GIL_SWITCH_INTERVAL_S = 0.0002


REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def locate_model(model: str) -> Path:
    """A local checkpoint directory, or a Hugging Face repo id fetched into the cache (HF_HOME) on first start."""
    path = Path(model)
    if path.is_dir():
        return path
    if not REPO_ID.match(model):
        raise StartupError(f"MODEL {model!r} is neither a checkpoint directory nor a Hugging Face repo id (org/name)")
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:  # pragma: no cover - tokenizers depends on huggingface_hub
        raise StartupError(f"MODEL {model!r} looks like a repo id, but huggingface_hub is not installed") from e
    log.info(
        "fetching %s into the Hugging Face cache (%s); the first start downloads the checkpoint",
        model,
        os.environ.get("HF_HOME", "~/.cache/huggingface"),
    )
    try:
        return Path(snapshot_download(model))
    except Exception as e:
        raise StartupError(f"cannot fetch MODEL {model!r} from the Hugging Face Hub: {e}") from e


def resolve_model(args: argparse.Namespace) -> tuple[Path, str]:
    """(tokenizer.json path, prompt encoding "v4" or "v4.1") for MODEL, or the bundled tokenizer without one.

    Sets `args.model_dir` to the local checkpoint directory the engine loads, and `args.model_type` to its
    config.json's `model_type` (None without one), which /model_info reports."""
    args.model_dir = args.model_type = None
    if not args.model:
        return BUNDLED_TOKENIZER, "v4.1"
    model = locate_model(args.model)
    args.model_dir = str(model)
    tokenizer = model / "tokenizer.json"
    if not tokenizer.is_file():
        raise StartupError(f"{tokenizer} not found: the checkpoint must contain a Hugging Face tokenizer.json")
    version = "v4.1"
    config = model / "config.json"
    if config.is_file():
        model_type = str(json.loads(config.read_text()).get("model_type", ""))
        args.model_type = model_type or None
        if model_type in ("deepseek_v4", "deepseek_v4_pro"):
            version = "v4"
    return tokenizer, version


PINS = {"thinking": True, "no-thinking": False}


def served_names(raw: list[str]) -> tuple[list[str], dict[str, bool]]:
    """`--served-model-name` values: the names, and those pinned to a thinking mode (`NAME=thinking`,
    `NAME=no-thinking`) with the mode. A name may contain "=" itself; only these two suffixes pin."""
    names: list[str] = []
    pins: dict[str, bool] = {}
    for item in raw:
        name, _, mode = item.rpartition("=")
        if name and mode in PINS:
            pins[name] = PINS[mode]
        else:
            name = item
        if name not in names:
            names.append(name)
    return names, pins


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def image_input(args: argparse.Namespace, media_dir: Path) -> Images | None:
    """Image preprocessing with the request limits, or None when `--max-images-per-request 0` refuses images."""
    if args.max_images_per_request <= 0:
        return None
    return Images(args.max_images_per_request, args.max_image_bytes, args.max_image_total_bytes, str(media_dir))


def run(args: argparse.Namespace) -> int:
    # Prompt encoding runs on the codec threads next to the HTTP and decode threads; rayon's spinning worker
    # pool (the tokenizers default) costs more under load than it saves on short prompts.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    logs.configure(args.log_level, args.log_format, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    open_files = limits_args.raise_open_file_limit()
    preloaded = os.environ.get(PRELOADED)
    log.info("memory allocator: %s", f"mimalloc ({preloaded})" if preloaded else "system (glibc)")
    try:
        tokenizer, version = resolve_model(args)
    except StartupError as e:
        log.error("%s", e)
        return 1
    names, pins = served_names(args.served_model_name or [args.model or DEFAULT_MODEL_NAME])
    with returning_freed_memory():
        # The backend configuration a seeded answer depends on: engine, model, parallel layout, context length.
        fingerprint = system_fingerprint(
            args.engine,
            args.model or "",
            version,
            args.data_parallel_size,
            args.context_parallel_size,
            args.max_model_len,
        )
        clean_stale_segments()
        ranks = Ranks(args, tokenizer)
        codec = Codec(
            tokenizer,
            names,
            args.max_model_len,
            version,
            args.prompt_encoder,
            fingerprint,
            default_thinking=args.default_thinking == "on",
            images=image_input(args, ranks.media_dir()),
            grammar_limits=limits_args.grammar_limits(args),
        )
    code = 1  # until the server returns its own
    # SIGTERM during start-up: stop cleanly instead of leaving ranks and segments behind.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        ranks.start()
        ranks.wait_ready(args.startup_timeout)
        ranks.unlink()
        config = _native.ServerConfig(
            host=args.host,
            port=args.port,
            served_model_names=names,
            thinking_pins=pins,
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            limits=limits_args.server_config(args, open_files),
            log_level=args.log_level,
            exit_on_rank_failure_s=args.exit_on_rank_failure,
            drain_timeout_s=args.drain_timeout,
            http_workers=args.http_workers,
            codec_threads=args.codec_threads,
            dispatch_gather_ms=args.dispatch_gather_ms,
            dispatch_gather_min_tokens=args.dispatch_gather_min_tokens,
            api_key=args.api_key,
            log_format=args.log_format,
            sse_keep_alive_s=args.sse_keep_alive,
            stream_interval_ms=args.stream_interval_ms,
            edge=edge_args.edge_config(args),
            console=args.console == "on",
            cors=edge_args.cors_config(args),
            state=state_args.server_config(args),
            media=media_args.server_config(args),
            engine=_native.EngineConfig(
                model_path=args.model or None,
                model_type=args.model_type,
                model_dir=args.model_dir,
                engine=args.engine,
                expert_parallel_size=args.expert_parallel_size,
                context_parallel_size=args.context_parallel_size,
            ),
            watchdog_timeout_s=args.watchdog_timeout,
            priority_scheduling=args.scheduling_policy == "priority",
            openapi=OPENAPI.read_text(encoding="utf-8") if OPENAPI.is_file() else None,
            otlp_traces=trace_args.server_config(args),
        )
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the Rust server handles SIGTERM/SIGINT from here on
        # The codec threads (request conversion) and the rank output threads (decoding) share the GIL. Python's
        # default 5 ms switch interval would make a new request wait up to 5 ms at every GIL hand-over behind a
        # decoding thread; 0.2 ms keeps time to first token low under load at a negligible switching cost.
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        code = int(_native.serve(config, codec, decode_batch, ranks.rings, [p.pid for p in ranks.procs], ranks.bell))
        return code
    except StartupError as e:
        log.error("start-up failed: %s", e)
        return code
    except KeyboardInterrupt:
        log.info("interrupted")
        code = 130
        return code
    finally:
        grace = args.rank_shutdown_timeout
        if code != 0 and ranks.bell is not None:
            # Ranks that step together cannot close once one of them failed or hung: close() is collective
            # and would wait for the lost peer forever. Do not give them the grace period.
            log.warning("a rank failed: killing the ranks without waiting for their collective close()")
            grace = 0.0
        ranks.stop(grace)
