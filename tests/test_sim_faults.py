"""The sim that fails on purpose (engine/sim_faults.py), over HTTP: engine errors and aborts at a seeded rate, a rank
that crashes or stalls after N requests, and the named timing profiles (the calibrated 8 x B200 one included).
What a gateway in front sees is in tests/test_gateway_nginx.py."""

from __future__ import annotations

import itertools
import json
import statistics
import time
from collections.abc import Callable

import httpx
import pytest
from conftest import MODEL, Server, sse_events, wait_for

from deepinfer_server.cli import build_parser, check_args

Make = Callable[..., Server]


def chat(srv: Server, max_tokens: int = 8, stream: bool = False, content: str = "hello") -> httpx.Response:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "thinking": {"type": "disabled"},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)


def metric(srv: Server, name: str, labels: str = "") -> float:
    for line in httpx.get(f"{srv.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(f"{name}{labels} ") or (not labels and line.startswith(f"{name}{{")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name}{labels} not exported")


def outcomes(srv: Server, n: int) -> list[str]:
    """Sequential JSON requests: each one's outcome ("ok", or the error code and how many tokens came)."""
    out = []
    for _ in range(n):
        r = chat(srv)
        out.append("ok" if r.status_code == 200 else f"{r.status_code} {r.json()['error']['code']}")
    return out


def test_engine_error_rate_is_seeded_and_gives_500_or_a_stream_error_event(make_server: Make) -> None:
    a = make_server("--sim-error-rate", "0.5", "--sim-fault-seed", "11")
    b = make_server("--sim-error-rate", "0.5", "--sim-fault-seed", "11")
    c = make_server("--sim-error-rate", "0.5", "--sim-fault-seed", "12")
    got = outcomes(a, 40)
    assert set(got) == {"ok", "500 engine_error"}, got
    assert 8 <= got.count("500 engine_error") <= 32, got
    assert outcomes(b, 40) == got  # the same seed and arrivals: the same requests fail
    assert outcomes(c, 40) != got  # another seed: others
    assert metric(a, "deepinfer_aborted_requests_total", '{reason="engine_error"}') == got.count("500 engine_error")
    always = make_server("--sim-error-rate", "1")
    with httpx.stream("POST", f"{always.url}/v1/chat/completions", json={
        "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 5, "stream": True,
    }, timeout=30) as r:  # fmt: skip
        assert r.status_code == 200  # a stream has its headers before the engine answers
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert (err["code"], err["type"]) == ("engine_error", "server_error") and "sim_engine_error" in err["message"]
    assert not any('"content":"' in e and '"content":""' not in e for e in events[:-2])  # no token came first


def test_engine_abort_rate_cuts_a_stream_part_way(make_server: Make) -> None:
    srv = make_server("--sim-abort-rate", "1", "--sim-fault-seed", "3")
    cut = []
    for _ in range(5):
        with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 40, "ignore_eos": True,
            "thinking": {"type": "disabled"}, "stream": True,
        }, timeout=30) as r:  # fmt: skip
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert "aborted the request" in json.loads(events[-2])["error"]["message"]
        text = "".join(
            (json.loads(e)["choices"][0]["delta"].get("content") or "") for e in events[:-2] if e.startswith("{")
        )
        cut.append(text)
    assert all(cut), cut  # part of the answer came before the abort
    assert len(set(cut)) > 1  # at different points
    assert chat(srv).status_code == 500
    assert metric(srv, "deepinfer_aborted_requests_total", '{reason="engine_abort"}') == 6


def test_rank_crash_after_n_requests(make_server: Make) -> None:
    srv = make_server("--sim-crash-after", "3", "--exit-on-rank-failure", "3")
    assert outcomes(srv, 3) == ["ok"] * 3
    r = chat(srv)  # the 4th arrival kills the rank
    assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable", r.text
    assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 503
    assert metric(srv, "deepinfer_healthy") == 0
    assert metric(srv, "deepinfer_aborted_requests_total", '{reason="rank_failure"}') == 1
    assert srv.proc.wait(timeout=15) == 1
    assert "sim fault: crashing on request 4" in srv.log()


