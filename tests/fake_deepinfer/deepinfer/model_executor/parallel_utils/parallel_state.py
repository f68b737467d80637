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

    def create_process_groups(self, cp_size: int = 1) -> None:
        """World = DP x CP, global rank = engine_rank x CP + cp_rank. The DP group (the scheduler's) holds the
        ranks with the same cp index, "(replica dp cp) -> (replica cp) dp"; EP is the world; CP groups are
        contiguous (parallel_state.py:92-106). The fake builds the drivers' DP group only (its collectives run
        through rank 0); CP workers talk to their driver through the forwarded calls."""
        self.rank = dist.get_rank()
        world = dist.get_world_size()
        self.world = dist.new_group()
        drivers = list(range(0, world, cp_size))
        self.dp = dist.new_group(drivers, backend="nccl")
        self.cpu_dp_group = dist.new_group(drivers, backend="gloo")
        self.ep = self.world
        first = self.rank - self.rank % cp_size
        self.cp = dist.ProcessGroup(list(range(first, first + cp_size)), self.rank - first)

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
