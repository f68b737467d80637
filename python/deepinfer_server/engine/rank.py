"""Rank process main loop: drain the request ring, step the engine, publish tokens. One process per DP rank.

Run as `python -m deepinfer_server.engine.rank --config JSON`. The loop owns the engine on one thread. It waits
on the request ring's futex when idle (no busy-spinning) and blocks on the output ring when the server is behind.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NoReturn, cast

from deepinfer_server import _native, logs
from deepinfer_server.engine.base import Engine, Output, Submit, load_images, so_args

if TYPE_CHECKING:
    from deepinfer_server.engine.sim import SimEngine

log = logging.getLogger("deepinfer_server.rank")

STATUS_EVERY_S = 0.005
SIM_NICE = 10
CATCH_UP_WAIT_S = 0.05  # the server wakes a waiting rank when it sends a request; this is only a backstop
# An idle rank's sleep is bounded so it notices a closed ring even when nothing wakes it.
IDLE_WAIT_S = float(os.environ.get("DEEPINFER_SERVER_IDLE_WAIT_S", "1"))
# Engine steps of output the rank may leave unread before it waits for the server to catch up. A real engine's
# step is far slower than the server, so this only binds a zero-cost engine, which would otherwise run far ahead
# and make every new request's first token queue behind a backlog of other requests' tokens. It trades the zero-cost
# benchmark's TTFT against CPU per token (fewer, larger batches); BENCHMARKS.md has the table behind the 4.
RUN_AHEAD_STEPS = int(os.environ.get("DEEPINFER_SIM_RUN_AHEAD_STEPS", "4"))
# A step that starts no request's output and ends none (an engine says so with `quiet_step`, as the sim does) is
# published without waking the server, which holds such tokens for its stream interval anyway; it is woken at least
# this often (never less often than the interval), and before the rank waits for it to catch up. A zero-cost rank
# would otherwise wake it every step.
WAKE_EVERY_S = 0.001
EXIT_FATAL = 3  # the rank hit an error outside any one request (see `die`)


def _die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this rank when the server process dies (Linux PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def die(rank: int, outputs: _native.Ring, what: str) -> NoReturn:
    """Exit at once after an error the rank cannot contain (the server turns the exit into 503 and exits).

    Never through `engine.close()` or anything else collective: the peers may be inside a step's all-reduce, and
    a rank that enters a different collective (or waits for one they will never join) hangs the whole group."""
    log.critical("rank %d: %s; exiting without closing the engine", rank, what, exc_info=True)
    with contextlib.suppress(Exception):
        outputs.set_aux(_native.AUX_STATE, _native.STATE_FAILED)
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(EXIT_FATAL)


def build_engine(kind: str, cfg: dict[str, Any], sim_faults: dict[str, Any] | None = None) -> Engine:
    if kind == "sim":
        from deepinfer_server.engine import sim_faults as faults

        # The simulated engine stands in for a GPU: it should not take host CPU from the server's request
        # handling (a real engine's step runs on the device, not on the cores the front end uses).
        os.nice(SIM_NICE)

        sim: Engine = faults.build(cfg, sim_faults)  # a SimEngine, with failures injected if asked
        return sim
    if kind == "deepinfer":
        from deepinfer_server.engine.deepinfer import build as build_deepinfer

        real: Engine = build_deepinfer(cfg)
        return real
    raise ValueError(f"unknown engine {kind!r}")


class Status:
    """The rank's status words in its output ring (load, KV usage, heartbeat), for dispatch and /metrics.

    Computing the load is O(requests), so a busy loop refreshes them every STATUS_EVERY_S, not every step.
    `phase` names what the loop is doing, for the server's watchdog to log when the rank hangs; it costs one
    write per change."""

    def __init__(self, engine: Engine, outputs: _native.Ring) -> None:
        self.engine, self.set_aux, self.due = engine, outputs.set_aux, 0.0
        self.set_aux(_native.AUX_KV_CAPACITY_TOKENS, max(0, engine.kv_capacity_tokens()))
        self.current = -1
        # Counters only some engines keep (DeepInferEngine): speculative tokens, preemptions.
        self.spec_tokens = getattr(engine, "spec_tokens", None)
        self.preemptions = getattr(engine, "preemptions", None)

    def phase(self, phase: int) -> None:
        if phase != self.current:
            self.current = phase
            self.set_aux(_native.AUX_PHASE, phase)

    def update(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self.due:
            return
        self.due = now + STATUS_EVERY_S
        n_requests, queued_tokens = self.engine.load()
        self.set_aux(_native.AUX_REQUESTS, n_requests)
        self.set_aux(_native.AUX_QUEUED_TOKENS, queued_tokens)
        self.set_aux(_native.AUX_KV_USAGE_PPM, int(self.engine.kv_usage() * 1_000_000))
        if self.spec_tokens is not None:
            drafted, accepted = self.spec_tokens()
            self.set_aux(_native.AUX_SPEC_DRAFT_TOKENS, drafted)
            self.set_aux(_native.AUX_SPEC_ACCEPTED_TOKENS, accepted)
        if self.preemptions is not None:
            self.set_aux(_native.AUX_PREEMPTIONS, self.preemptions())
        re_aborts = getattr(self.engine, "re_aborts", None)
        if re_aborts is not None:
            self.set_aux(_native.AUX_REABORTS, re_aborts)
        self.set_aux(_native.AUX_HEARTBEAT_MS, int(now * 1000))


class GroupSleep:
    """How a rank of a group that steps together sleeps when the group is idle (engine/lockstep.py explains why).

    `round()` at the top of every round notes the group's doorbell and rings it if requests wait in this rank's
    ring: a peer that read the bell after the server rang may be asleep, and the group cannot step without it.
    `sleep()` after an idle round returns once anything rang since that note (or after IDLE_WAIT_S)."""

    def __init__(self, bell: _native.Doorbell, requests: _native.Ring) -> None:
        self.bell, self.requests, self.seen = bell, requests, bell.value()

    def round(self) -> None:
        self.seen = self.bell.value()
        if self.requests.used_bytes:
            self.bell.ring()

    def sleep(self) -> None:
        self.bell.wait(self.seen, IDLE_WAIT_S)


def first_token_times(engine: Engine) -> Callable[[], list[tuple[int, float, float]] | None]:
    """The engine's (request, taken, step start) times of the first tokens it just returned, for the server's
    TTFT breakdown; engines that keep none report nothing."""
    times = getattr(engine, "first_token_times", None)
    return times if callable(times) else lambda: None


def take_requests(engine: Engine, requests: _native.Ring) -> tuple[list[Output], bool]:
    """Feed everything waiting in the request ring to the engine: (immediate outputs, shutdown asked)."""
    published: list[Output] = []
    aborts: list[int] = []
    stop = False
    for msg in requests.drain_requests():
        tag = msg[0]
        if tag == _native.KIND_SUBMIT:
            _, rid, prompt, max_tokens, temperature, top_p, top_k, seed, ignore_eos, logprobs, constraint, pics = msg
            logprobs, prompt_logprobs = logprobs
            images = load_images(pics)
            if isinstance(images, str):
                published.append((rid, [], _native.FINISH_ERROR, images))
                continue
            req = Submit(
                rid,
                prompt,
                max_tokens,
                temperature,
                top_p,
                top_k,
                seed,
                ignore_eos,
                logprobs,
                so_args(constraint),
                images,
                prompt_logprobs,
            )
            published += engine.add(req)
        elif tag == _native.KIND_ABORT:
            aborts.append(msg[1])
        elif tag == _native.KIND_SHUTDOWN:
            stop = True
    if aborts:
        engine.abort(aborts)
    return published, stop


def publish(
    outputs: _native.Ring,
    published: list[Output],
    requests: _native.Ring | None = None,
    wake: bool = True,
    timings: list[tuple[int, float, float]] | None = None,
) -> None:
    """One TOKENS record per step (after a TIMING record for the first tokens in it, see `first_token_times`);
    then let the server catch up if it fell more than a few steps behind.

    While waiting, a new request ends the wait at once (the server wakes the rank when it sends one): its first
    token then lands in the server's next drain instead of behind another backlog."""
    outputs.publish(published, wake=wake, timings=timings)
    ahead = RUN_AHEAD_STEPS * (8 + 24 * len(published))  # about the size of this step's record
    if not wake and outputs.used_bytes > ahead:
        outputs.wake_consumer()
    while outputs.used_bytes > ahead:
        if requests is not None and requests.used_bytes:
            return
        if outputs.wait_drained(ahead, CATCH_UP_WAIT_S):
            return
        # Alive, only waiting for the server: not a hang for the watchdog.
        outputs.set_aux(_native.AUX_HEARTBEAT_MS, int(time.monotonic() * 1000))


