"""Start-up and shutdown around the Rust front end.

Load the codec, create the shared-memory rings, start one rank process per data-parallel rank, wait until every
rank is ready (the HTTP port opens only then), unlink the ring files once everyone has mapped them, and hand over
to `_native.serve`, which runs the HTTP server with the GIL released until shutdown.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deepseek_recipe import SpecialToken

from deepinfer_server import _native, edge_args, limits_args, logs, media_args
from deepinfer_server.codec import Codec, decode_batch
from deepinfer_server.images import Images
from deepinfer_server.malloc import PRELOADED, returning_freed_memory, without_preload
from deepinfer_server.vocabulary import system_fingerprint

log = logging.getLogger("deepinfer_server")

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepinfer-"
BUNDLED_TOKENIZER = Path(__file__).with_name("tokenizer") / "tokenizer.json"
OPENAPI = Path(__file__).with_name("openapi.json")
DEFAULT_MODEL_NAME = "deepseek-v4.1-flash"
OUTPUT_RING_BYTES = 1 << 20  # ranks run at most a few steps ahead of the server (engine/loop.py)
GIL_SWITCH_INTERVAL_S = 0.0002
# Server flags for DeepInfer's scheduler settings, which it reads from the environment (identical on every rank).
PREFILL_INTERVAL_FLAGS = {
    "prefill_attempt_interval": "DEEPINFER_PREFILL_ATTEMPT_INTERVAL",
    "prefill_any_attempt_interval": "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
}


def prefill_interval(args: argparse.Namespace, flag: str) -> int:
    """A prefill-vote interval as DeepInfer sees it: the flag, else its environment variable, else 1."""
    value = getattr(args, flag, None)
    return int(value if value is not None else os.environ.get(PREFILL_INTERVAL_FLAGS[flag], "1"))


class StartupError(Exception):
    pass


def _pow2_at_least(n: int) -> int:
    return 1 << max(12, (n - 1).bit_length())


# A SUBMIT's fields beside the prompt and the grammar: sampling, the grammar's triggers, the image file's name and
# each image's size (rust/ring/records.rs), with room to spare.
SUBMIT_OVERHEAD = 64 << 10


def largest_submit(args: argparse.Namespace) -> int:
    """The largest SUBMIT record a request within the limits makes: 4 bytes per prompt token, the grammar, the rest."""
    return 4 * int(args.max_model_len) + int(args.max_grammar_bytes) + SUBMIT_OVERHEAD


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


def claim_instance() -> tuple[str, int]:
    """A name prefix for this server's shared-memory files, unique on the host, and an open file descriptor holding
    the prefix's lock file (`<prefix>-lock`, flock'ed until the process ends, however it ends).

    The lock, not the pid, says whether a prefix's owner lives: with host IPC (`docker run --ipc=host`, GPUStack)
    servers in several containers share /dev/shm, and each may be PID 1 in its own. The lock file is locked under a
    hidden name, then renamed into place, so no sweep ever sees it unlocked."""
    prefix = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    hidden = SHM_DIR / f".{prefix}-lock"
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(hidden, SHM_DIR / f"{prefix}-lock")
    return prefix, fd


def _owner_alive(prefix: str) -> bool:
    """Whether the server that made the files of `prefix` (deepinfer-PID-HEX) still runs: its lock file is held, or,
    for files of a server without one (an older version), its pid lives."""
    try:
        fd = os.open(SHM_DIR / f"{prefix}-lock", os.O_RDWR)
    except FileNotFoundError:
        pid = int(prefix.split("-")[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    except OSError:
        return True  # not ours to judge (another user's, say)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def clean_stale_segments() -> None:
    """Unlink the shared-memory files of servers that died before they could (see `claim_instance`)."""
    try:
        entries = list(SHM_DIR.glob(SHM_PREFIX + "*"))
    except OSError:
        return
    owners: dict[str, list[Path]] = {}
    for path in entries:
        parts = path.name.split("-")
        if len(parts) >= 3 and parts[1].isdigit():
            owners.setdefault("-".join(parts[:3]), []).append(path)
    for prefix, paths in owners.items():
        if _owner_alive(prefix):
            continue
        # The lock file goes last: until then a sweep running beside this one still sees the owner as dead.
        for path in sorted(paths, key=lambda p: p.name.endswith("-lock")):
            try:
                if path.is_dir():
                    shutil.rmtree(path)  # a media directory
                else:
                    path.unlink()
                log.info("removed stale shared-memory segment %s", path)
            except OSError:
                pass


class Ranks:
    """The rank processes and their rings, owned by the launcher until the server exits."""

    def __init__(self, args: argparse.Namespace, tokenizer: Path) -> None:
        self.args = args
        self.tokenizer = tokenizer
        self.prefix, self.lock_fd = claim_instance()
        self.paths: list[list[Path]] = []  # each rank's ring files, until it has mapped them
        self.shared: list[Path] = []  # files every rank maps (the lockstep, the doorbell)
        self.rings: list[tuple[Any, Any]] = []
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lockstep: Any = None
        self.bell: Any = None  # the doorbell of ranks that step together
        self.reaper: subprocess.Popen[bytes] | None = None
        self.reaper_pipe = -1  # write end; its EOF tells the reaper the server is gone

    def engine_config(self) -> dict[str, Any]:
        a = self.args
        if a.engine == "sim":
            return {
                "tokenizer_path": str(self.tokenizer),
                "max_model_len": a.max_model_len,
                "max_num_seqs": a.max_num_seqs,
                "max_num_batched_tokens": a.max_num_batched_tokens,
                "decode_step_ms": a.sim_decode_step_ms,
                "prefill_ms_per_1k_tokens": a.sim_prefill_ms_per_1k_tokens,
                "decode_ms_per_seq": a.sim_decode_ms_per_seq,
                "overlap_prefill": a.sim_overlap_prefill,
                "prefill_chunk_tokens": a.sim_prefill_chunk_tokens,
                "vote_ms": a.sim_prefill_vote_ms,
                "vote_every_all": prefill_interval(a, "prefill_attempt_interval"),
                "vote_every_any": prefill_interval(a, "prefill_any_attempt_interval"),
            }
        return {
            "model": a.model_dir,
            "trust_remote_code": a.trust_remote_code,
            "expert_parallel_size": a.expert_parallel_size,
            "data_parallel_size": a.data_parallel_size,
            "context_parallel_size": a.context_parallel_size,
            "max_model_len": a.max_model_len,
            "max_num_seqs": a.max_num_seqs,
            "max_num_batched_tokens": a.max_num_batched_tokens,
            "gpu_memory_utilization": a.gpu_memory_utilization,
            "disable_log_stats": a.disable_log_stats,
            "image_placeholder_id": image_placeholder_id(self.tokenizer),
        }

    def start_reaper(self) -> None:
        """The process that kills the ranks' leftovers if the server dies (deepinfer_server/reaper.py)."""
        r, w = os.pipe()  # not inheritable: no rank holds the write end open
        try:
            self.reaper = subprocess.Popen(
                [sys.executable, "-m", "deepinfer_server.reaper", self.prefix, self.args.log_format],
                stdin=r,
                start_new_session=True,  # no terminal or process-group signal ends it before the server
            )
        finally:
            os.close(r)
        self.reaper_pipe = w

    def start(self) -> None:
        a = self.args
        self.start_reaper()
        # Room for four of the largest records the limits allow at once (the longest prompt and the largest
        # grammar), so that no request that passed the checks is too large for its ring; the server's sender
        # queues anything beyond four in process.
        request_bytes = _pow2_at_least(max(1 << 20, 4 * 2 * largest_submit(a)))
        dist_envs: list[dict[str, str]] = []
        if a.engine == "deepinfer":
            from deepinfer_server.engine.deepinfer import ConfigError, check_output_pool, dist_env_for_ranks

            try:  # GPUs per rank and one shared rendezvous port (MASTER_PORT - 50 must be free)
                check_output_pool(a.max_num_seqs, os.environ)
                dist_envs = dist_env_for_ranks(a.data_parallel_size, a.context_parallel_size, a.port, os.environ)
            except ConfigError as e:
                raise StartupError(str(e)) from e
        lockstep_path = bell_path = None
        if a.engine == "sim" and a.sim_lockstep and a.data_parallel_size > 1:
            lockstep_path = SHM_DIR / f"{self.prefix}-lockstep"
            self.lockstep = _native.Lockstep.create(str(lockstep_path), a.data_parallel_size)
            self.shared.append(lockstep_path)
        if a.engine == "deepinfer" or lockstep_path:  # ranks that step together sleep on one doorbell
            bell_path = SHM_DIR / f"{self.prefix}-bell"
            self.bell = _native.Doorbell.create(str(bell_path))
            self.shared.append(bell_path)
        for rank in range(a.data_parallel_size):
            req_path = SHM_DIR / f"{self.prefix}-r{rank}-req"
            out_path = SHM_DIR / f"{self.prefix}-r{rank}-out"
            req = _native.Ring.create(str(req_path), request_bytes)
            out = _native.Ring.create(str(out_path), OUTPUT_RING_BYTES)
            self.paths.append([req_path, out_path])
            self.rings.append((req, out))
            conf = {
                "rank": rank,
                "engine": a.engine,
                "request_ring": str(req_path),
                "output_ring": str(out_path),
                "parent_pid": os.getpid(),
                "log_level": a.log_level,
                "log_format": a.log_format,
                "stream_interval_ms": a.stream_interval_ms,
                "max_num_partial_prefills": a.max_num_partial_prefills,
                "max_long_partial_prefills": a.max_long_partial_prefills,
                "long_prefill_token_threshold": a.long_prefill_token_threshold,
                "engine_config": self.engine_config(),
                "lockstep": str(lockstep_path) if lockstep_path else None,
                "doorbell": str(bell_path) if bell_path else None,
            }
            if a.engine == "sim":
                from deepinfer_server.engine.sim_faults import rank_config

                conf["sim_faults"] = rank_config(a, rank)  # failures to inject (--sim-error-rate ...), or None
            env = self.rank_env(rank)
            if dist_envs:
                conf["engine_config"]["engine_rank"] = rank
                env.update(dist_envs[rank])
                for flag, var in PREFILL_INTERVAL_FLAGS.items():  # the flag wins over the environment
                    if getattr(a, flag, None) is not None:
                        env[var] = str(getattr(a, flag))
            cmd = [sys.executable, "-m", "deepinfer_server.engine.rank", "--config", json.dumps(conf)]
            # Each rank leads its own process group, which its engine's children (CP workers, the VE worker) join.
            # A signal to the server's group (`kill -- -PGID`, `tini -g`, dumb-init, a terminal's Ctrl-C) reaches
            # only the server, which drains and then stops the ranks over the ring (rank.py shrugs off the SIGTERM
            # that reaches every process of a control group); the server and the reaper kill the whole group,
            # stopped members included, even after the rank itself is gone. A group, not a session: a new session
            # gets its own scheduler autogroup, which would cancel the sim ranks' nice and let them take the CPU
            # from the server (measured: twice the TTFT at 64 streams on two cores).
            self.procs.append(subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, **_OWN_PROCESS_GROUP))
            os.write(self.reaper_pipe, f"{self.procs[-1].pid}\n".encode())
            log.info("started rank %d (pid %d)", rank, self.procs[-1].pid)

    def rank_env(self, rank: int) -> dict[str, str]:
        env = dict(os.environ)
        # The simulated ranks share the server's allocator; a GPU engine keeps the system's (CUDA, torch).
        return env if self.args.engine == "sim" else without_preload(env)

    def wait_ready(self, timeout: float) -> None:
        """Block until every rank reports READY; fail naming the rank that exited, failed or timed out."""
        deadline = time.monotonic() + timeout if timeout > 0 else float("inf")
        pending = set(range(len(self.procs)))
        while pending:
            self.unlink_mapped()
            for rank in sorted(pending):
                state = self.rings[rank][1].aux(_native.AUX_STATE)
                code = self.procs[rank].poll()
                if state == _native.STATE_READY and code is None:
                    pending.discard(rank)
                    log.info("rank %d ready", rank)
                elif code is not None or state == _native.STATE_FAILED:
                    raise StartupError(f"rank {rank} failed during start-up (exit code {code}); see its log above")
            if pending and time.monotonic() > deadline:
                raise StartupError(f"rank(s) {sorted(pending)} not ready after --startup-timeout {timeout:g} s")
            if pending:
                time.sleep(0.02)

    def media_dir(self) -> Path:
        """Where the codec leaves each request's images for its rank (tmpfs; removed with the rings)."""
        path = SHM_DIR / f"{self.prefix}-media"
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def unlink_mapped(self) -> None:
        """Unlink each rank's ring files as soon as it has mapped them (it maps everything before it reports
        LOADING, long before a checkpoint has loaded), and the files every rank maps once all have: with host IPC
        /dev/shm is the host's, and a name left there is a door into this server's rings."""
        states = [out.aux(_native.AUX_STATE) for _, out in self.rings]
        mapped = [state in (_native.STATE_LOADING, _native.STATE_READY) for state in states]
        for rank, done in enumerate(mapped):
            if done:
                self._unlink(self.paths[rank])
        if mapped and all(mapped):
            self._unlink(self.shared)

    def unlink(self) -> None:
        """Remove every name left: nothing outlives the processes."""
        for paths in self.paths:
            self._unlink(paths)
        self._unlink(self.shared)

    @staticmethod
    def _unlink(paths: list[Path]) -> None:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
        paths.clear()

    def stop(self, grace: float = 30.0) -> None:
        """Ask every rank to stop, give them `grace` seconds to close their engine, then SIGKILL each rank's
        process group: the rank if still alive, and whatever it leaves (CP workers, VE worker), stopped or not."""
        if self.lockstep is not None:
            self.lockstep.close()
        for req, out in self.rings:
            with contextlib.suppress(Exception):
                req.push_shutdown()
            req.close()
            out.close()
        if self.bell is not None:
            self.bell.ring()  # ranks asleep after an idle round see the shutdown now
        deadline = time.monotonic() + grace
        for rank, p in enumerate(self.procs):
            if not _exited(p, max(0.0, deadline - time.monotonic())):
                log.warning("rank %d did not stop within --rank-shutdown-timeout %g s: killing it", rank, grace)
            # Before reaping the rank: while it is unreaped its pid, the group id, cannot be reused.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.unlink()
        shutil.rmtree(SHM_DIR / f"{self.prefix}-media", ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            (SHM_DIR / f"{self.prefix}-lock").unlink()  # last: until now a sweep sees this server alive
        if self.reaper_pipe >= 0:
            os.close(self.reaper_pipe)  # nothing is left for the reaper to find: it exits
            self.reaper_pipe = -1
        if self.reaper is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.reaper.wait(timeout=5)


# Popen's `process_group` is Python 3.11+; before it, the same setpgid(0, 0) from preexec_fn.
_OWN_PROCESS_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


def _exited(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Wait up to `timeout` s for `proc` to exit without reaping it (a pidfd; Popen.wait would reap)."""
    if proc.returncode is not None:
        return True
    try:
        fd = os.pidfd_open(proc.pid)
    except OSError:  # no pidfd (kernel < 5.3): wait and reap
        try:
            proc.wait(timeout=timeout)
            return True
        except subprocess.TimeoutExpired:
            return False
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


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


def image_placeholder_id(tokenizer: Path) -> int | None:
    """The serving tokenizer's ID for deepseek-recipe's image placeholder `<｜image｜>`, if it has one."""
    spelling = SpecialToken.Image.default_str()
    added = json.loads(tokenizer.read_text(encoding="utf-8")).get("added_tokens") or []
    return next((int(t["id"]) for t in added if t.get("content") == spelling), None)


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
        config = {
            "host": args.host,
            "port": args.port,
            "served_model_names": names,
            "thinking_pins": pins,
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs,
            "request_timeout_s": args.request_timeout,
            "max_queued_requests": args.max_queued_requests,
            "queue_timeout_s": args.queue_timeout,
            "log_level": args.log_level,
            "exit_on_rank_failure_s": args.exit_on_rank_failure,
            "drain_timeout_s": args.drain_timeout,
            "watchdog_timeout_s": args.watchdog_timeout,
            "api_key": args.api_key,
            "priority_scheduling": args.scheduling_policy == "priority",
            "openapi": OPENAPI.read_text(encoding="utf-8") if OPENAPI.is_file() else None,
            "log_format": args.log_format,
            "codec_threads": args.codec_threads,
            "dispatch_gather_ms": args.dispatch_gather_ms,
            "dispatch_gather_min_tokens": args.dispatch_gather_min_tokens,
            "http_workers": args.http_workers,
            "sse_keep_alive_s": args.sse_keep_alive,
            "stream_interval_ms": args.stream_interval_ms,
            "model_path": args.model or None,
            "model_type": args.model_type,
            "engine": args.engine,
            "expert_parallel_size": args.expert_parallel_size,
            "context_parallel_size": args.context_parallel_size,
            **media_args.server_config(args),
            **limits_args.server_config(args, open_files),
            **edge_args.server_config(args),
        }
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
