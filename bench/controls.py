#!/usr/bin/env python3
"""Server CPU per streamed token with and without generation controls, on the same load: bench/doors.py's
harness (one server on the zero-cost sim, wrk streaming 256-token answers at 64 connections, the variants in turn,
several alternating rounds), on chat only: plain, `logprobs` alone, `logprobs` with `top_logprobs` 5, and two
grammars (a regex, a JSON schema), each of which needs more text than the 256 tokens, so that every answer is
exactly 256 tokens long and constrained all the way (`--only` picks variants).

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
    "chat regex": (PLAIN[0], {**PLAIN[1], "response_format": {"type": "regex", "regex": "[a-z ]{4000}"}}),
    "chat json_schema": (
        PLAIN[0],
        {
            **PLAIN[1],
            "response_format": {
                "type": "json_schema",
                "json_schema": {
                    "name": "long",
                    "schema": {
                        "type": "object",
                        "properties": {"text": {"type": "string", "minLength": 4000}},
                        "required": ["text"],
                    },
                },
            },
        },
    ),
}

if __name__ == "__main__":
    sys.exit(doors.main())