class WakePolicy:
    """Whether a published step wakes the server: always for a step that is not quiet, and for a quiet one once
    `every_s` has passed since the last wake. The server sends a due stream's tokens as soon as it reads them, so
    `every_s` is at most its stream interval: with an interval of 0 every step wakes it."""

    def __init__(self, stream_interval_ms: float) -> None:
        self.every_s = min(WAKE_EVERY_S, max(0.0, stream_interval_ms) / 1000)
        self.woke = float("-inf")

    def __call__(self, quiet: bool, now: float) -> bool:
        if not quiet or now - self.woke >= self.every_s:
            self.woke = now
            return True
        return False


def serve_rank(engine: Engine, requests: _native.Ring, outputs: _native.Ring, stream_interval_ms: float = 0.0) -> None:
    """The loop. Returns on SHUTDOWN or when the server closes the rings."""
    status = Status(engine, outputs)
    wake_policy = WakePolicy(stream_interval_ms)
    first_times = first_token_times(engine)
    while True:
        if not engine.has_work():
            status.phase(_native.PHASE_IDLE)
            outputs.wake_consumer()  # nothing published quietly may wait for the next step
            requests.wait(IDLE_WAIT_S)
            if requests.closed:
                return
        status.phase(_native.PHASE_ADD)
        published, stop = take_requests(engine, requests)
        if stop:
            return
        quiet = not published
        if engine.has_work():
            status.phase(_native.PHASE_STEP)
            published += engine.step()
            quiet = quiet and engine.quiet_step
        if published:
            status.phase(_native.PHASE_PUBLISH)
            publish(outputs, published, requests, wake_policy(quiet, time.monotonic()), first_times())
        status.update(force=not engine.has_work())


