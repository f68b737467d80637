"""A simulated engine that fails on purpose, and the sim's named timing profiles (`--engine sim` only).

Operators test gateways, clients, dashboards and alerts against failures, as llm-d-inference-sim allows. Every
option is off by default; every random choice comes from `--sim-fault-seed`, so a run is reproducible for the same
order of arrivals on each rank.

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

Timing profiles (`--sim-profile`) set the defaults of the sim's cost flags; a cost flag given explicitly wins.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import time
from dataclasses import asdict, dataclass
from typing import Any

from deepinfer_server import _native
from deepinfer_server.engine.base import Output, Submit
from deepinfer_server.engine.sim import SimConfig, SimEngine

log = logging.getLogger("deepinfer_server.rank")

EXIT_SIM_CRASH = 70
ERROR_REASON = "sim_engine_error"
ABORT_REASON = "abort"  # DeepInfer's finish reason for a request its scheduler aborted


@dataclass(frozen=True)
class Profile:
    """The sim's cost model: the values of the `--sim-*` cost flags a profile stands for."""

    description: str
    decode_step_ms: float = 0.0
    decode_ms_per_seq: float = 0.0
    prefill_ms_per_1k_tokens: float = 0.0
    overlap_prefill: bool = False
    prefill_chunk_tokens: int = 0
    lockstep: bool = False


PROFILES: dict[str, Profile] = {
    "zero": Profile("every step is free: the engine outpaces any front end (the default)"),
    "paced": Profile(
        "a 10 ms decode step and 50 ms per 1k prompt tokens (bench/bench.py --only paced)",
        decode_step_ms=10.0,
        prefill_ms_per_1k_tokens=50.0,
    ),
    # Calibrated in BENCHMARKS.md against the original 8 x B200 run (DP 8, EP 8) that bench/bench.py --only replay
    # replays: a decode step of 8.5 ms + 0.1 ms per sequence (8.7 ms at that run's ~2 sequences per rank), prefill
    # at 25 ms per 1k tokens, compute-bound prefill chunks of up to 340 tokens hidden under the memory-bound decode
    # step, and the ranks in lockstep. Meant for --dp 8.
    "8xb200": Profile(
        "one node of 8 B200s, DP 8 + EP 8, calibrated on the original benchmark (bench/bench.py --only replay)",
        decode_step_ms=8.5,
        decode_ms_per_seq=0.1,
        prefill_ms_per_1k_tokens=25.0,
        overlap_prefill=True,
        prefill_chunk_tokens=340,
        lockstep=True,
    ),
}

# cost flag (argparse dest) -> Profile field
_COST_FLAGS = {
    "sim_decode_step_ms": "decode_step_ms",
    "sim_decode_ms_per_seq": "decode_ms_per_seq",
    "sim_prefill_ms_per_1k_tokens": "prefill_ms_per_1k_tokens",
    "sim_prefill_chunk_tokens": "prefill_chunk_tokens",
}


def add_arguments(group: argparse._ArgumentGroup) -> None:
    """The profile and fault flags, in the sim's argument group."""
    names = ", ".join(f"{k} ({p.description})" for k, p in PROFILES.items())
    group.add_argument(
        "--sim-profile",
        choices=tuple(PROFILES),
        default="zero",
        help=f"Named cost model; the --sim-* cost flags given explicitly override it. Profiles: {names}.",
    )
    group.add_argument("--sim-fault-seed", type=int, default=0, help="Seed of every injected failure's draw.")
    group.add_argument(
        "--sim-error-rate",
        type=float,
        default=0.0,
        help="Share of requests that end with an engine error instead of their first token (500 / stream error).",
    )
    group.add_argument(
        "--sim-abort-rate",
        type=float,
        default=0.0,
        help="Share of requests the engine aborts part-way through their output (reason 'abort').",
    )
    group.add_argument(
        "--sim-crash-after",
        type=int,
        default=None,
        metavar="N",
        help="Rank --sim-fault-rank exits at once (status 70) when its request N+1 arrives.",
    )
    group.add_argument(
        "--sim-stall-after",
        type=int,
        default=None,
        metavar="N",
        help="Rank --sim-fault-rank stops stepping and stops its heartbeat when its request N+1 arrives "
        "(the watchdog then ends the server).",
    )
    group.add_argument("--sim-fault-rank", type=int, default=0, help="The rank that crashes or stalls.")


