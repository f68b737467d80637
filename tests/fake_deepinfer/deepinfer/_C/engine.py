"""Fake of the C++ `RequestOutput`: `step()` returns uint64 "pointers" into a pool; the static accessors read them.

Pointers are invalid once the next `step()`/`flush_inflight_reqs()` starts (the real pool releases them there):
reading one then raises, so an adapter that holds them across steps fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

POOL_SIZE = 10_000  # RequestOutputPool::max_size (csrc/engine/outputs.hpp)
_pool: dict[int, RequestOutput] = {}  # readable pointers
_live: set[int] = set()  # allocated and not released yet, as the real pool counts them
_generation = 0


@dataclass
class RequestOutput:
    request_id: str = ""
    prompt_len: int = 0
    token_id: int = 0
    finish_reason: str = ""
    finished: bool = False
    max_num_batched_tokens: int = 0
    token_logprobs: float = 0.0
    nextn_logprobs: float = 0.0
    sum_smaller_probs: float = -1.0
    top_logprobs: list[float] = field(default_factory=list)
    top_token_ids: list[int] = field(default_factory=list)
    num_output_tokens: int = 0
    prompt_logprobs: list[float] = field(default_factory=list)
    draft_tok: int = 0
    accept_tok: int = 0
    confidence_score: list[float] | None = None

    @staticmethod
    def _get(ptr: Any) -> RequestOutput:
        try:
            return _pool[int(ptr)]
        except KeyError:
            raise RuntimeError(f"RequestOutput pointer {int(ptr):#x} used after release (next step)") from None

    @staticmethod
    def clone(ptr: Any) -> RequestOutput:
        return replace(RequestOutput._get(ptr))

    @staticmethod
    def get_request_id(ptr: Any) -> str:
        return RequestOutput._get(ptr).request_id

    @staticmethod
    def get_prompt_len(ptr: Any) -> int:
        return RequestOutput._get(ptr).prompt_len

    @staticmethod
    def get_token_id(ptr: Any) -> int:
        return RequestOutput._get(ptr).token_id

    @staticmethod
    def get_finish_reason(ptr: Any) -> str:
        return RequestOutput._get(ptr).finish_reason

    @staticmethod
    def get_finished(ptr: Any) -> bool:
        return RequestOutput._get(ptr).finished

    @staticmethod
    def get_token_logprobs(ptr: Any) -> float:
        return RequestOutput._get(ptr).token_logprobs

    @staticmethod
    def get_nextn_logprobs(ptr: Any) -> float:
        return RequestOutput._get(ptr).nextn_logprobs

    @staticmethod
    def get_sum_smaller_probs(ptr: Any) -> float:
        return RequestOutput._get(ptr).sum_smaller_probs

    @staticmethod
    def get_top_logprobs(ptr: Any) -> list[float]:
        return RequestOutput._get(ptr).top_logprobs

    @staticmethod
    def get_top_token_ids(ptr: Any) -> list[int]:
        return RequestOutput._get(ptr).top_token_ids

    @staticmethod
    def get_num_output_tokens(ptr: Any) -> int:
        return RequestOutput._get(ptr).num_output_tokens

    @staticmethod
    def get_prompt_logprobs(ptr: Any) -> list[float]:
        return RequestOutput._get(ptr).prompt_logprobs

    @staticmethod
    def get_draft_tok(ptr: Any) -> int:
        return RequestOutput._get(ptr).draft_tok

    @staticmethod
    def get_accept_tok(ptr: Any) -> int:
        return RequestOutput._get(ptr).accept_tok

    @staticmethod
    def get_confidence_score(ptr: Any) -> list[float] | None:
        return RequestOutput._get(ptr).confidence_score


def _release_all() -> None:
    """Make every pointer handed out so far unreadable (the start of a step or flush; stricter than the engine,
    which frees them a little later, in the next step's pre_sampler_sync)."""
    _pool.clear()


def _allocate(records: list[RequestOutput]) -> list[int]:
    """Take pool entries for `records`, as RequestOutputPool::allocate: fails once POOL_SIZE are live."""
    global _generation
    if len(_live) + len(records) > POOL_SIZE:
        raise RuntimeError(f"RequestOutputPool exhausted (max_size={POOL_SIZE}); outputs are not being released")
    _generation += 1
    base = 0x7F00_0000_0000 + (_generation << 20)
    ptrs = [base + i * 8 for i in range(len(records))]
    for ptr, rec in zip(ptrs, records, strict=True):
        _pool[ptr] = rec
    _live.update(ptrs)
    return ptrs


def _release(ptrs: list[int]) -> None:
    """RequestOutputPool::release (the engine's deferred release)."""
    _live.difference_update(ptrs)


def _reset() -> None:
    _pool.clear()
    _live.clear()


def _as_array(ptrs: list[int]) -> Any:
    import numpy as np

    return np.asarray(ptrs, dtype=np.uint64)


def _publish(records: list[RequestOutput]) -> Any:
    """Allocate this step's outputs; returns np.ndarray[np.uint64] of their pointers, as the real step() does."""
    return _as_array(_allocate(records))
