"""Fake of parallel_state.py: the `PG` singleton and its group accessors (DP groups over the DP ranks)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist


class ParallelProcessGroup:
    def __init__(self) -> None:
        self.dp: Any = None
        self.cpu_dp_group: Any = None
        self.cp: Any = None
        self.ep: Any = None
        self.world: Any = None
        self.rank = 0

    def create_process_groups(self) -> None:
        self.rank = dist.get_rank()
        self.world = dist.new_group()
        self.dp = dist.new_group(backend="nccl")
        self.cpu_dp_group = dist.new_group(backend="gloo")
        self.ep = self.world
        self.cp = dist.ProcessGroup([self.rank], 0)

    def data_parallel_group(self) -> Any:
        return self.dp

    def cpu_data_parallel_group(self) -> Any:
        return self.cpu_dp_group

    def context_parallel_group(self) -> Any:
        return self.cp

    def expert_parallel_group(self) -> Any:
        return self.ep

    def world_group(self) -> Any:
        return self.world

    def get_rank(self) -> int:
        return self.rank


PG = ParallelProcessGroup()
