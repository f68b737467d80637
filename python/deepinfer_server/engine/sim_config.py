"""The sim as the server sets it up before any rank starts: its flags (the cost model, its named timing profiles,
the failures to inject), their checks, and each rank's engine config (`launch`, which the sim's entry in
engine/registry.py names). The rank side, the engine that fails on purpose, is engine/sim_faults.py, which says
what each failure does.

Operators test gateways, clients, dashboards and alerts against failures, as llm-d-inference-sim allows. Every
option is off by default; every random choice comes from `--sim-fault-seed`, so a run is reproducible for the same
order of arrivals on each rank.

Timing profiles (`--sim-profile`) set the defaults of the sim's cost flags; a cost flag given explicitly wins.

Nothing here imports the sim itself: the server runs this, and the ranks of every engine import it with the
registry.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deepinfer_server.engine.base import RankLaunch
from deepinfer_server.engine.deepinfer_config import prefill_interval


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
    """The sim's flags, in its argument group: its cost model, the profile, the failures to inject."""
    # The cost flags default to the --sim-profile's values (`resolve` fills them in).
    group.add_argument("--sim-prefill-ms-per-1k-tokens", type=float, default=None, help="Prefill cost; 0 = free.")
    group.add_argument("--sim-decode-step-ms", type=float, default=None, help="Decode step time; 0 = free.")
    group.add_argument(
        "--sim-decode-ms-per-seq", type=float, default=None, help="Extra step time per decoding sequence."
    )
    group.add_argument(
        "--sim-overlap-prefill",
        action="store_true",
        help="A step costs max(decode, prefill) (memory-bound decode hides a compute-bound prefill chunk) "
        "instead of their sum.",
    )
    group.add_argument(
        "--sim-prefill-chunk-tokens",
        type=int,
        default=None,
        help="Largest prefill chunk per request and step; 0 = budget.",
    )
    group.add_argument(
        "--sim-prefill-vote-ms",
        type=float,
        default=None,
        help="Model DeepInfer's prefill vote: a decoding rank starts new prompts only at vote points, every "
        "--prefill-any-attempt-interval / --prefill-attempt-interval steps, and each vote point adds this many ms "
        "(an all-reduce over the DP group). Unset: no vote, prompts start at any step.",
    )
    group.add_argument(
        "--sim-lockstep",
        action="store_true",
        help="DP ranks step together, each step as long as the slowest rank's (as DeepInfer's ranks do).",
    )
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
    if not 0 <= args.sim_fault_rank < (args.data_parallel_size or 1):
        return f"--sim-fault-rank must name a rank (0..{(args.data_parallel_size or 1) - 1})"
    return None


def refuse_faults(args: argparse.Namespace) -> str | None:
    """The check of an engine that cannot fail on purpose (its entry's): no fault flag may be given."""
    faults = any(getattr(args, f) for f in ("sim_error_rate", "sim_abort_rate")) or any(
        getattr(args, f) is not None for f in ("sim_crash_after", "sim_stall_after")
    )
    return "the --sim-* fault flags need --engine sim" if faults else None


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


def script_seed(model_dir: str | Path | None, rank: int = 0) -> int:
    """The sim's script seed a checkpoint's config.json sets (`sim_script_seed`, 0 without one): checkpoints with
    different seeds answer the same prompt differently, as different weights would, so a weight reload shows.
    `sim_load_error` in it makes loading the checkpoint fail with that message (a broken checkpoint) on every rank,
    or on the ranks `sim_load_error_ranks` lists."""
    if model_dir is None:
        return 0
    config = Path(model_dir) / "config.json"
    settings = json.loads(config.read_text(encoding="utf-8")) if config.is_file() else {}
    if settings.get("sim_load_error") and rank in settings.get("sim_load_error_ranks", [rank]):
        raise RuntimeError(f"{config}: {settings['sim_load_error']}")
    return int(settings.get("sim_script_seed", 0))


def launch(args: argparse.Namespace, tokenizer: Path, env: Mapping[str, str]) -> list[RankLaunch]:
    """Each rank's engine config (engine/sim.py `SimConfig`, and under "faults" what it is to do wrong); the sim
    needs no variables of its own. DeepInfer's prefill-vote intervals count as DeepInfer's do, since the sim models
    that vote."""
    config = {
        "tokenizer_path": str(tokenizer),
        "script_seed": script_seed(getattr(args, "model_dir", None)),
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "decode_step_ms": args.sim_decode_step_ms,
        "prefill_ms_per_1k_tokens": args.sim_prefill_ms_per_1k_tokens,
        "decode_ms_per_seq": args.sim_decode_ms_per_seq,
        "overlap_prefill": args.sim_overlap_prefill,
        "prefill_chunk_tokens": args.sim_prefill_chunk_tokens,
        "vote_ms": args.sim_prefill_vote_ms,
        "vote_every_all": prefill_interval(args, "prefill_attempt_interval", env),
        "vote_every_any": prefill_interval(args, "prefill_any_attempt_interval", env),
    }
    return [
        RankLaunch({**config, "rank": rank, "faults": rank_config(args, rank)}, {})
        for rank in range(args.data_parallel_size)
    ]
