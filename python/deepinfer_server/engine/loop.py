"""What a rank's loop is made of, and the loops of engines whose ranks need no collectives.

The parts (`take_requests`, `publish`, `Status`, `WakePolicy`, `GroupSleep`) serve every loop: `serve_rank` (a rank
on its own), `serve_sim_lockstep` (simulated ranks stepping together) and engine/lockstep.py's `serve_lockstep`
(DeepInfer's ranks, one all-reduce per iteration). The rank process (engine/rank.py) picks the loop. A loop owns
the engine on one thread: it waits on the request ring's futex when idle (no busy-spinning) and blocks on the
output ring when the server is behind.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

from deepinfer_server import _native
from deepinfer_server.engine.base import (
    Ability,
    Counting,
    Engine,
    EngineLost,
    Published,
    Reloads,
    Submit,
    TimesFirstTokens,
    failed,
    load_images,
    so_args,
)

if TYPE_CHECKING:
    from deepinfer_server.engine.sim import SimEngine

log = logging.getLogger("deepinfer_server.rank")
STATUS_EVERY_S = 0.005
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


class Status:
    """The rank's status words in its output ring (load, KV usage, heartbeat), for dispatch and /metrics.

    Computing the load is O(requests), so a busy loop refreshes them every STATUS_EVERY_S, not every step.
    `phase` names what the loop is doing, for the server's watchdog to log when the rank hangs; it costs one
    write per change. `abilities`: the engine's, from its registry entry."""

    def __init__(self, engine: Engine, outputs: _native.Ring, abilities: frozenset[Ability]) -> None:
        self.engine, self.set_aux, self.due = engine, outputs.set_aux, 0.0
        self.set_aux(_native.AUX_KV_CAPACITY_TOKENS, max(0, engine.kv_capacity_tokens()))
        self.current = -1
        # Counters only some engines keep (DeepInfer's): speculative tokens, preemptions, re-sent aborts.
        self.counters = cast(Counting, engine) if Ability.COUNTERS in abilities else None

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
        if self.counters is not None:
            drafted, accepted = self.counters.spec_tokens()
            self.set_aux(_native.AUX_SPEC_DRAFT_TOKENS, drafted)
            self.set_aux(_native.AUX_SPEC_ACCEPTED_TOKENS, accepted)
            self.set_aux(_native.AUX_PREEMPTIONS, self.counters.preemptions())
            self.set_aux(_native.AUX_REABORTS, self.counters.re_aborts)
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


def first_token_times(
    engine: Engine, abilities: frozenset[Ability]
) -> Callable[[], list[tuple[int, float, float]] | None]:
    """The engine's (request, taken, step start) times of the first tokens it just returned, for the server's
    TTFT breakdown; engines without `Ability.FIRST_TOKEN_TIMES` report nothing."""
    if Ability.FIRST_TOKEN_TIMES in abilities:
        return cast(TimesFirstTokens, engine).first_token_times
    return lambda: None


def reload(engine: Engine, outputs: _native.Ring, abilities: frozenset[Ability], model_path: str) -> None:
    """A RELOAD record: the engine loads the checkpoint in place (keeping the old one if it cannot), and the rank
    says how it went in AUX_RELOADS, which the server waits on (rust/path/reload.rs) before it resumes."""
    ok = False
    if Ability.RELOAD not in abilities:
        log.error("weight reload of %s refused: this engine cannot reload in place", model_path)
    else:
        try:
            cast(Reloads, engine).reload(model_path)
            ok = True
            log.info("weights reloaded from %s", model_path)
        except EngineLost:
            raise  # neither checkpoint is loaded: the rank ends (engine/rank.py `die`)
        except Exception:
            log.exception("weight reload of %s failed; still serving the previous checkpoint", model_path)
    done = (outputs.aux(_native.AUX_RELOADS) >> 32) + 1
    outputs.set_aux(_native.AUX_HEARTBEAT_MS, int(time.monotonic() * 1000))
    outputs.set_aux(_native.AUX_RELOADS, done << 32 | (_native.RELOAD_OK if ok else _native.RELOAD_FAILED))


