"""Admission (429), disconnects, timeouts, rank failure and shutdown, over real HTTP."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
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
    srv = make_server("--dp", "2")
    mine = lambda: {s for s in shm_segments() if f"-{srv.proc.pid}-" in s}  # noqa: E731 (other servers may run)
    # The media directory (each request's images, for its rank) and the lock that tells the server is alive (a
    # sweep at another server's start reads it) live as long as the server; ring files do not.
    left = {s for s in mine() if not s.endswith(("-media", "-lock"))}
    assert left == set(), "ring files must be unlinked once mapped"
    assert srv.stop() == 0
    assert not mine()


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


def sigterm_group(srv: Server) -> None:
    """As `kill -- -PGID`, `tini -g` or dumb-init do (the server leads its group: `new_session`)."""
    os.killpg(srv.proc.pid, signal.SIGTERM)


def sigterm_every_process(srv: Server) -> None:
    """As systemd's KillMode=control-group does: each process of the unit, whatever its group."""
    for pid in [srv.proc.pid, *srv.rank_pids()]:
        os.kill(pid, signal.SIGTERM)


def stream_through_group_sigterm(
    srv: Server, max_tokens: int, send: Callable[[Server], None] = sigterm_group
) -> tuple[list[str], float]:
    """Stream `max_tokens` tokens and SIGTERM the server and its ranks (`send`) once the first token is in.
    Returns the stream's data payloads and how long the server took to exit after the signal."""
    body = {**LONG, "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
                if '"content":"' in line and '"content":""' not in line:
                    break
        send(srv)
        t0 = time.monotonic()
        for line in lines:
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    srv.proc.wait(timeout=30)
    return events, time.monotonic() - t0


@pytest.mark.parametrize("send", [sigterm_group, sigterm_every_process], ids=["process-group", "control-group"])
def test_group_sigterm_drains_a_running_stream_and_exits_zero(make_server, send: Callable[[Server], None]) -> None:
    srv = make_server("--dp", "2", "--sim-decode-step-ms", "10", new_session=True)
    ranks = srv.rank_pids()
    assert len(ranks) == 2
    events, _ = stream_through_group_sigterm(srv, 200, send)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], chunks[-3:]
    assert chunks[-1]["usage"]["completion_tokens"] == 200
    assert sum(1 for c in chunks for ch in c["choices"] if ch["delta"].get("content")) >= 1
    assert [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch["finish_reason"]] == ["length"]
    assert srv.proc.returncode == 0, srv.log()[-2000:]
    assert "failed while running the request" not in srv.log()
    for pid in ranks:  # the ranks are gone too (told over the ring once the drain was over)
        stat = Path(f"/proc/{pid}/stat")
        assert not stat.exists() or stat.read_text().split()[2] == "Z"


def test_group_sigterm_through_the_container_entrypoint_drains(make_server, tmp_path: Path) -> None:
    """The image's entrypoint execs the server (PID 1 in a container): `docker stop`, `tini -g` or dumb-init
    signalling its group leave the running stream whole."""
    entrypoint = Path(__file__).resolve().parents[1] / "docker" / "entrypoint.sh"
    server_bin = Path(sys.executable).with_name("deepinfer-server")
    env = {"DEEPINFER_SERVER_BIN": str(server_bin), "DEEPINFER_CACHE_ROOT": str(tmp_path)}
    srv = make_server("--sim-decode-step-ms", "5", new_session=True, launcher=[str(entrypoint)], env=env)
    cmdline = Path(f"/proc/{srv.proc.pid}/cmdline").read_bytes().split(b"\0")
    assert b"entrypoint" not in b" ".join(cmdline), "the entrypoint execs the server: no shell stays in between"
    events, _ = stream_through_group_sigterm(srv, 100)
    assert events[-1] == "[DONE]" and json.loads(events[-2])["usage"]["completion_tokens"] == 100
    assert srv.proc.returncode == 0, srv.log()[-2000:]


def test_group_sigterm_past_the_drain_timeout_cuts_the_stream_and_exits_non_zero(make_server) -> None:
    srv = make_server("--sim-decode-step-ms", "10", "--drain-timeout", "0.5", new_session=True)
    events, took = stream_through_group_sigterm(srv, 30000)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["error"]["code"] == "service_unavailable" and "shutting down" in last["error"]["message"]
    assert srv.proc.returncode == 1, srv.log()[-2000:]
    assert took < 10
    assert "lost" in srv.log()


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
