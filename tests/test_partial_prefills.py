"""`--max-num-partial-prefills`: a burst of long prompts on one rank gets its first tokens one after another (the
gate hands the engine one prompt at a time, first come first served), where without it every prompt's prefill
runs side by side and all first tokens come together at the end."""

from __future__ import annotations

import itertools
import re
import threading
import time
from typing import Any

import httpx
from conftest import MODEL, Server, sse_has_text

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
            lines: list[str] = []
            for line in r.iter_lines():
                if sse_has_text(line) and not any(map(sse_has_text, lines)):
                    firsts.append(time.perf_counter() * 1000)
                lines.append(line)
            assert lines[-2] == "data: [DONE]"

    firsts: list[float] = []  # when each stream's first text reached the client (ms, one clock)

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    burst_ttfts.first_texts = sorted(firsts)  # type: ignore[attr-defined]
    return sorted(float(x) for x in re.findall(r"request finished .* ttft_ms=([\d.]+)", srv.log()))


def gaps(ttfts: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(ttfts)]


def test_with_the_gate_first_tokens_come_one_prefill_apart(make_server: Any) -> None:
    ttfts = burst_ttfts(make_server(*SIM, "--max-num-partial-prefills", "1"))
    assert len(ttfts) == 4
    # One prompt's prefill is ~100 ms and the gate lets one run at a time, so the first tokens reach the clients
    # about one prefill apart. (On one clock: on a loaded machine the four requests may arrive tens of ms apart,
    # which shortens the later ones' TTFT, not the gaps between their first tokens.)
    first_texts = burst_ttfts.first_texts  # type: ignore[attr-defined]
    assert len(first_texts) == 4 and min(gaps(first_texts)) > 50, (first_texts, ttfts)


def test_without_it_prompts_that_arrive_together_prefill_together(make_server: Any) -> None:
    ttfts = burst_ttfts(make_server(*SIM))
    assert len(ttfts) == 4
    assert min(gaps(ttfts)) < 30, ttfts  # some first tokens came out of the same (longer) step
