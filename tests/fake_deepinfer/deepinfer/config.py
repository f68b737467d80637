"""Fake of deepinfer/config.py: the same checks on the same arguments, without the model config parsing."""

from __future__ import annotations

import json
from pathlib import Path

from deepinfer.environ import envs


def _get_max_num_batched_tokens(max_model_len: int, max_num_batched_tokens: int | None, max_num_seqs: int) -> int:
    max_num_decoding_tokens = max_num_seqs * (1 + envs.DEEPINFER_USE_NEXTN_DECODE)
    if max_num_batched_tokens is not None:
        assert max_num_batched_tokens >= max_num_decoding_tokens
        return max_num_batched_tokens
    return max(max_model_len, 4096, max_num_decoding_tokens)


class ModelConfig:
    def __init__(
        self,
        model,
        tokenizer,
        trust_remote_code,
        load_format,
        seed,
        max_num_seqs,
        revision,
        tokenizer_revision,
        max_model_len,
        max_num_batched_tokens,
        ignore_len,
        served_model_name,
        engine_type,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.trust_remote_code = trust_remote_code
        self.load_format = load_format
        self.seed = seed
        self.max_model_len = 4096 if max_model_len is None else max_model_len
        self.max_num_batched_tokens = _get_max_num_batched_tokens(
            self.max_model_len, max_num_batched_tokens, max_num_seqs
        )
        self.served_model_name = served_model_name
        self.engine_type = engine_type
        cfg = json.loads((Path(model) / "config.json").read_text())
        if cfg.get("model_type") != "deepseek_v41":
            raise ValueError(f"unsupported model_type {cfg.get('model_type')!r}")
        self.hf_config = cfg

    def get_vocab_size(self) -> int:
        return int(self.hf_config.get("vocab_size", 129280))


class CacheConfig:
    def __init__(self, block_size: int, gpu_memory_utilization: float, lookahead_tokens: int) -> None:
        self.block_size = block_size
        self.gpu_memory_utilization = gpu_memory_utilization
        self.lookahead_tokens = lookahead_tokens
        self.num_gpu_blocks = None  # set after profiling


class ParallelConfig:
    def __init__(
        self,
        data_parallel_size,
        context_parallel_size,
        expert_parallel_size,
        engram_parallel_size,
        engine_rank,
        engine_group_rank,
        engine_type,
    ) -> None:
        cp, ep = context_parallel_size, expert_parallel_size
        dp = data_parallel_size if data_parallel_size > 0 else max(1, ep // cp)
        self.data_parallel_size = dp
        self.context_parallel_size = cp
        self.expert_parallel_size = ep
        self.engram_parallel_size = engram_parallel_size or cp * dp
        self.engine_rank = engine_rank
        self.engine_group_rank = engine_group_rank
        self.data_parallel_rank = engine_rank % dp
        self.world_size = max(cp * dp, self.engram_parallel_size)
        assert (cp * dp) % ep == 0, f"{cp=} {dp=} {ep=}"
        assert 0 <= engine_rank < dp, f"{engine_rank=} {dp=}"


class SchedulerConfig:
    def __init__(
        self,
        max_num_batched_tokens,
        max_num_seqs,
        max_model_len,
        stop_preempted_request=False,
        chunked_prefill=False,
        prefill_attempt_interval=None,
        prefill_any_attempt_interval=None,
    ) -> None:
        self.max_num_batched_tokens = _get_max_num_batched_tokens(max_model_len, max_num_batched_tokens, max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.stop_preempted_request = stop_preempted_request
        self.chunked_prefill = chunked_prefill
        self.prefill_attempt_interval = prefill_attempt_interval or envs.DEEPINFER_PREFILL_ATTEMPT_INTERVAL
        self.prefill_any_attempt_interval = prefill_any_attempt_interval or envs.DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL
        if not chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than max_model_len "
                f"({self.max_model_len})."
            )