def test_rank_stall_stops_the_heartbeat_until_the_watchdog(make_server: Make) -> None:
    srv = make_server("--sim-stall-after", "2", "--watchdog-timeout", "3", "--exit-on-rank-failure", "1")
    assert outcomes(srv, 2) == ["ok"] * 2
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 50, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")  # the opening event; then nothing comes
        wait_for("the heartbeat to go stale", lambda: _age(srv, "0") > 1.5, 10)
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200  # only the heartbeat shows it
        rest = [line[6:] for line in lines if line.startswith("data: ")]
    waited = time.monotonic() - start
    assert rest[-1] == "[DONE]" and "stopped responding" in json.loads(rest[-2])["error"]["message"], rest
    assert waited >= 2.8, waited  # the watchdog's 3 s
    assert srv.proc.wait(timeout=15) == 1
    assert "sim fault: stalling on request 3" in srv.log()


def _age(srv: Server, rank: str) -> float:
    return metric(srv, "deepinfer_rank_heartbeat_age_seconds", f'{{rank="{rank}"}}')


def resolved(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(list(argv))
    assert check_args(args) is None
    keys = ("sim_decode_step_ms", "sim_decode_ms_per_seq", "sim_prefill_ms_per_1k_tokens", "sim_overlap_prefill")
    return {k: getattr(args, k) for k in (*keys, "sim_prefill_chunk_tokens", "sim_lockstep")}


def test_profiles_fill_the_cost_flags_and_explicit_flags_win() -> None:
    zero = resolved()
    assert zero["sim_decode_step_ms"] == 0.0 and zero["sim_lockstep"] is False
    b200 = resolved("--sim-profile", "8xb200")
    assert b200["sim_lockstep"] is True and b200["sim_overlap_prefill"] is True
    over = resolved("--sim-profile", "8xb200", "--sim-decode-step-ms", "30")
    assert over["sim_decode_step_ms"] == 30.0 and over["sim_prefill_chunk_tokens"] == b200["sim_prefill_chunk_tokens"]
    for bad in (["--sim-error-rate", "1.5"], ["--sim-error-rate", "0.6", "--sim-abort-rate", "0.6"],
                ["--sim-fault-rank", "2", "--dp", "2"], ["--sim-crash-after", "-1"]):  # fmt: skip
        assert check_args(build_parser().parse_args(bad)) is not None, bad


def stream_timing(srv: Server, content: str, max_tokens: int) -> tuple[float, list[float], int]:
    """(time to first token, gaps between token events, prompt tokens) of one stream with usage."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "thinking": {"type": "disabled"}}  # fmt: skip
    start = time.monotonic()
    times, prompt = [], 0
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    prompt = chunk["usage"]["prompt_tokens"]
                if any((c.get("delta") or {}).get("content") for c in chunk["choices"]):
                    times.append(time.monotonic())
    return times[0] - start, [b - a for a, b in itertools.pairwise(times)], prompt


@pytest.mark.parametrize(
    ("flags", "step_ms"),
    [(("--sim-profile", "paced"), 10.0), (("--sim-profile", "8xb200"), 8.5),
     (("--sim-profile", "8xb200", "--sim-decode-step-ms", "20"), 20.0)],
)  # fmt: skip
def test_timing_profiles_over_http(make_server: Make, flags: tuple[str, ...], step_ms: float) -> None:
    srv = make_server("--dp", "2", "--stream-interval-ms", "0", *flags)
    ttft, gaps, prompt = stream_timing(srv, "word " * 4000, 40)
    assert prompt > 4000
    mean_ms = statistics.mean(gaps) * 1000
    assert step_ms * 0.9 <= mean_ms <= step_ms * 2.5, (mean_ms, step_ms)  # one token per step
    if "8xb200" in flags:  # 340-token prefill chunks hidden under the decode step: ~prompt/340 steps
        assert ttft >= (prompt / 340) * step_ms / 1000 * 0.9, ttft
    else:  # 50 ms per 1k prompt tokens, added to the step
        assert ttft >= prompt * 50 / 1e6 * 0.9, ttft
