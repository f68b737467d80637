"""The rank processes and their rings: one process per data-parallel rank (engine/rank.py), its request and output
rings in /dev/shm, the lockstep and doorbell of ranks that step together, and the reaper that cleans up after a
killed server. Started before the HTTP port opens, stopped after it closes (launcher.py). What differs between
engines (each rank's engine config and environment, how the ranks step) comes from the engine's entry
(engine/registry.py)."""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from deepinfer_server import _native
from deepinfer_server.engine.base import ConfigError
from deepinfer_server.engine.registry import ENGINES, Stepping
from deepinfer_server.malloc import without_preload
from deepinfer_server.shm import SHM_DIR, claim_instance

log = logging.getLogger("deepinfer_server")

OUTPUT_RING_BYTES = 1 << 20  # ranks run at most a few steps ahead of the server (engine/loop.py)


class StartupError(Exception):
    """A start-up that cannot go on (a rank that failed or timed out, a setting the engine cannot run with, a model
    that cannot be found); the message says why."""


def _pow2_at_least(n: int) -> int:
    return 1 << max(12, (n - 1).bit_length())


# A SUBMIT's fields beside the prompt and the grammar: sampling, the grammar's triggers, the image file's name and
# each image's size (rust/ring/records.rs), with room to spare.
SUBMIT_OVERHEAD = 64 << 10


def largest_submit(args: argparse.Namespace) -> int:
    """The largest SUBMIT record a request within the limits makes: 4 bytes per prompt token, the grammar, the rest."""
    return 4 * int(args.max_model_len) + int(args.max_grammar_bytes) + SUBMIT_OVERHEAD


class Ranks:
    """The rank processes and their rings, owned by the launcher until the server exits."""

    def __init__(self, args: argparse.Namespace, tokenizer: Path) -> None:
        self.args = args
        self.engine = ENGINES[args.engine]
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
        try:  # e.g. DeepInfer's GPUs per rank and its one shared rendezvous port (MASTER_PORT - 50 must be free)
            launches = self.engine.launch(a, self.tokenizer, os.environ)
        except ConfigError as e:
            raise StartupError(str(e)) from e
        stepping = self.engine.stepping(a)
        lockstep_path = bell_path = None
        if stepping is Stepping.BARRIER and a.data_parallel_size > 1:  # a barrier of one rank holds nobody back
            lockstep_path = SHM_DIR / f"{self.prefix}-lockstep"
            self.lockstep = _native.Lockstep.create(str(lockstep_path), a.data_parallel_size)
            self.shared.append(lockstep_path)
        if stepping is Stepping.COLLECTIVES or lockstep_path:  # ranks that step together sleep on one doorbell
            bell_path = SHM_DIR / f"{self.prefix}-bell"
            self.bell = _native.Doorbell.create(str(bell_path))
            self.shared.append(bell_path)
        for rank, (engine_config, engine_env) in enumerate(launches):
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
                "engine_config": engine_config,
                "lockstep": str(lockstep_path) if lockstep_path else None,
                "doorbell": str(bell_path) if bell_path else None,
            }
            env = self.rank_env(rank)
            env.update(engine_env)
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
        return env if self.engine.shares_allocator else without_preload(env)

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