def serve_sim_lockstep(
    engine: SimEngine, requests: _native.Ring, outputs: _native.Ring, lock: _native.Lockstep, bell: _native.Doorbell
) -> None:
    """Simulated DP ranks in lockstep, as DeepInfer's: while any rank is busy every rank steps, and each step
    lasts as long as the slowest rank's (idle ranks ride along). After an idle round every rank sleeps on the
    group's doorbell, as engine/lockstep.py explains: a request on any rank wakes the whole group, nobody polls."""
    status = Status(engine, outputs)
    idle = GroupSleep(bell, requests)
    first_times = first_token_times(engine)
    try:
        while True:
            idle.round()
            status.phase(_native.PHASE_ADD)
            published, stop = take_requests(engine, requests)
            if stop or requests.closed:
                return
            busy = engine.has_work()
            start = engine.step_start()
            cost = engine.plan() if busy else 0.0
            status.phase(_native.PHASE_SYNC)
            any_busy, slowest = lock.sync(busy, cost)
            if any_busy:
                if not busy:
                    engine.ride_along()
                status.phase(_native.PHASE_STEP)
                step_ms = max(slowest, engine.cfg.decode_step_ms)
                engine.wait_until(start, step_ms)
                engine.step_done(start, step_ms)
                published += engine.commit()
            if published:
                status.phase(_native.PHASE_PUBLISH)
                publish(outputs, published, timings=first_times())
            status.update(force=not busy)
            if not any_busy:
                status.phase(_native.PHASE_IDLE)
                idle.sleep()
    except _native.RingClosed:
        return
    finally:
        lock.close()  # never leave the other ranks waiting on a party that is gone


