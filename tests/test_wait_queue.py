"""The optional wait queue (`--max-queued-requests`, `--queue-timeout`): past capacity a request waits, FIFO within
its `priority` (lower first), for a slot; a full queue or a long wait gets 429 with Retry-After before the response
starts; a waiter whose client leaves is gone from the queue at once; a drain sends the waiters a 503."""

from __future__ import annotations

import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from conftest import MODEL, Server, wait_for

SLOW = ("--dp", "1", "--max-num-seqs", "1", "--sim-decode-step-ms", "5")


def metric(srv: Server, name: str) -> float:
    text = httpx.get(f"{srv.url}/metrics").text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m, f"{name} not exported"
    return float(m.group(1))


@contextmanager
def held_slot(srv: Server) -> Iterator[None]:
    """Take the server's only slot with a long stream until the block ends (the client closes it)."""
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 5000,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "hold"}],
    }
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        next(lines)
        yield


def chat(srv: Server, request_id: str = "", **extra: Any) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], **extra}
    headers = {"x-request-id": request_id} if request_id else {}
    return httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=headers, timeout=30)


def test_waiters_run_when_a_slot_frees_lowest_priority_first_then_oldest(make_server: Any) -> None:
    srv = make_server(*SLOW, "--max-queued-requests", "4", "--scheduling-policy", "priority")
    finished: list[int] = []
    threads = []
    with held_slot(srv):
        for name, prio in [("first-0", 0), ("urgent", -2), ("second-0", 0), ("low", 3)]:
            t = threading.Thread(target=lambda n=name, p=prio: finished.append(chat(srv, n, priority=p).status_code))
            t.start()
            threads.append(t)
            queued = len(threads)
            wait_for(f"{name} queued", lambda k=queued: metric(srv, "vllm:num_requests_waiting") == k)
        time.sleep(0.3)
        assert finished == [], "a queued request ran while the only slot was taken"
        assert httpx.get(f"{srv.url}/get_load").json() == {"load": 5}
        loads = httpx.get(f"{srv.url}/v1/loads").json()["loads"]
        assert [x["num_waiting_reqs"] for x in loads] == [4]
    for t in threads:
        t.join(30)
    assert finished == [200] * 4

    # One slot: they ran one after another, in the order the server's request log records their ends.
    def ends() -> list[str]:
        return re.findall(r"request finished request_id=(\S+) .*status=200", srv.log())

    wait_for("the last request's log line", lambda: len(ends()) >= 4, timeout=10)  # may trail its last byte
    assert ends() == ["urgent", "first-0", "second-0", "low"]
    assert metric(srv, "vllm:num_requests_waiting") == 0
    # Queue time is part of the request's time: each waited at least the 0.3 s the slot stayed held.
    assert metric(srv, "vllm:request_queue_time_seconds_sum") > 4 * 0.3
    assert metric(srv, "vllm:time_to_first_token_seconds_sum") > 4 * 0.3


def test_without_the_priority_policy_a_clients_priority_does_not_jump_the_queue(make_server: Any) -> None:
    """By default (--scheduling-policy fcfs) the queue is first come, first served: any client could otherwise send
    itself to the head of it."""
    srv = make_server(*SLOW, "--max-queued-requests", "4")
    threads = []
    with held_slot(srv):
        for name, prio in [("early", 5), ("pushy", -1000)]:
            t = threading.Thread(target=lambda n=name, p=prio: chat(srv, n, priority=p))
            t.start()
            threads.append(t)
            queued = len(threads)
            wait_for(f"{name} queued", lambda k=queued: metric(srv, "vllm:num_requests_waiting") == k)
    for t in threads:
        t.join(30)

    def ends() -> list[str]:
        return re.findall(r"request finished request_id=(\S+) .*status=200", srv.log())

    wait_for("the last request's log line", lambda: len(ends()) >= 2, timeout=10)
    assert ends() == ["early", "pushy"]


def test_a_full_queue_and_a_wait_past_the_timeout_get_429_with_retry_after(make_server: Any) -> None:
    srv = make_server(*SLOW, "--max-queued-requests", "1", "--queue-timeout", "0.6")
    waited: list[httpx.Response] = []
    with held_slot(srv):
        took: list[float] = []

        def queued_stream() -> None:
            start = time.monotonic()
            waited.append(chat(srv, stream=True))
            took.append(time.monotonic() - start)

        # A queued stream gets a real status: its 200 would only come once it is admitted.
        t = threading.Thread(target=queued_stream)
        t.start()
        wait_for("the stream queued", lambda: metric(srv, "vllm:num_requests_waiting") == 1)
        full = chat(srv)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "queue_full"
        # The Anthropic door refuses in its own envelope.
        msg = httpx.post(
            f"{srv.url}/v1/messages",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
        )
        assert msg.status_code == 429 and msg.headers["retry-after"] == "1"
        assert msg.json() == {
            "type": "error",
            "error": {"type": "rate_limit_error", "message": msg.json()["error"]["message"]},
        }
        t.join(20)
    (late,) = waited
    assert late.status_code == 429 and late.headers["retry-after"] == "1"
    assert late.headers["content-type"] == "application/json"
    assert late.json()["error"]["code"] == "queue_timeout"
    # The queue timeout ended its wait: the held slot would have freed only after its 5,000 tokens (25 s).
    assert 0.6 <= took[0] < 12, took
    rejected = httpx.get(f"{srv.url}/metrics").text
    assert 'deepinfer_rejected_requests_total{reason="queue_full"} 2' in rejected
    assert 'deepinfer_rejected_requests_total{reason="queue_timeout"} 1' in rejected
    assert chat(srv).status_code == 200  # the slot came back when the holder left


