#!/usr/bin/env python3
"""Server CPU per streamed token with and without generation controls, on the same load: bench/doors.py's
harness (one server on the zero-cost sim, wrk streaming 256-token answers at 64 connections, the variants in turn,
several alternating rounds), on chat only: plain, `logprobs` alone, and `logprobs` with `top_logprobs` 5.

    python bench/controls.py [--rounds 3] [--seconds 8] [--conns 64]
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import doors

PLAIN = doors.DOORS["chat"]
doors.DOORS = {
    "chat": PLAIN,
    "chat logprobs": (PLAIN[0], {**PLAIN[1], "logprobs": True}),
    "chat top_logprobs 5": (PLAIN[0], {**PLAIN[1], "logprobs": True, "top_logprobs": 5}),
}

if __name__ == "__main__":
    sys.exit(doors.main())
