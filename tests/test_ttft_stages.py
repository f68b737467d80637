"""The TTFT breakdown in /metrics (`deepinfer_ttft_stage_seconds{stage}`): for a request over HTTP, every stage is
observed once, the stages up to the server reading the first token add up to the TTFT it measured, the rank's own
stamps (taken, prefill step, published) land in order on the server's clock, and the `sse` stage ends when the
first token's event is written, before the client reads it."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
from conftest import MODEL, Server

TO_FIRST_TOKEN = ["parse", "queue", "encode", "dispatch", "ring", "engine_queue", "prefill", "publish"]


def histograms(srv: Server) -> dict[str, dict[str, float]]:
    """stage -> {"sum", "count"} of the stage histogram, plus TTFT and prefill under their vLLM names."""
    text = httpx.get(f"{srv.url}/metrics").text
    out: dict[str, dict[str, float]] = {}
    for kind, stage, value in re.findall(
        r'^deepinfer_ttft_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', text, re.M
    ):
        out.setdefault(kind, {})[stage] = float(value)
    for name in ("vllm:time_to_first_token_seconds", "vllm:request_prefill_time_seconds"):
        for kind in ("sum", "count"):
            m = re.search(rf"^{re.escape(name)}_{kind}{{[^}}]*}} (\S+)$", text, re.M)
            assert m, f"{name}_{kind} not exported"
            out.setdefault(name, {})[kind] = float(m.group(1))
    return out


def first_token_stream(srv: Server) -> float:
    """Stream one chat answer; the client's own time to its first content chunk, in seconds."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 8,
        "ignore_eos": True,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": "where does the time go " * 20}],
    }
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if first is None and '"content":"' in line:
                first = time.perf_counter() - t0
    assert first is not None
    return first


def check_one_request(srv: Server, client_ttft: float, n: int) -> dict[str, Any]:
    h = histograms(srv)
    sums, counts = h["sum"], h["count"]
    for stage in [*TO_FIRST_TOKEN, "sse"]:
        assert counts[stage] == n, (stage, counts)
        assert sums[stage] >= 0, (stage, sums)
    assert counts["engine"] == 0, "the sim sends its stamps: no stage may fall back to 'engine'"
    total = sum(sums[s] for s in TO_FIRST_TOKEN)
    ttft = h["vllm:time_to_first_token_seconds"]
    assert ttft["count"] == n
    assert abs(total - ttft["sum"]) < 1e-3 * n, (total, ttft)
    # The rank's stamps on the server's clock: after the ring write, the prefill step lasts at least its 5 ms.
    assert sums["ring"] > 0 and sums["prefill"] >= 0.005 * n, sums
    assert abs(h["vllm:request_prefill_time_seconds"]["sum"] - sums["prefill"]) < 1e-6
    # The first event was written before the client read it (the client also timed the request's upload).
    assert total / n + sums["sse"] / n <= client_ttft + 1e-3, (total, sums["sse"], client_ttft)
    return sums


def test_stages_add_up_to_the_ttft_on_a_rank_that_steps_alone(make_server: Any) -> None:
    srv = make_server("--dp", "1", "--sim-decode-step-ms", "5", "--sim-prefill-ms-per-1k-tokens", "50")
    client = first_token_stream(srv)
    check_one_request(srv, client, 1)


def test_stages_add_up_on_ranks_in_lockstep_for_each_request(make_server: Any) -> None:
    srv = make_server(
        "--dp", "2", "--sim-lockstep", "--sim-decode-step-ms", "5", "--sim-prefill-ms-per-1k-tokens", "50"
    )
    slowest = max(first_token_stream(srv) for _ in range(3))
    check_one_request(srv, slowest, 3)


def test_a_non_stream_has_every_stage_but_sse(server: Server) -> None:
    before = histograms(server)
    body = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    assert httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    after = histograms(server)
    for stage in TO_FIRST_TOKEN:
        assert after["count"][stage] == before["count"][stage] + 1, stage
    assert after["count"]["sse"] == before["count"]["sse"]