def test_a_waiter_whose_client_leaves_is_gone_from_the_queue_at_once(make_server: Any) -> None:
    srv = make_server(*SLOW, "--max-queued-requests", "2")
    host, port = srv.url.removeprefix("http://").split(":")
    raw = json.dumps({"model": MODEL, "max_tokens": 3, "messages": [{"role": "user", "content": "bye"}]}).encode()
    head = (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\n\r\n"
    )
    with held_slot(srv):
        s = socket.create_connection((host, int(port)))
        s.sendall(head.encode() + raw)
        wait_for("the request queued", lambda: metric(srv, "vllm:num_requests_waiting") == 1)
        s.close()
        wait_for("the request left the queue", lambda: metric(srv, "vllm:num_requests_waiting") == 0, timeout=2)
        # The slot is still the holder's: a request now queues, and runs once the holder leaves.
        later: list[int] = []
        t = threading.Thread(target=lambda: later.append(chat(srv).status_code))
        t.start()
        wait_for("the next request queued", lambda: metric(srv, "vllm:num_requests_waiting") == 1)
    t.join(30)
    assert later == [200]
    assert httpx.get(f"{srv.url}/get_load").json() == {"load": 0}


def test_a_drain_sends_waiters_a_503_and_finishes_what_runs(make_server: Any) -> None:
    srv = make_server(*SLOW, "--max-queued-requests", "2")
    body = {
        "model": MODEL,
        "stream": True,
        "max_tokens": 150,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": "x"}],
    }
    waited: list[httpx.Response] = []
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()
        next(lines)
        t = threading.Thread(target=lambda: waited.append(chat(srv)))
        t.start()
        wait_for("the request queued", lambda: metric(srv, "vllm:num_requests_waiting") == 1)
        srv.proc.send_signal(signal.SIGTERM)
        t.join(5)
        assert [w.status_code for w in waited] == [503]
        assert waited[0].json()["error"]["code"] == "service_unavailable"
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert not any('"error"' in line for line in rest)
    assert srv.proc.wait(15) == 0


def test_priority_must_be_an_integer_on_every_door(server: Server) -> None:
    for path, body in [
        ("/v1/chat/completions", {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/completions", {"max_tokens": 3, "prompt": "hi"}),
        ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/responses", {"max_output_tokens": 16, "input": "hi"}),
    ]:
        ok = httpx.post(f"{server.url}{path}", json={"model": MODEL, "priority": -7, **body}, timeout=30)
        assert ok.status_code == 200, (path, ok.text)
        bad = httpx.post(f"{server.url}{path}", json={"model": MODEL, "priority": "high", **body}, timeout=30)
        assert bad.status_code == 400, (path, bad.text)
        assert "priority" in bad.text, (path, bad.text)


def test_a_grammar_that_cannot_be_enforced_is_refused_before_the_wait(make_server: Any) -> None:
    """A full server (the only slot held, a queue, a 20 s queue timeout): a request whose schema cannot be
    compiled hears its 400 at once, on chat and Responses, instead of after waiting for a slot; a sound schema
    waits its turn; the same bad schema without a wait is the same 400."""
    srv = make_server(*SLOW, "--max-queued-requests", "4", "--queue-timeout", "20")
    lookahead = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)a"}}, "required": ["a"]}
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": lookahead}}
    good = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    with held_slot(srv):
        t0 = time.monotonic()
        r = chat(srv, "bad", response_format=bad)
        took = time.monotonic() - t0
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text
        assert r.json()["error"]["param"] == "response_format"
        assert took < 5, took  # not the 20 s queue timeout, nor the held stream's end
        fmt = {"format": {"type": "json_schema", "name": "x", "schema": lookahead}}
        body = {"model": MODEL, "max_output_tokens": 5, "input": "x", "text": fmt}
        resp = httpx.post(f"{srv.url}/v1/responses", json=body, timeout=30)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "text.format", resp.text
        waited: list[int] = []
        t = threading.Thread(target=lambda: waited.append(chat(srv, "good", response_format=good).status_code))
        t.start()
        wait_for("the sound request to queue", lambda: metric(srv, "vllm:num_requests_waiting") == 1, 10)
    t.join(30)
    assert waited == [200]
    again = chat(srv, "bad-idle", response_format=bad)
    assert again.status_code == 400 and again.json()["error"]["code"] == "invalid_grammar"
