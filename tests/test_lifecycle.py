"""Admission (429), disconnects, timeouts, rank failure and shutdown, over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time

import httpx
from conftest import MODEL, Server, idle_wakeups_per_s, requests_across_idle_gaps, shm_segments, sse_events

LONG = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "go"}],
    "max_tokens": 30000,
    "ignore_eos": True,
    "thinking": {"type": "disabled"},
}


def open_stream(srv: Server, client: httpx.Client) -> httpx.Response:
    """Start a long stream and wait for its first token, so it surely holds a slot on a rank."""
    req = client.build_request("POST", "/v1/chat/completions", json={**LONG, "stream": True})
    resp = client.send(req, stream=True)
    assert resp.status_code == 200
    lines = resp.iter_lines()
    for line in lines:
        if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
            break
    resp._test_lines = lines  # type: ignore[attr-defined]
    return resp


def test_capacity_plus_one_gets_429_for_stream_and_non_stream(make_server) -> None:
    srv = make_server("--dp", "2", "--max-num-seqs", "1", "--sim-decode-step-ms", "20")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        held = [open_stream(srv, c) for _ in range(2)]
        for stream in (True, False):
            r = c.post("/v1/chat/completions", json={**LONG, "stream": stream, "max_tokens": 5})
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "rate_limit_exceeded"
        assert c.get("/health").status_code == 200
        for h in held:
            h.close()
        # the slots come back as soon as the streams are dropped
        deadline = time.monotonic() + 2
        while True:
            r = c.post("/v1/chat/completions", json={**LONG, "max_tokens": 5})
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.02)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5


def test_disconnect_frees_the_slot_at_once(make_server) -> None:
    srv = make_server("--dp", "1", "--max-num-seqs", "1", "--sim-decode-step-ms", "5")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for _ in range(3):  # stream disconnects
            open_stream(srv, c).close()
            t0 = time.monotonic()
            while c.post("/v1/chat/completions", json={**LONG, "max_tokens": 2}).status_code == 429:
                assert time.monotonic() - t0 < 1.0, "slot not freed within a second"
                time.sleep(0.01)
    # a non-streaming request whose client goes away also frees its slot
    s = socket.create_connection(("127.0.0.1", int(srv.url.rsplit(":", 1)[1])))
    body = json.dumps({**LONG}).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    time.sleep(0.3)
    s.close()
    t0 = time.monotonic()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        while c.post("/v1/chat/completions", json={**LONG, "max_tokens": 2}).status_code == 429:
            assert time.monotonic() - t0 < 1.0, "non-stream slot not freed within a second"
            time.sleep(0.01)


def test_request_timeout(make_server) -> None:
    srv = make_server("--request-timeout", "0.5", "--sim-decode-step-ms", "10")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        t0 = time.monotonic()
        r = c.post("/v1/chat/completions", json=LONG)
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 3
        with c.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r:
            events = sse_events(r)
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
        r = c.post("/v1/chat/completions", json={**LONG, "max_tokens": 3})  # capacity is back
        assert r.status_code == 200


def test_killing_a_rank_fails_its_streams_and_turns_health_503(make_server) -> None:
    srv = make_server("--dp", "2", "--max-num-seqs", "4", "--sim-decode-step-ms", "10")
    before = shm_segments()
    results: list[list[str]] = []

    def consume() -> None:
        with (
            httpx.Client(base_url=srv.url, timeout=30) as c,
            c.stream("POST", "/v1/chat/completions", json={**LONG, "stream": True}) as r,
        ):
            results.append(sse_events(r))

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    victim = srv.rank_pids()[0]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    with httpx.Client(base_url=srv.url, timeout=5) as c:
        while c.get("/health").status_code != 503:
            assert time.monotonic() - t0 < 1.0, "/health did not turn 503 within a second"
            time.sleep(0.02)
        r = c.post("/v1/chat/completions", json={**LONG, "max_tokens": 3})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
    # the dead rank's streams end with an error event and [DONE]; nothing hangs
    for t in threads[:2]:
        t.join(timeout=5)
    failed = [ev for ev in results if len(ev) >= 2 and ev[-1] == "[DONE]" and '"error"' in ev[-2]]
    assert failed, results
    # the process exits non-zero by itself, and leaves no shared memory behind
    srv.proc.wait(timeout=15)
    assert srv.proc.returncode != 0
    for t in threads:
        t.join(timeout=5)
        assert not t.is_alive()
    # Only this server's segments: other servers on the host (other checkouts' tests) may be starting.
    assert not {s for s in shm_segments() - before if f"-{srv.proc.pid}-" in s}


def test_sigterm_drains_and_exits_zero(make_server) -> None:
    srv = make_server("--sim-decode-step-ms", "5")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        out: dict = {}

        def finish_one() -> None:
            out["r"] = c.post("/v1/chat/completions", json={**LONG, "max_tokens": 60})

        t = threading.Thread(target=finish_one)
        t.start()
        time.sleep(0.1)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        assert c.get("/health").status_code == 503
        t.join(timeout=10)
    assert out["r"].status_code == 200 and out["r"].json()["usage"]["completion_tokens"] == 60
    assert srv.proc.wait(timeout=15) == 0


def test_no_segments_left_after_a_normal_stop(make_server) -> None:
    before = shm_segments()
    srv = make_server("--dp", "2")
    assert not (shm_segments() - before), "ring files must be unlinked once every rank mapped them"
    assert srv.stop() == 0
    assert not (shm_segments() - before)


def test_sse_keep_alive_comments_during_a_long_prefill(make_server) -> None:
    """A slow prefill leaves the stream silent; keep-alive comments keep proxies (and dead-peer checks) going."""
    srv = make_server("--sse-keep-alive", "0.1", "--sim-prefill-ms-per-1k-tokens", "20000")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        body = {**LONG, "max_tokens": 2, "stream": True, "messages": [{"role": "user", "content": "x " * 40}]}
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = [line for line in r.iter_lines() if line]
    comments = [line for line in lines if line.startswith(":")]
    assert comments and all(line == ": keep-alive" for line in comments)
    assert lines[-1] == "data: [DONE]"
    assert len([line for line in lines if line.startswith("data: {")]) >= 3  # role, content, usage-free end


def test_an_idle_lockstep_group_sleeps_until_a_request_rings_its_doorbell(make_server) -> None:
    # A 60 s idle backstop: a rank left asleep while its peer waits to step would hang the request.
    srv = make_server(
        "--dp", "2", "--sim-lockstep", "--sim-decode-step-ms", "2", env={"DEEPINFER_SERVER_IDLE_WAIT_S": "60"}
    )
    requests_across_idle_gaps(srv)
    time.sleep(0.5)
    wakeups = idle_wakeups_per_s(srv)
    assert all(w < 50 for w in wakeups), wakeups  # the 2 ms poll it replaced made ~700 a second
    assert srv.stop() == 0  # the shutdown rings the bell: no 60 s wait


def test_a_finished_request_has_freed_its_slot_when_the_client_hears_of_it(make_server) -> None:
    """One slot: a client that sends its next request the moment it has the last answer never gets a 429 (the
    slot used to be freed only when the last reference to the request went, a moment after the answer)."""
    srv = make_server("--dp", "1", "--max-num-seqs", "1")
    codes: list[int] = []
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        for i in range(150):
            body = {**LONG, "max_tokens": 2, "stream": i % 2 == 1}
            codes.append(c.post("/v1/chat/completions", json=body).status_code)
    assert codes.count(429) == 0 and set(codes) == {200}, [i for i, code in enumerate(codes) if code != 200]
