"""`--watchdog-timeout` over real HTTP on the simulated engine: a hung rank (here: stopped with SIGSTOP) is found
from its heartbeat, its streams end with an error event, /health turns 503, every rank process is killed and the
server exits non-zero; an idle rank, asleep on its doorbell and stamping nothing, never trips it."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from conftest import MODEL, BackgroundStream, shm_segments, wait_until_gone

NO_THINK = {"thinking": {"type": "disabled"}}


def chat_body(content: str, max_tokens: int, stream: bool) -> dict[str, object]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "stream": stream,
        "ignore_eos": True,
        **NO_THINK,
    }


def test_stopped_ranks_trip_the_watchdog_kill_everything_and_exit_non_zero(make_server) -> None:
    srv = make_server(
        "--dp", "2", "--watchdog-timeout", "2", "--exit-on-rank-failure", "8", "--sim-decode-step-ms", "20"
    )  # fmt: skip  # 8 s of 503s after the trip: room for the checks below on a busy machine
    ranks = srv.rank_pids()
    assert len(ranks) == 2

    unary: list[httpx.Response] = []

    def non_stream() -> None:  # lands on the other rank (least loaded)
        unary.append(
            httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("hang too", 20_000, False), timeout=60)
        )

    bg = BackgroundStream.start(srv.url, chat_body("hang", 20_000, True))
    events, ended = bg.events, bg.ended
    assert bg.first.wait(20), events
    u = threading.Thread(target=non_stream, daemon=True)
    u.start()
    time.sleep(0.3)
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    assert ended.wait(15), "the stream never ended: nothing noticed the hung ranks"
    took = time.monotonic() - stopped
    assert 1.5 < took < 6, took  # the 2 s timeout, checked every 0.5 s
    assert events[-1] == "[DONE]" and "error" in json.loads(events[-2]), events[-3:]
    assert "stopped responding" in json.loads(events[-2])["error"]["message"]
    u.join(5)
    assert unary and unary[0].status_code == 503, unary
    assert unary[0].json()["error"]["code"] == "service_unavailable"
    h = httpx.get(f"{srv.url}/health", timeout=5)
    assert h.status_code == 503, h.text
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=chat_body("after", 5, False), timeout=5)
    assert r.status_code == 503, r.text
    assert srv.proc.wait(timeout=20) == 1, srv.log()
    left = wait_until_gone(srv.proc.pid, set(ranks))
    assert not left, left
    assert not {s for s in shm_segments() if f"-{srv.proc.pid}-" in s}
    log = srv.log()
    assert "watchdog: rank" in log and "no heartbeat" in log, log
    assert "in phase" in log, log


def test_idle_ranks_never_trip_a_short_watchdog_and_a_slow_first_step_after_sleep_does_not(make_server) -> None:
    # The ranks sleep up to 60 s between requests without a heartbeat. A 150-token prompt costs a ~600 ms
    # first step (4 s per 1k prompt tokens), during which the sleeping rank's heartbeat is seconds old: only
    # "stale since the rank got work" tells that apart from a hang.
    srv = make_server(
        "--dp", "2", "--watchdog-timeout", "1", "--sim-prefill-ms-per-1k-tokens", "4000",
        env={"DEEPINFER_SERVER_IDLE_WAIT_S": "60"},
    )  # fmt: skip
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=chat_body("warm", 3, False)).status_code == 200
        for _ in range(4):  # 4 s idle: four times the timeout
            time.sleep(1)
            assert c.get("/health").status_code == 200
        prompt = " ".join(f"word{i}" for i in range(60))
        for _ in range(2):  # each time to a rank asleep for longer than the timeout
            time.sleep(2.5)
            t0 = time.monotonic()
            r = c.post("/v1/chat/completions", json=chat_body(prompt, 3, False))
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["prompt_tokens"] >= 120
            assert time.monotonic() - t0 > 0.4  # the slow first step really happened
            assert c.get("/health").status_code == 200
    assert srv.proc.poll() is None
    assert "watchdog" not in srv.log()
    assert srv.stop() == 0


def test_a_rank_that_hangs_during_the_drain_makes_the_exit_non_zero(make_server) -> None:
    srv = make_server("--dp", "2", "--watchdog-timeout", "1", "--drain-timeout", "20", "--sim-decode-step-ms", "20")
    ranks = srv.rank_pids()
    assert BackgroundStream.start(srv.url, chat_body("drain", 20_000, True)).first.wait(20)
    srv.proc.send_signal(signal.SIGTERM)  # drain: the stream may finish, for up to 20 s
    time.sleep(0.3)
    for pid in ranks:
        os.kill(pid, signal.SIGSTOP)  # ... but its rank hangs
    assert srv.proc.wait(timeout=15) == 1, srv.log()
    assert not wait_until_gone(srv.proc.pid, set(ranks))
    assert "failed during the drain" in srv.log()
