"""DeepInfer's deployment, as the server checks and derives it before any rank starts: its serving environment
defaults, the output-pool bound of --max-num-seqs, each rank's GPUs and rendezvous (MASTER_PORT), and what its
entry in the engine registry (engine/registry.py) names: the command line's checks and each rank's launch; the
same for the tests' fake DeepInfer (`--engine fake-deepinfer`), which differs only in where its ranks import
deepinfer from.

Nothing here imports numpy, torch or deepinfer: the launcher runs it in the server process, which has none of them.
The rank side (the engine itself) is engine/deepinfer.py.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deepseek_recipe import SpecialToken

from deepinfer_server.engine.base import ConfigError, RankLaunch

# Serving defaults, put into the environment before deepinfer is imported (it caches DEEPINFER_* on first read and
# evaluates some as parameter defaults when `deepinfer.config` is imported). `setdefault`: the operator's
# environment wins. They must be identical on all ranks (they change step types and collective schedules).
SERVING_ENV_DEFAULTS: dict[str, str] = {
    # Prefill as soon as any rank has a waiting prompt (the defaults 70/100 make a lone request wait up to 100
    # decode steps, even on an idle server).
    "DEEPINFER_PREFILL_ATTEMPT_INTERVAL": "1",
    "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL": "1",
    # Text only: no 8 GiB pinned shared-memory pool per rank.
    "DEEPINFER_USE_MULTIMODAL_POOL": "0",
    # Speculative decoding off unless the operator's environment turns it on.
    "DEEPINFER_USE_NEXTN_DECODE": "0",
    "TOKENIZERS_PARALLELISM": "false",
}
# deepinfer 0.1.0 and torch as the tests' stand-ins (tests/fake_deepinfer/README.md): in a source checkout only.
FAKE_DEEPINFER = Path(__file__).resolve().parents[3] / "tests" / "fake_deepinfer"
# Server flags for DeepInfer's scheduler settings, which it reads from the environment (identical on every rank).
PREFILL_INTERVAL_FLAGS = {
    "prefill_attempt_interval": "DEEPINFER_PREFILL_ATTEMPT_INTERVAL",
    "prefill_any_attempt_interval": "DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL",
}


# DeepInfer's RequestOutputs come from a fixed pool (csrc/engine/outputs.hpp: RequestOutputPool::max_size); an
# allocation from an empty pool throws inside step(), which ends the rank.
OUTPUT_POOL_SIZE = 10_000


def live_outputs_bound(max_num_seqs: int, nextn: int) -> int:
    """The most RequestOutputs one rank can hold at once, for S = max_num_seqs and nextn draft tokens.

    From the 0.1.0 source: a step's outputs are queued for release when it returns (`_execute_model_async_step`,
    `flush_inflight_reqs`) and freed in the *next* step's `pre_sampler_sync` (llm_engine.py), which the worker
    calls only after it has post-processed the previous async step (worker.py `execute_model_step`: forward,
    post-process previous, sample, pre_sampler_sync, post-process current if prompt). So while step k allocates
    the previous decode step's outputs, the outputs step k-1 returned are still live: with two decode steps in a
    row (or a decode step and a flush) that is 2 x S x (1 + nextn), each request emitting up to 1 + nextn tokens
    per step. A prompt step is post-processed in place after the release and adds at most one first token per
    request, and terminal outputs without a token (aborted while waiting, prompt too long, preempted) come from
    `ignored_seqs`; S more covers those. Bound: 2 x S x (1 + nextn) + S.
    """
    return 2 * max_num_seqs * (1 + max(0, nextn)) + max_num_seqs


def check_output_pool(max_num_seqs: int, env: Mapping[str, str]) -> None:
    """Refuse a configuration whose live RequestOutputs can exceed DeepInfer's pool. Raises ConfigError."""
    raw = env.get("DEEPINFER_USE_NEXTN_DECODE", SERVING_ENV_DEFAULTS["DEEPINFER_USE_NEXTN_DECODE"]) or "0"
    try:
        nextn = max(0, int(raw))
    except ValueError:
        raise ConfigError(f"the DEEPINFER_USE_NEXTN_DECODE value {raw!r} is not an integer") from None
    need = live_outputs_bound(max_num_seqs, nextn)
    if need <= OUTPUT_POOL_SIZE:
        return
    max_seqs = OUTPUT_POOL_SIZE // (2 * (1 + nextn) + 1)
    max_nextn = (OUTPUT_POOL_SIZE - max_num_seqs) // (2 * max_num_seqs) - 1
    nextn_hint = (
        f"or DEEPINFER_USE_NEXTN_DECODE <= {max_nextn}" if max_nextn >= 0 else "(no DEEPINFER_USE_NEXTN_DECODE fits)"
    )
    raise ConfigError(
        f"--max-num-seqs {max_num_seqs} with DEEPINFER_USE_NEXTN_DECODE={nextn} can keep up to 2 x {max_num_seqs} x "
        f"(1 + {nextn}) + {max_num_seqs} = {need} RequestOutputs alive per rank, more than DeepInfer's fixed pool of "
        f"{OUTPUT_POOL_SIZE} (step() would fail once it runs out): use --max-num-seqs <= {max_seqs} {nextn_hint}"
    )