def resolve(args: argparse.Namespace) -> str | None:
    """Fill the cost flags left unset (None) from the profile and check the fault flags; an error message or None."""
    profile = PROFILES[args.sim_profile]
    for dest, name in _COST_FLAGS.items():
        if getattr(args, dest) is None:
            setattr(args, dest, getattr(profile, name))
    args.sim_overlap_prefill = args.sim_overlap_prefill or profile.overlap_prefill
    args.sim_lockstep = args.sim_lockstep or profile.lockstep
    for flag in ("sim_error_rate", "sim_abort_rate"):
        if not 0.0 <= getattr(args, flag) <= 1.0:
            return f"--{flag.replace('_', '-')} must be in [0, 1]"
    if args.sim_error_rate + args.sim_abort_rate > 1.0:
        return "--sim-error-rate plus --sim-abort-rate must not exceed 1"
    for flag in ("sim_crash_after", "sim_stall_after"):
        if getattr(args, flag) is not None and getattr(args, flag) < 0:
            return f"--{flag.replace('_', '-')} must not be negative"
    faults = any(getattr(args, f) for f in ("sim_error_rate", "sim_abort_rate")) or any(
        getattr(args, f) is not None for f in ("sim_crash_after", "sim_stall_after")
    )
    if faults and args.engine != "sim":
        return "the --sim-* fault flags need --engine sim"
    if not 0 <= args.sim_fault_rank < (args.data_parallel_size or 1):
        return f"--sim-fault-rank must name a rank (0..{(args.data_parallel_size or 1) - 1})"
    return None


@dataclass(frozen=True)
class Faults:
    """What one rank is to do wrong; sent to it in its config (`rank_config`)."""

    seed: int = 0
    rank: int = 0
    error_rate: float = 0.0
    abort_rate: float = 0.0
    crash_after: int | None = None  # this rank's own limits (None unless it is the fault rank)
    stall_after: int | None = None

    def active(self) -> bool:
        return bool(self.error_rate or self.abort_rate) or self.crash_after is not None or self.stall_after is not None


def rank_config(args: argparse.Namespace, rank: int) -> dict[str, Any] | None:
    """The fault settings of `rank`, or None when it is to behave."""
    mine = rank == args.sim_fault_rank
    faults = Faults(
        seed=args.sim_fault_seed,
        rank=rank,
        error_rate=args.sim_error_rate,
        abort_rate=args.sim_abort_rate,
        crash_after=args.sim_crash_after if mine else None,
        stall_after=args.sim_stall_after if mine else None,
    )
    return asdict(faults) if faults.active() else None


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

    def commit(self) -> list[Output]:
        out = super().commit()
        if not self.fates:
            return out
        failed: list[int] = []
        for i, row in enumerate(out):
            fate = self.fates.get(row[0])
            if fate is None:
                continue
            reason, before, emitted = fate
            if emitted < before:
                fate[2] = emitted + 1
                if row[2] != _native.FINISH_NONE:
                    del self.fates[row[0]]  # it ended by itself first
                continue
            out[i] = (row[0], [], _native.FINISH_ERROR, reason)
            del self.fates[row[0]]
            failed.append(row[0])
        if failed:
            self.quiet_step = False
            super().abort([rid for rid in failed if rid in self.by_id])
        return out


def build(cfg: dict[str, Any], faults: dict[str, Any] | None) -> SimEngine:
    """The rank's sim engine: the plain one unless the rank has faults to inject."""
    if not faults:
        return SimEngine(SimConfig(**cfg))
    return FaultySimEngine(SimConfig(**cfg), Faults(**faults))
