"""Building a DeepInfer engine in a rank: `build`, the registry's entry point, which a weight reload calls again
(engine/deepinfer.py `DeepInferEngine.reload`) with another checkpoint. Nothing imports numpy, torch or deepinfer
before it runs, in the rank."""

from __future__ import annotations

import errno
import logging
import os
from typing import Any

from deepinfer_server.engine.base import ConfigError
from deepinfer_server.engine.deepinfer import DeepInferEngine
from deepinfer_server.engine.deepinfer_config import rendezvous_hint, serving_env_defaults

log = logging.getLogger("deepinfer_server.deepinfer")


def build(cfg: dict[str, Any]) -> DeepInferEngine:
    """Construct (and thereby warm up: profiling run, KV allocation, CUDA graphs) this rank's LLMEngine.

    `cfg`: model, trust_remote_code, expert/data/context_parallel_size, engine_rank, max_model_len, max_num_seqs,
    max_num_batched_tokens, gpu_memory_utilization; optional engine_group_rank, disable_log_stats, seed.
    Collective: every DP rank must call it.
    """
    serving_env_defaults()
    raw = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if not raw or not all(x.strip().isdigit() for x in raw.split(",")):
        raise ConfigError(f"CUDA_VISIBLE_DEVICES={raw!r}: DeepInfer needs it set to integer GPU ids")
    nextn = int(os.environ.get("DEEPINFER_USE_NEXTN_DECODE", "5") or 0)
    max_num_seqs = int(cfg["max_num_seqs"])
    batched = cfg.get("max_num_batched_tokens")
    if batched is not None and int(batched) < max_num_seqs * (1 + max(0, nextn)):
        raise ConfigError(
            f"--max-num-batched-tokens {batched} is below --max-num-seqs x (1 + DEEPINFER_USE_NEXTN_DECODE) = "
            f"{max_num_seqs} x {1 + nextn}: every running sequence needs room for its draft tokens"
        )

    import numpy as np
    import torch
    import torch.distributed as dist
    from deepinfer._C.engine import RequestOutput
    from deepinfer.engine.arg_utils import EngineArgs
    from deepinfer.engine.llm_engine import LLMEngine
    from deepinfer.environ import envs
    from deepinfer.model_executor.parallel_utils.parallel_state import PG
    from deepinfer.sampling_params import SamplingParams

    args = EngineArgs(
        model=str(cfg["model"]),
        trust_remote_code=bool(cfg.get("trust_remote_code", False)),
        seed=int(cfg.get("seed", 0)),
        expert_parallel_size=int(cfg["expert_parallel_size"]),
        data_parallel_size=int(cfg["data_parallel_size"]),
        context_parallel_size=int(cfg["context_parallel_size"]),
        engine_rank=int(cfg["engine_rank"]),
        engine_group_rank=int(cfg.get("engine_group_rank", 0)),
        max_model_len=int(cfg["max_model_len"]),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=None if batched is None else int(batched),
        gpu_memory_utilization=float(cfg["gpu_memory_utilization"]),
        stop_preempted_request=False,  # recompute preempted requests instead of failing them
        disable_log_stats=bool(cfg.get("disable_log_stats", False)),
    )
    try:
        engine = LLMEngine.from_engine_args(args)
    except Exception as e:
        text = str(e).lower()
        if isinstance(e, OSError) and e.errno in (errno.EADDRINUSE, errno.ECONNREFUSED):
            raise RuntimeError(f"{e}{rendezvous_hint()}") from e
        if any(s in text for s in ("address already in use", "connection refused", "rendezvous")):
            raise RuntimeError(f"{e}{rendezvous_hint()}") from e
        raise
    return DeepInferEngine(
        engine,
        cfg=dict(cfg),
        build=build,
        max_model_len=int(engine.scheduler_config.max_model_len),
        np=np,
        torch=torch,
        dist=dist,
        request_output=RequestOutput,
        sampling_params=SamplingParams,
        dp_group=PG.cpu_data_parallel_group(),
        image_placeholder_id=cfg.get("image_placeholder_id"),
        # Under YoCo prefill truncation the engine turns prompt_logprobs off (llm_engine.py:529-537) and the request
        # would come back without them: such requests are refused instead.
        prompt_logprobs=str(envs.DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE) == "off",
    )
