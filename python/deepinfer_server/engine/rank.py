"""Rank process: one per DP rank, run as `python -m deepinfer_server.engine.rank --config JSON`.

It maps the rings the launcher made, builds its engine through the engine's entry (engine/registry.py), reports
READY, and runs the loop its engine needs (engine/loop.py `serve_rank` or `serve_sim_lockstep`, engine/lockstep.py
`serve_lockstep`) until the server says stop. An error it cannot contain ends it at once (`die`); the server turns
that into 503s and exits.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import sys
import time
from typing import TYPE_CHECKING, Any, NoReturn, cast

from deepinfer_server import _native, logs
from deepinfer_server.engine.base import Ability, Engine
from deepinfer_server.engine.loop import serve_rank, serve_sim_lockstep
from deepinfer_server.engine.registry import EngineEntry, engine_named
from deepinfer_server.reaper import die_with_parent

if TYPE_CHECKING:
    from deepinfer_server.engine.sim import SimEngine

log = logging.getLogger("deepinfer_server.rank")

EXIT_FATAL = 3  # the rank hit an error outside any one request (see `die`)


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


def build_engine(entry: EngineEntry, cfg: dict[str, Any]) -> Engine:
    """This rank's engine, from its entry point, at the CPU priority its entry asks for."""
    if entry.nice:
        os.nice(entry.nice)
    return entry.rank_entry()(cfg)


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
    die_with_parent(conf["parent_pid"])
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
        entry = engine_named(conf["engine"])
        engine = build_engine(entry, conf["engine_config"])
    except Exception as e:
        log.exception("rank %d: engine failed to start: %s", rank, e)
        outputs.set_aux(_native.AUX_STATE, _native.STATE_FAILED)
        if lock is not None:
            lock.close()  # never leave the other ranks waiting on a party that is gone
        return 1
    partial = int(conf.get("max_num_partial_prefills") or 0)
    long_partial = int(conf.get("max_long_partial_prefills") or 0)
    if (partial > 0 or long_partial > 0) and Ability.FIRST_TOKEN_TIMES in entry.abilities:  # what the gate counts with
        from deepinfer_server.engine.prefill_gate import PrefillGate

        engine = PrefillGate(engine, partial, long_partial, int(conf.get("long_prefill_token_threshold") or 0))
    outputs.set_aux(_native.AUX_HEARTBEAT_MS, int(time.monotonic() * 1000))
    outputs.set_aux(_native.AUX_STATE, _native.STATE_READY)
    log.info("rank %d ready (engine %s)", rank, conf["engine"])
    try:
        if lock is not None and bell is not None:  # the launcher's barrier: the ranks step together at it
            serve_sim_lockstep(cast("SimEngine", engine), requests, outputs, lock, bell, abilities=entry.abilities)
        elif Ability.COLLECTIVES in entry.abilities:
            from deepinfer_server.engine.lockstep import serve_lockstep

            assert bell is not None, "the launcher gives ranks that step together their group's doorbell"
            serve_lockstep(engine, requests, outputs, bell, abilities=entry.abilities)  # DP ranks step together
        else:
            serve_rank(engine, requests, outputs, conf.get("stream_interval_ms", 0.0), abilities=entry.abilities)
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
