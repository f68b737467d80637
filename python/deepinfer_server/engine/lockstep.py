"""Rank loop for engines whose data-parallel ranks must step together (DeepInfer).

DeepInfer's DP ranks run the same number of `step()` calls: every step holds scheduler votes and MoE collectives,
and an idle rank runs a placeholder batch. There is no central coordinator; each rank's loop does, per iteration:

1. drain its request ring without blocking (submits, aborts, shutdown);
2. ONE all-reduce of (local busy, stop, reload pending) over the DP group (`engine.sync`), so every rank takes the
   same branch;
3. step if any rank is busy; else, once after going idle, flush the step still in flight (async scheduling returns
   decode tokens one step late); else, if any rank asked to stop, leave the loop (all ranks at the same iteration,
   so the collective `engine.close()` that follows meets every peer); else, once EVERY rank holds the server's
   RELOAD record, reload together (the engine's collective close and build, engine/deepinfer.py `reload`);
4. publish the outputs before the next step, and update the aux words (load, heartbeat, and the phase the
   server's watchdog names when a rank hangs).

Any exception out of the loop ends the rank at once (engine/rank.py `die`), never through the collective
`engine.close()`: the peers may be inside this iteration's all-reduce or step, and would wait there forever.

When the whole group is idle, each rank sleeps on the group's doorbell (rust/ring/doorbell.rs) until something
rings it: the server after every request record, and a rank that finds records in its own ring (a peer that read
the bell after the server rang may be asleep, and the rank cannot step until that peer reaches the all-reduce).
Nothing polls: an idle group makes no collectives at all. The sleep is bounded by `IDLE_WAIT_S` (engine/loop.py) so
a closed ring is noticed.
"""

from __future__ import annotations

import logging
from typing import Protocol, cast

from deepinfer_server import _native
from deepinfer_server.engine.base import Ability, Engine, Published
from deepinfer_server.engine.loop import GroupSleep, Status, first_token_times, reload, take_requests

log = logging.getLogger("deepinfer_server.lockstep")


class LockstepEngine(Engine, Protocol):
    group_size: int

    def sync(self, busy: bool, stop: bool, reload: bool = False) -> tuple[bool, bool, bool]:
        """One collective: (any rank busy, any rank stopping, every rank holding a reload)."""

    def flush(self) -> list[Published]:
        """Outputs of the step still in flight, when going idle."""


def serve_lockstep(
    any_engine: Engine,
    requests: _native.Ring,
    outputs: _native.Ring,
    bell: _native.Doorbell,
    *,
    abilities: frozenset[Ability],
) -> None:
    """The loop. Returns when any rank got SHUTDOWN or lost its rings, on every rank at the same iteration.
    `abilities`: the engine's, from its registry entry, which must say it steps through its own collectives."""
    if Ability.COLLECTIVES not in abilities:
        raise TypeError(f"{type(any_engine).__name__} has no sync()/flush() (Ability.COLLECTIVES): no lockstep")
    engine = cast(LockstepEngine, any_engine)
    status = Status(engine, outputs, abilities)
    idle = GroupSleep(bell, requests)
    first_times = first_token_times(engine, abilities)
    stopping = False  # this rank wants to stop (SHUTDOWN or the server closed the rings)
    flushed = True  # nothing in flight since the last flush
    reload_to: list[str] = []  # the checkpoint of the server's RELOAD record, until every rank holds one
    while True:
        idle.round()
        published: list[Published] = []
        if not stopping:
            status.phase(_native.PHASE_ADD)
            try:
                published, stopping = take_requests(engine, requests, outputs, abilities, reload_to)
            except _native.RingClosed:
                stopping = True

        status.phase(_native.PHASE_SYNC)
        # The one collective of the iteration.
        busy, stop, reloading = engine.sync(engine.has_work(), stopping, bool(reload_to))
        if stop:
            return  # every rank returns here at this iteration; the engine's close() flushes the last step
        if busy:
            status.phase(_native.PHASE_STEP)
            published += engine.step()
            flushed = False
        elif not flushed:
            status.phase(_native.PHASE_FLUSH)
            published += engine.flush()
            flushed = True
        elif reloading:  # idle, flushed, and every rank has the record: all reach the collective reload together
            status.phase(_native.PHASE_RELOAD)
            reload(engine, outputs, abilities, reload_to.pop())
            reload_to.clear()

        if published and not stopping:
            status.phase(_native.PHASE_PUBLISH)
            try:
                outputs.publish(published, timings=first_times())
            except _native.RingClosed:
                stopping = True  # leave at the next all-reduce, together with the peers
        status.update(force=not busy)
        if not busy and flushed and not stopping:
            status.phase(_native.PHASE_IDLE)
            idle.sleep()
            if requests.closed:
                stopping = True