def serving_env_defaults(env: dict[str, str] | None = None) -> None:
    """Apply `SERVING_ENV_DEFAULTS` to `env` (default: `os.environ`) without overriding what is set."""
    target: Any = os.environ if env is None else env
    for k, v in SERVING_ENV_DEFAULTS.items():
        target.setdefault(k, v)


# -- GPUs and rendezvous -----------------------------------------------------------------------------------------


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def pick_master_port(host: str, http_port: int, engine_group_rank: int = 0) -> int:
    """A MASTER_PORT whose rendezvous port (MASTER_PORT - 50 + engine_group_rank) is free and not the HTTP port."""
    for _ in range(64):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            rendezvous = int(s.getsockname()[1])
        master = rendezvous + 50 - engine_group_rank
        if rendezvous != http_port and 0 < master < 65536 and _port_free(host, rendezvous):
            return master
    raise ConfigError("no free port found for DeepInfer's rendezvous; set MASTER_PORT explicitly")


def check_master_port(master_port: int, host: str, http_port: int, engine_group_rank: int = 0) -> None:
    """Fail with a message naming MASTER_PORT when DeepInfer's rendezvous port is unusable."""
    rendezvous = master_port - 50 + engine_group_rank
    where = f"DeepInfer rendezvous port MASTER_PORT - 50 + engine_group_rank = {master_port} - 50 + {engine_group_rank}"
    if not 0 < rendezvous < 65536:
        raise ConfigError(f"{where} = {rendezvous} is not a valid TCP port; choose another MASTER_PORT")
    if rendezvous == http_port:
        raise ConfigError(f"{where} = {rendezvous} is the HTTP --port; choose another MASTER_PORT or --port")
    if not _port_free(host, rendezvous):
        raise ConfigError(f"{where} = {rendezvous} is already in use on {host}; choose another MASTER_PORT")


def _gpu_ids(env: Mapping[str, str], need: int) -> list[str]:
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None or not raw.strip():
        return [str(i) for i in range(need)]
    ids = [x.strip() for x in raw.split(",") if x.strip()]
    if not all(x.isdigit() for x in ids):
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={raw!r}: DeepInfer needs integer GPU ids (it parses them with int()), not UUIDs"
        )
    if len(ids) < need:
        raise ConfigError(
            f"CUDA_VISIBLE_DEVICES={raw!r} lists {len(ids)} GPU(s) but DP x CP = {need} are needed "
            "(one GPU per DP rank and context-parallel worker)"
        )
    return ids


def rank_dist_env(
    rank: int, dp: int, cp: int, http_port: int, env: Mapping[str, str], master_port: int | None = None
) -> dict[str, str]:
    """The variables one DP rank's process needs: its GPUs and the shared rendezvous.

    CUDA_VISIBLE_DEVICES: the rank's CP GPUs (integer ids, its driver GPU first), sliced from the server's own
    CUDA_VISIBLE_DEVICES if set, else 0..DP*CP-1. MASTER_ADDR/MASTER_PORT: the operator's, checked, or
    `master_port` (pick it once with `pick_master_port` and pass the same value for every rank).
    """
    ids = _gpu_ids(env, dp * cp)[rank * cp : (rank + 1) * cp]
    out = {"CUDA_VISIBLE_DEVICES": ",".join(ids), "MASTER_ADDR": env.get("MASTER_ADDR", "127.0.0.1")}
    if env.get("DEEPINFER_ACCELERATOR", "nvidia") == "ascend":
        out["ASCEND_RT_VISIBLE_DEVICES"] = out["CUDA_VISIBLE_DEVICES"]
    if "MASTER_PORT" in env:
        out["MASTER_PORT"] = env["MASTER_PORT"]
    elif master_port is not None:
        out["MASTER_PORT"] = str(master_port)
    else:
        raise ConfigError("MASTER_PORT is not set: pick one with pick_master_port() and share it across the ranks")
    serving_env_defaults(out)
    for k in SERVING_ENV_DEFAULTS:  # the operator's value wins
        if k in env:
            out[k] = env[k]
    return out


