"""Fake of deepinfer/environ.py: the DEEPINFER_* variables the fake reads, as attributes of `envs` (read lazily)."""

from __future__ import annotations

import os
from typing import Any


class EnvVar:
    def __init__(self, parse: Any, default: Any) -> None:
        self.parse = parse
        self.default = default
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type) -> Any:
        raw = os.environ.get(self.name)
        return self.default if raw is None or raw == "" else self.parse(raw)


def _bool(v: str) -> bool:
    return v.strip().lower() not in ("0", "false", "no", "off")


class envs:
    DEEPINFER_ACCELERATOR = EnvVar(str, "nvidia")
    DEEPINFER_GLOO_TIMEOUT = EnvVar(float, 14400.0)
    DEEPINFER_USE_NEXTN_DECODE = EnvVar(int, 5)
    DEEPINFER_PREFILL_ATTEMPT_INTERVAL = EnvVar(int, 70)
    DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL = EnvVar(int, 100)
    DEEPINFER_ZERO_OVERHEAD_SCHEDULING = EnvVar(_bool, False)
    DEEPINFER_USE_MULTIMODAL_POOL = EnvVar(_bool, False)
    DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE = EnvVar(str, "off")


def rearm(name: str) -> None:
    """The real module drops its cached value; the fake reads lazily every time."""