def take_requests(
    engine: Engine,
    requests: _native.Ring,
    outputs: _native.Ring,
    abilities: frozenset[Ability],
    reloads: list[str] | None = None,
) -> tuple[list[Published], bool]:
    """Feed everything waiting in the request ring to the engine (a RELOAD loads a checkpoint, `reload`, or is
    put in `reloads` for a loop whose ranks reload together): (immediate outputs, shutdown asked)."""
    published: list[Published] = []
    aborts: list[int] = []
    stop = False
    for msg in requests.drain_requests():
        if isinstance(msg, _native.Submit):
            images = load_images(msg.images)
            if isinstance(images, str):
                published.append(failed(msg.request_id, images))
                continue
            req = Submit(
                request_id=msg.request_id,
                prompt=msg.prompt,
                max_tokens=msg.max_tokens,
                temperature=msg.temperature,
                top_p=msg.top_p,
                top_k=msg.top_k,
                seed=msg.seed,
                ignore_eos=msg.ignore_eos,
                logprobs=msg.logprobs,
                so_args=so_args(msg.constraint),
                images=images,
                prompt_logprobs=msg.prompt_logprobs,
            )
            published += engine.add(req)
        elif isinstance(msg, _native.Abort):
            aborts.append(msg.request_id)
        elif isinstance(msg, _native.Reload):
            if aborts:  # the aborts sent before it end their requests first: the rank reloads empty
                engine.abort(aborts)
                aborts = []
            if reloads is not None:
                reloads.append(msg.model_path)
            else:
                reload(engine, outputs, abilities, msg.model_path)
        else:  # Shutdown
            stop = True
    if aborts:
        engine.abort(aborts)
    return published, stop


def publish(
    outputs: _native.Ring,
    published: list[Published],
    requests: _native.Ring | None = None,
    wake: bool = True,
    timings: list[tuple[int, float, float]] | None = None,
) -> None:
    """One TOKENS record per step (after a TIMING record for the first tokens in it, see `first_token_times`);
    then let the server catch up if it fell more than a few steps behind.

    While waiting, a new request ends the wait at once (the server wakes the rank when it sends one): its first
    token then lands in the server's next drain instead of behind another backlog."""
    rows = outputs.publish(published, wake=wake, timings=timings)
    ahead = RUN_AHEAD_STEPS * (8 + 24 * rows)  # about the size of this step's record
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


def serve_rank(
    engine: Engine,
    requests: _native.Ring,
    outputs: _native.Ring,
    stream_interval_ms: float = 0.0,
    *,
    abilities: frozenset[Ability],
) -> None:
    """The loop. Returns on SHUTDOWN or when the server closes the rings."""
    status = Status(engine, outputs, abilities)
    wake_policy = WakePolicy(stream_interval_ms)
    first_times = first_token_times(engine, abilities)
    while True:
        if not engine.has_work():
            status.phase(_native.PHASE_IDLE)
            outputs.wake_consumer()  # nothing published quietly may wait for the next step
            requests.wait(IDLE_WAIT_S)
            if requests.closed:
                return
        status.phase(_native.PHASE_ADD)
        published, stop = take_requests(engine, requests, outputs, abilities)
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
    engine: SimEngine,
    requests: _native.Ring,
    outputs: _native.Ring,
    lock: _native.Lockstep,
    bell: _native.Doorbell,
    *,
    abilities: frozenset[Ability],
) -> None:
    """Simulated DP ranks in lockstep, as DeepInfer's: while any rank is busy every rank steps, and each step
    lasts as long as the slowest rank's (idle ranks ride along). After an idle round every rank sleeps on the
    group's doorbell, as engine/lockstep.py explains: a request on any rank wakes the whole group, nobody polls."""
    status = Status(engine, outputs, abilities)
    idle = GroupSleep(bell, requests)
    first_times = first_token_times(engine, abilities)
    try:
        while True:
            idle.round()
            status.phase(_native.PHASE_ADD)
            published, stop = take_requests(engine, requests, outputs, abilities)
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
