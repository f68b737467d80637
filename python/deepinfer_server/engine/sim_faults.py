"""A simulated engine that fails on purpose (`--engine sim` only): the rank side of the failures engine/sim_config.py
sets up.

Failure kinds (docs/deploy.md has the table of what a client sees):

* `--sim-error-rate P`: that share of requests ends with an engine error where its first token would have been
  (FINISH_ERROR, reason `sim_engine_error`): a JSON request gets 500 `engine_error`, a stream its error event and
  `[DONE]`; counted in `deepinfer_aborted_requests_total{reason="engine_error"}`.
* `--sim-abort-rate P`: that share of requests is aborted by the engine part-way through its output (reason
  `abort`, as DeepInfer reports a request it aborted): the text so far, then the error;
  `deepinfer_aborted_requests_total{reason="engine_abort"}`.
* `--sim-crash-after N`: rank `--sim-fault-rank` (0) exits at once, without cleanup (status 70), when its
  (N+1)-th request arrives: its first N requests are served. The server fails what the rank held, turns /health
  503 and exits with status 1 (`--exit-on-rank-failure`).
* `--sim-stall-after N`: that rank stops stepping when its (N+1)-th request arrives: no more tokens and no
  heartbeat, the process stays alive (a hung collective or kernel). `deepinfer_rank_heartbeat_age_seconds` grows
  until the watchdog (`--watchdog-timeout`) declares the rank hung and the server exits with status 1.
"""

from __future__ import annotations

import logging
import os
import random
import time
from typing import Any

from deepinfer_server import _native
from deepinfer_server.engine.base import Output, Published, Submit, failed, rows
from deepinfer_server.engine.sim import SimConfig, SimEngine
from deepinfer_server.engine.sim_config import Faults

log = logging.getLogger("deepinfer_server.rank")

EXIT_SIM_CRASH = 70
ERROR_REASON = "sim_engine_error"
ABORT_REASON = "abort"  # DeepInfer's finish reason for a request its scheduler aborted


class FaultySimEngine(SimEngine):
    """The simulated engine with the failures of `Faults` injected; otherwise the same engine (lockstep too)."""

    def __init__(self, cfg: SimConfig, faults: Faults) -> None:
        super().__init__(cfg)
        self.faults = faults
        self.rng = random.Random(f"deepinfer-sim-faults:{faults.seed}:{faults.rank}")
        self.arrivals = 0
        self.stalled = False
        # request id -> [reason, tokens to emit before it, tokens emitted so far]
        self.fates: dict[int, list[Any]] = {}

    def add(self, req: Submit) -> list[Output]:
        f = self.faults
        self.arrivals += 1
        if f.crash_after is not None and self.arrivals > f.crash_after:
            log.critical(
                "rank %d: sim fault: crashing on request %d (--sim-crash-after %d)",
                f.rank,
                self.arrivals,
                f.crash_after,
            )
            logging.shutdown()
            os._exit(EXIT_SIM_CRASH)
        if f.stall_after is not None and self.arrivals > f.stall_after and not self.stalled:
            log.critical(
                "rank %d: sim fault: stalling on request %d (--sim-stall-after %d): no more steps or heartbeats",
                f.rank,
                self.arrivals,
                f.stall_after,
            )
            self.stalled = True
        out = super().add(req)
        draw = self.rng.random()  # one draw per arrival, whatever the rates: the seed fixes each request's fate
        at = self.rng.randrange(1 << 30)
        if out or req.request_id not in self.by_id:
            return out
        if draw < f.error_rate:
            self.fates[req.request_id] = [ERROR_REASON, 0, 0]
        elif draw < f.error_rate + f.abort_rate:
            seq = self.by_id[req.request_id]
            # Part-way: at least one token first, and the abort comes before the request could end by itself.
            self.fates[req.request_id] = [ABORT_REASON, 1 + at % max(1, seq.max_tokens - 1), 0]
        return out

    def abort(self, request_ids: list[int]) -> None:
        for rid in request_ids:
            self.fates.pop(rid, None)
        super().abort(request_ids)

    def plan(self) -> float:
        if self.stalled:
            while True:  # a hung step: alive, silent; only a SIGKILL (the watchdog's, or the server's) ends it
                time.sleep(3600)
        return super().plan()

    def commit(self) -> list[Published]:
        published = super().commit()
        if not self.fates:
            return published
        out = rows(published)  # a fate replaces a plain row too: one Output per row
        ended: list[int] = []
        for i, row in enumerate(out):
            rid = row.request_id
            fate = self.fates.get(rid)
            if fate is None:
                continue
            reason, before, emitted = fate
            if emitted < before:
                fate[2] = emitted + 1
                if row.finish != _native.FINISH_NONE:
                    del self.fates[rid]  # it ended by itself first
                continue
            out[i] = failed(rid, reason)
            del self.fates[rid]
            ended.append(rid)
        if ended:
            self.quiet_step = False
            super().abort([rid for rid in ended if rid in self.by_id])
        return [*out]


def build(engine_config: dict[str, Any]) -> SimEngine:
    """The sim rank's entry point (engine/registry.py): the plain engine unless its config names failures to inject
    (sim_config.py `launch`)."""
    cfg = dict(engine_config)
    faults = cfg.pop("faults", None)
    if not faults:
        return SimEngine(SimConfig(**cfg))
    return FaultySimEngine(SimConfig(**cfg), Faults(**faults))
