"""Minimal fake torch for tests without torch: tensors of ints for flags, and `torch.distributed`."""

from __future__ import annotations

from typing import Any

int64 = "int64"
int32 = "int32"
float32 = "float32"
bfloat16 = "bfloat16"


class Tensor:
    def __init__(self, values: list[Any], dtype: Any = None) -> None:
        self.values = list(values)
        self.dtype = dtype

    def __getitem__(self, i: int) -> Any:
        return self.values[i]

    def __setitem__(self, i: int, v: Any) -> None:
        self.values[i] = v

    def __len__(self) -> int:
        return len(self.values)

    def item(self) -> Any:
        assert len(self.values) == 1
        return self.values[0]

    def tolist(self) -> list[Any]:
        return list(self.values)

    def __repr__(self) -> str:
        return f"tensor({self.values})"


def tensor(values: Any, dtype: Any = None, device: Any = None) -> Tensor:
    return Tensor([int(v) for v in values] if dtype in (int64, int32) else list(values), dtype)


def full(shape: tuple[int, ...], value: Any, dtype: Any = None, device: Any = None) -> Tensor:
    return Tensor([int(value) if dtype in (int64, int32) else value] * shape[0], dtype)


class _Cuda:
    """No GPU here: what a weight reload calls between two engines."""

    empty_caches = 0

    def is_available(self) -> bool:
        return True  # the engine runs "on GPUs": the adapter's cache release is exercised

    def empty_cache(self) -> None:
        self.empty_caches += 1


cuda = _Cuda()

from torch import distributed  # noqa: E402, F401