def _not_for_ranks(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT reach a rank only as part of a group or cgroup; the server stops it over the ring."""


def _default_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="deepinfer_server.engine.rank")
    ap.add_argument(
        "--config", required=True, help="JSON: rank, engine, rings, parent_pid, stream interval, engine config"
    )
    conf = json.loads(ap.parse_args(argv).config)
    rank = conf["rank"]
    logs.configure(conf.get("log_level", "INFO"), conf.get("log_format", "text"), f"%(asctime)s rank{rank} %(message)s")
    _die_with_parent(conf["parent_pid"])
    # A rank leaves only when the server says so over the ring, or dies with it (PR_SET_PDEATHSIG above). A
    # SIGTERM or SIGINT meant for the service (a whole process group or control group is signalled by systemd,
    # dumb-init, `tini -g`, `kill -- -PGID`) must not end it mid-drain: the server drains first, then sends the
    # shutdown record. A handler that does nothing rather than SIG_IGN: an ignored signal stays ignored across
    # exec, so the engine's spawned workers (DeepInfer's CP workers) would ignore SIGTERM too, and the engine's own
    # teardown (multiprocessing's terminate()) would wait on them forever. For the same reason a forked worker (the
    # engine's vision-encoder worker) gets the default dispositions back. The ring waits take EINTR as a wake.
    signal.signal(signal.SIGTERM, _not_for_ranks)
    signal.signal(signal.SIGINT, _not_for_ranks)
    os.register_at_fork(after_in_child=_default_signals)
    # Every shared file is mapped before this rank reports READY: once all ranks are ready the launcher unlinks them.
    requests = _native.Ring.open(conf["request_ring"])
    outputs = _native.Ring.open(conf["output_ring"])
    lock = _native.Lockstep.open(conf["lockstep"]) if conf.get("lockstep") else None
    bell = _native.Doorbell.open(conf["doorbell"]) if conf.get("doorbell") else None
    outputs.set_aux(_native.AUX_STATE, _native.STATE_LOADING)
    try:
        engine = build_engine(conf["engine"], conf["engine_config"], conf.get("sim_faults"))
    except Exception as e:
        log.exception("rank %d: engine failed to start: %s", rank, e)
        outputs.set_aux(_native.AUX_STATE, _native.STATE_FAILED)
        if lock is not None:
            lock.close()  # never leave the other ranks waiting on a party that is gone
        return 1
    partial = int(conf.get("max_num_partial_prefills") or 0)
    long_partial = int(conf.get("max_long_partial_prefills") or 0)
    if (partial > 0 or long_partial > 0) and callable(getattr(engine, "first_token_times", None)):
        from deepinfer_server.engine.prefill_gate import PrefillGate

        engine = PrefillGate(engine, partial, long_partial, int(conf.get("long_prefill_token_threshold") or 0))
    outputs.set_aux(_native.AUX_HEARTBEAT_MS, int(time.monotonic() * 1000))
    outputs.set_aux(_native.AUX_STATE, _native.STATE_READY)
    log.info("rank %d ready (engine %s)", rank, conf["engine"])
    try:
        if lock is not None and bell is not None:
            serve_sim_lockstep(cast("SimEngine", engine), requests, outputs, lock, bell)
        elif conf["engine"] == "deepinfer":
            from deepinfer_server.engine.lockstep import serve_lockstep

            assert bell is not None, "the launcher gives DeepInfer ranks their group's doorbell"
            serve_lockstep(engine, requests, outputs, bell)  # DP ranks step together
        else:
            serve_rank(engine, requests, outputs, conf.get("stream_interval_ms", 0.0))
    except _native.RingClosed:
        pass  # the server is gone or shutting down
    except BaseException:
        die(rank, outputs, "the rank loop failed")
    outputs.set_aux(_native.AUX_STATE, _native.STATE_STOPPED)
    outputs.set_aux(_native.AUX_PHASE, _native.PHASE_CLOSE)
    engine.close()  # collective for DeepInfer: reached only when every rank left the loop at the same iteration
    return 0


if __name__ == "__main__":
    sys.exit(main())
