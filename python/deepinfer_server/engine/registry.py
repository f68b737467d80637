"""The engines behind the ranks, one entry each: the only place that tells them apart by name.

An entry holds what the rest of the server would otherwise learn by testing `--engine`: the engine's command-line
checks, how the launcher sets up each rank (its engine config and environment, its allocator and CPU priority), its
optional abilities (engine/base.py `Ability`; how its ranks step follows from them), and the rank's entry point,
which only the rank process imports. The CLI offers the entries as `--engine`, ranks.py launches through them, and
engine/rank.py builds its engine and picks its loop from them.

- `sim`: the simulated engine (engine/sim.py, with failures injected by engine/sim_faults.py); its server side,
  profiles and failures, is engine/sim_config.py.
- `deepinfer`: DeepInfer (engine/deepinfer.py); its server side, the deployment checks, is
  engine/deepinfer_config.py.
- `fake-deepinfer`: the same adapter on tests/fake_deepinfer, a faithful fake of deepinfer and torch, so that the
  tests and bench/prefill_intervals.py run DeepInfer's path without GPUs. Not offered in --help.

Adding an engine: a module with its `Engine` and a `build(engine_config)` for the rank, server-side functions for
its checks and `launch` in a module that imports nothing heavy (every rank imports this table and what it names),
and its entry below. Nothing else changes: no other module compares engine names (tests/test_engines.py checks).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from deepinfer_server.engine import deepinfer_config, sim_config
from deepinfer_server.engine.base import Ability, Engine, RankLaunch

# One command-line check of an engine's: an error message naming the flags involved, or None.
Check = Callable[[argparse.Namespace], str | None]
# Each rank's engine config and environment, from the checked arguments, the tokenizer and the server's environment;
# raises ConfigError (engine/base.py) for a setting the engine cannot run with, before any rank starts.
Launch = Callable[[argparse.Namespace, Path, Mapping[str, str]], list[RankLaunch]]


class Stepping(Enum):
    """How a server's ranks step: it decides their loop (engine/rank.py), the files they share (ranks.py) and
    whether long prompts wait to go to them together (cli.py, --dispatch-gather-ms)."""

    ALONE = "alone"  # each rank on its own (engine/loop.py `serve_rank`)
    BARRIER = "barrier"  # together at the server's barrier, _native.Lockstep (engine/loop.py `serve_sim_lockstep`)
    COLLECTIVES = "collectives"  # together through the engine's own all-reduce (engine/lockstep.py `serve_lockstep`)


@dataclass(frozen=True)
class EngineEntry:
    """One engine, as the CLI, the launcher and the rank process see it."""

    name: str  # its --engine value
    build: str  # "module:function", engine config -> Engine: the rank's entry point, imported in the rank only
    launch: Launch
    checks: tuple[Check, ...] = ()  # its own command-line checks, in order
    abilities: frozenset[Ability] = frozenset()
    # The ranks keep the server's preloaded allocator (mimalloc); a GPU engine's get the system's back (CUDA, torch).
    shares_allocator: bool = False
    nice: int = 0  # the rank lowers its CPU priority by this much once started
    hidden: bool = False  # not offered in --help: a stand-in for tests and benchmarks

    def check(self, args: argparse.Namespace) -> str | None:
        """The first of the engine's checks that fails, or None."""
        for check in self.checks:
            err = check(args)
            if err:
                return err
        return None

    def stepping(self, args: argparse.Namespace) -> Stepping:
        """How the ranks step with these arguments: an engine that steps through its collectives always does."""
        if Ability.COLLECTIVES in self.abilities:
            return Stepping.COLLECTIVES
        if Ability.BARRIER in self.abilities and args.sim_lockstep:
            return Stepping.BARRIER
        return Stepping.ALONE

    def rank_entry(self) -> Callable[[dict[str, Any]], Engine]:
        """The rank's entry point, imported now: the server never imports an engine, a rank only its own."""
        module, _, function = self.build.partition(":")
        entry: Callable[[dict[str, Any]], Engine] = getattr(importlib.import_module(module), function)
        return entry


SIM = EngineEntry(
    "sim",
    build="deepinfer_server.engine.sim_faults:build",
    launch=sim_config.launch,
    abilities=frozenset({Ability.FIRST_TOKEN_TIMES, Ability.BARRIER, Ability.RELOAD}),
    shares_allocator=True,
    # The simulated engine stands in for a GPU: it should not take host CPU from the server's request handling (a
    # real engine's step runs on the device, not on the cores the front end uses).
    nice=10,
)
DEEPINFER = EngineEntry(
    "deepinfer",
    build="deepinfer_server.engine.deepinfer_build:build",
    launch=deepinfer_config.launch,
    checks=(sim_config.refuse_faults, deepinfer_config.check),
    abilities=frozenset({Ability.FIRST_TOKEN_TIMES, Ability.COUNTERS, Ability.COLLECTIVES, Ability.RELOAD}),
)
# DeepInfer in all but where its ranks import deepinfer and torch from.
FAKE_DEEPINFER = dataclasses.replace(
    DEEPINFER,
    name="fake-deepinfer",
    launch=deepinfer_config.launch_fake,
    checks=(*DEEPINFER.checks, deepinfer_config.check_fake),
    hidden=True,
)

ENGINES: dict[str, EngineEntry] = {entry.name: entry for entry in (SIM, DEEPINFER, FAKE_DEEPINFER)}


def engine_named(name: str) -> EngineEntry:
    """The entry of `name`; a ValueError for a name the table does not hold."""
    entry = ENGINES.get(name)
    if entry is None:
        raise ValueError(f"unknown engine {name!r} (known: {', '.join(ENGINES)})")
    return entry
