from enum import IntEnum


class EngineType(IntEnum):
    NORMAL = 0
    PROMPT = 1
    COMPLETION = 2

    @property
    def default_zero_overhead_scheduling(self) -> bool:
        return self in (EngineType.NORMAL, EngineType.COMPLETION)
