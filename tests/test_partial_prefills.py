"""`--max-num-partial-prefills`: a burst of long prompts on one rank gets its first tokens one after another (the
gate hands the engine one prompt at a time, first come first served), where without it every prompt's prefill
runs side by side and all first tokens come together at the end."""

from __future__ import annotations

import itertools
import re
import threading
from typing import Any

import httpx
from conftest import MODEL, Server

SIM = ("--dp", "1", "--sim-decode-step-ms", "5", "--sim-prefill-ms-per-1k-tokens", "100")


def burst_ttfts(srv: Server, n: int = 4) -> list[float]:
    """n concurrent streams of ~1,000-token prompts; the server's TTFT of each (its request log), in ms."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 4,
        "ignore_eos": True,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "the weather in Paris " * 200}],
    }

    def one() -> None:
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            assert list(r.iter_lines())[-2] == "data: [DONE]"

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(float(x) for x in re.findall(r"request finished .* ttft_ms=([\d.]+)", srv.log()))


def gaps(ttfts: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(ttfts)]


def test_with_the_gate_first_tokens_come_one_prefill_apart(make_server: Any) -> None:
    ttfts = burst_ttfts(make_server(*SIM, "--max-num-partial-prefills", "1"))
    assert len(ttfts) == 4
    # One prompt's prefill is ~100 ms: each first token comes about one prefill after the one before.
    assert min(gaps(ttfts)) > 50, ttfts


def test_without_it_prompts_that_arrive_together_prefill_together(make_server: Any) -> None:
    ttfts = burst_ttfts(make_server(*SIM))
    assert len(ttfts) == 4
    assert min(gaps(ttfts)) < 30, ttfts  # some first tokens came out of the same (longer) step
