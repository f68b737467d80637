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
from conftest import MODEL, Server, sse_has_text, wait_for

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

    def logged() -> list[float]:
        return sorted(float(x) for x in re.findall(r"request finished .* ttft_ms=([\d.]+)", srv.log()))

    # The log line of a request may reach the log reader after its client has the last byte.
    wait_for("the burst's log lines", lambda: len(logged()) >= n, timeout=10)
    return logged()


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


LONG_ONLY = ("--max-long-partial-prefills", "1", "--long-prefill-token-threshold", "500")


def test_the_long_prompt_limit_spaces_long_prompts(make_server: Any) -> None:
    ttfts = burst_ttfts(make_server(*SIM, *LONG_ONLY))
    assert len(ttfts) == 4
    first_texts = burst_ttfts.first_texts  # type: ignore[attr-defined]
    assert len(first_texts) == 4 and min(gaps(first_texts)) > 50, (first_texts, ttfts)


def short_behind_a_burst(srv: Server) -> float:
    """Seconds a short request takes when it arrives while six long prompts are in prefill or waiting."""
    burst = threading.Thread(target=burst_ttfts, args=(srv, 6))
    burst.start()
    time.sleep(0.15)  # the first long prompt is in prefill (~100 ms each), the others wait in the gate
    short = {
        "model": MODEL,
        "max_tokens": 2,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "hi"}],
    }
    t0 = time.perf_counter()
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=short, timeout=30)
    took = time.perf_counter() - t0
    burst.join()
    assert r.status_code == 200
    return took


def test_a_short_prompt_passes_the_long_ones_waiting(make_server: Any) -> None:
    passing = short_behind_a_burst(make_server(*SIM, *LONG_ONLY))
    queued = short_behind_a_burst(make_server(*SIM, "--max-num-partial-prefills", "1"))
    # With every prompt limited it waits for the four or five long prefills ahead of it (~100 ms each); with only
    # long prompts limited it joins the engine at once and waits for the step under way and the next one.
    assert passing < queued - 0.15, (passing, queued)