def dist_env_for_ranks(dp: int, cp: int, http_port: int, env: Mapping[str, str]) -> list[dict[str, str]]:
    """`rank_dist_env` for every DP rank, with one checked or freshly picked MASTER_PORT. Raises ConfigError."""
    host = env.get("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" in env:
        try:
            master = int(env["MASTER_PORT"])
        except ValueError:
            raise ConfigError(f"MASTER_PORT={env['MASTER_PORT']!r} is not an integer") from None
        check_master_port(master, host if host not in ("localhost",) else "127.0.0.1", http_port)
    else:
        master = pick_master_port("127.0.0.1" if host == "localhost" else host, http_port)
    return [rank_dist_env(r, dp, cp, http_port, env, master) for r in range(dp)]


def rendezvous_hint() -> str:
    """What a failed rendezvous should tell the operator (a rank adds it to the error)."""
    port = os.environ.get("MASTER_PORT", "23333")
    try:
        rdv = str(int(port) - 50)
    except ValueError:
        rdv = "?"
    return (
        f" (DeepInfer's rendezvous is tcp://{os.environ.get('MASTER_ADDR', 'localhost')}:MASTER_PORT-50"
        f"+engine_group_rank = port {rdv} with MASTER_PORT={port}: it must be free, differ from the HTTP port and be "
        "the same for every rank; set another MASTER_PORT)"
    )


# -- the registry's entry ------------------------------------------------------------------------------------------


def prefill_interval(args: argparse.Namespace, flag: str, env: Mapping[str, str] = os.environ) -> int:
    """A prefill-vote interval as DeepInfer sees it: the flag, else its environment variable, else 1."""
    value = getattr(args, flag, None)
    return int(value if value is not None else env.get(PREFILL_INTERVAL_FLAGS[flag], "1"))


def image_placeholder_id(tokenizer: Path) -> int | None:
    """The serving tokenizer's ID for deepseek-recipe's image placeholder `<｜image｜>`, if it has one."""
    spelling = SpecialToken.Image.default_str()
    added = json.loads(tokenizer.read_text(encoding="utf-8")).get("added_tokens") or []
    return next((int(t["id"]) for t in added if t.get("content") == spelling), None)


def check(args: argparse.Namespace) -> str | None:
    """The command line's check: DeepInfer loads a checkpoint, it has no bundled tokenizer to fall back on."""
    return None if args.model else f"MODEL is required with --engine {args.engine}"


def launch(args: argparse.Namespace, tokenizer: Path, env: Mapping[str, str]) -> list[RankLaunch]:
    """Each DP rank's engine config and variables: its GPUs, the shared rendezvous (one MASTER_PORT) and the
    prefill-vote intervals the flags set. Raises ConfigError before any rank starts."""
    check_output_pool(args.max_num_seqs, env)
    dist_envs = dist_env_for_ranks(args.data_parallel_size, args.context_parallel_size, args.port, env)
    config = {
        "model": args.model_dir,
        "trust_remote_code": args.trust_remote_code,
        "expert_parallel_size": args.expert_parallel_size,
        "data_parallel_size": args.data_parallel_size,
        "context_parallel_size": args.context_parallel_size,
        "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "disable_log_stats": args.disable_log_stats,
        "image_placeholder_id": image_placeholder_id(tokenizer),
    }
    ranks = []
    for rank, rank_env in enumerate(dist_envs):
        for flag, var in PREFILL_INTERVAL_FLAGS.items():  # the flag wins over the environment
            if getattr(args, flag, None) is not None:
                rank_env[var] = str(getattr(args, flag))
        ranks.append(RankLaunch({**config, "engine_rank": rank}, rank_env))
    return ranks


def check_fake(args: argparse.Namespace) -> str | None:
    """The fake's own check: an installed package has no tests/ to run it from."""
    if FAKE_DEEPINFER.is_dir():
        return None
    return f"--engine {args.engine} runs tests/fake_deepinfer of a source checkout; there is none at {FAKE_DEEPINFER}"


def launch_fake(args: argparse.Namespace, tokenizer: Path, env: Mapping[str, str]) -> list[RankLaunch]:
    """DeepInfer's launch with tests/fake_deepinfer first on each rank's import path: the ranks, and the engine's
    workers they start (which inherit it), import the fake `deepinfer` and `torch`."""
    path = env.get("PYTHONPATH")
    first = f"{FAKE_DEEPINFER}{os.pathsep}{path}" if path else str(FAKE_DEEPINFER)
    return [RankLaunch(cfg, {**rank_env, "PYTHONPATH": first}) for cfg, rank_env in launch(args, tokenizer, env)]
