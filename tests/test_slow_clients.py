"""Clients that go quiet or slow (trickled headers and bodies, idle keep-alive, responses nobody reads or that are
read a few bytes at a time) hold neither engine capacity nor connections nor memory: `--client-timeout` bounds each
(a total for a head and a body, not reset by every byte), `--max-stream-buffer-bytes` bounds what a reader that
falls behind holds, and a request's slot is free once its rank is done.
"""

from __future__ import annotations

import json
import re
import socket
import time

import httpx
from conftest import MODEL, Server

MSG = [{"role": "user", "content": "hi"}]


def _connect(srv: Server) -> socket.socket:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _closed_after(sock: socket.socket) -> tuple[float, bytes]:
    """(seconds until the server closed the connection, everything it sent before)."""
    t0, data = time.monotonic(), b""
    while chunk := sock.recv(65536):
        data += chunk
    return time.monotonic() - t0, data


def test_stalled_clients_are_cut_off_and_everyone_else_is_served(make_server) -> None:
    """Slowloris: a client that trickles its headers, stalls its body, or idles on keep-alive must not hold a
    connection (a file descriptor) forever; `--client-timeout` bounds each. Nobody else notices."""
    srv = make_server("--client-timeout", "1", "--dp", "1", "--max-num-seqs", "2", "--sim-decode-step-ms", "50")
    head = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    trickle = _connect(srv)
    trickle.sendall(head)  # the head never ends
    stalled = [_connect(srv) for _ in range(4)]  # more than the two slots: a stalled body holds none
    for s in stalled:
        s.sendall(head + b"Content-Length: 100\r\n\r\n" + b'{"model":')
    idle = _connect(srv)
    idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert idle.recv(65536).startswith(b"HTTP/1.1 200")  # answered; now it idles on keep-alive

    # Meanwhile a stream outlives the timeout (it only bounds what the client sends), and a body sent in pieces
    # that arrives whole within the timeout gets through; one trickled past it gets 408, though no pause is long.
    body = {"model": MODEL, "messages": MSG, "max_tokens": 40, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=srv.url, timeout=30) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            t0 = time.monotonic()
            assert r.status_code == 200
            lines = list(r.iter_lines())
        assert time.monotonic() - t0 > 1.5 and lines[-2] == "data: [DONE]"
    payload = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 3}).encode()
    slow = _connect(srv)
    slow.sendall(head + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode())
    for i in range(0, len(payload), len(payload) // 3 + 1):
        time.sleep(0.15)
        slow.sendall(payload[i : i + len(payload) // 3 + 1])
    assert _closed_after(slow)[1].startswith(b"HTTP/1.1 200")
    trickled = _connect(srv)
    trickled.sendall(head + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode())
    t0 = time.monotonic()
    try:
        for i in range(0, len(payload), 8):
            time.sleep(0.3)
            trickled.sendall(payload[i : i + 8])
    except OSError:
        pass  # cut while still sending: what is asserted below
    waited, data = _closed_after(trickled)
    assert data.startswith(b"HTTP/1.1 408") and time.monotonic() - t0 < 3, (time.monotonic() - t0, data[:200])
    trickled.close()

    waited, data = _closed_after(trickle)
    assert data == b"" and waited < 3, (waited, data)
    waited, data = _closed_after(idle)
    assert data == b"" and waited < 3, (waited, data)
    for s in stalled:
        waited, data = _closed_after(s)
        head_part, _, answer = data.partition(b"\r\n\r\n")
        assert head_part.startswith(b"HTTP/1.1 408"), data
        err = json.loads(answer)["error"]
        assert err["code"] == "body_timeout" and err["type"] == "invalid_request_error", err
    assert httpx.get(f"{srv.url}/health").status_code == 200


def _metric(srv: Server, name: str, labels: str = "") -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=5).text
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*{re.escape(labels)}[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def _unread_stream(srv: Server, max_tokens: int) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer and never read from it."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    s.connect((host, int(port)))
    body = json.dumps(
        {"model": MODEL, "messages": MSG, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    ).encode()
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    return s


def _wait_for(cond, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return False


def test_a_finished_request_frees_its_slot_while_its_client_still_reads(make_server) -> None:
    """The engine finishes 20,000 tokens (megabytes of SSE) long before a client that does not read takes them:
    its slot must be free at once, not when the client is done, or a few such clients would 429 everyone."""
    srv = make_server(
        "--dp", "1", "--max-num-seqs", "1", "--max-model-len", "32768", "--stream-interval-ms", "0",
        "--max-stream-buffer-bytes", str(64 << 20),
    )  # fmt: skip
    quiet = _unread_stream(srv, 20_000)
    assert _wait_for(lambda: _metric(srv, "vllm:generation_tokens_total") >= 20_000, 30)
    assert _wait_for(lambda: _metric(srv, "vllm:num_requests_running") == 0, 5)
    for _ in range(3):  # the only slot is free although the response is still unread
        r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 2})
        assert r.status_code == 200, r.text
    quiet.settimeout(0.5)
    assert len(quiet.recv(4096)) > 0  # the connection is still there, and its response is still coming
    quiet.close()


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(make_server) -> None:
    """A client that reads nothing while its request runs: once the socket has stayed full for --client-timeout
    the connection is closed, the request aborted on its rank and its slot freed, long before max_tokens."""
    srv = make_server(
        "--dp", "1", "--max-num-seqs", "1", "--max-model-len", "131072", "--stream-interval-ms", "0",
        "--sim-decode-step-ms", "0.1", "--client-timeout", "1", "--max-stream-buffer-bytes", str(64 << 20),
    )  # fmt: skip
    quiet = _unread_stream(srv, 120_000)  # ~12 s of generation at 10k tokens/s
    assert _wait_for(lambda: _metric(srv, "deepinfer_aborted_requests_total", 'reason="client_disconnect"') == 1, 10)
    assert _metric(srv, "vllm:generation_tokens_total") < 100_000
    assert _metric(srv, "vllm:num_requests_running") == 0
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text
    quiet.settimeout(5)
    try:
        while quiet.recv(1 << 20):
            pass  # what was in flight, then the end
    except ConnectionResetError:
        pass
    quiet.close()


def test_the_request_timeout_holds_for_a_client_that_stopped_reading(make_server) -> None:
    """`--request-timeout` must not depend on the client reading: once its socket is full the response body is no
    longer polled, yet the request is aborted at the timeout (not at the much later client timeout or the end)."""
    srv = make_server(
        "--dp", "1", "--max-num-seqs", "1", "--max-model-len", "131072", "--stream-interval-ms", "0",
        "--sim-decode-step-ms", "0.1", "--request-timeout", "5", "--client-timeout", "60",
        "--max-stream-buffer-bytes", str(64 << 20),
    )  # fmt: skip
    quiet = _unread_stream(srv, 120_000)  # ~12 s of generation; the socket fills in ~2-3 s
    t0 = time.monotonic()
    assert _wait_for(lambda: _metric(srv, "deepinfer_aborted_requests_total", 'reason="timeout"') == 1, 10)
    assert 4 < time.monotonic() - t0 < 8
    assert _metric(srv, "vllm:generation_tokens_total") < 100_000
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text
    quiet.close()


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("VmRSS:")))


def test_a_reader_that_falls_behind_is_cut_and_holds_a_bounded_amount(make_server) -> None:
    """Streams nobody reads, with logprobs that make every token an event of kilobytes: each is cut once the server
    holds --max-stream-buffer-bytes for it (its request aborted as `slow_reader`, its slot freed), so the memory
    they hold is a small constant each, not max_tokens x top_logprobs."""
    srv = make_server(
        "--dp", "1", "--max-num-seqs", "8", "--max-model-len", "32768", "--stream-interval-ms", "0",
        "--sim-decode-step-ms", "1", "--max-stream-buffer-bytes", str(1 << 20),
    )  # fmt: skip
    body = {
        "model": MODEL, "messages": MSG, "max_tokens": 8000, "ignore_eos": True, "stream": True,
        "logprobs": True, "top_logprobs": 20,
    }  # fmt: skip
    # The first request with logprobs loads deepseek-recipe's tokenizer (tens of MB, once): not what is measured.
    warm = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "max_tokens": 50}, timeout=60)
    assert warm.status_code == 200
    before = _rss_kib(srv.proc.pid)
    quiet = []
    for _ in range(8):
        s = socket.socket()
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        host, port = srv.url.removeprefix("http://").rsplit(":", 1)
        s.connect((host, int(port)))
        raw = json.dumps(body).encode()
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(raw)}\r\n\r\n".encode()
            + raw
        )
        quiet.append(s)
    assert _wait_for(lambda: _metric(srv, "deepinfer_aborted_requests_total", 'reason="slow_reader"') == 8, 60)
    assert _metric(srv, "vllm:num_requests_running") == 0
    assert _metric(srv, "vllm:generation_tokens_total") < 8 * 8000
    grown_mib = (_rss_kib(srv.proc.pid) - before) / 1024
    assert grown_mib < 32, f"the server grew by {grown_mib:.0f} MiB for 8 unread streams"
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text
    for s in quiet:
        s.close()


def test_a_reader_that_takes_a_trickle_is_cut(make_server) -> None:
    """A client that takes a few bytes now and then keeps the socket full: any progress would reset a plain write
    timeout, but it must take 16 KiB per --client-timeout, so it is cut and its request aborted."""
    srv = make_server(
        "--dp", "1", "--max-num-seqs", "1", "--max-model-len", "131072", "--stream-interval-ms", "0",
        "--sim-decode-step-ms", "0.5", "--client-timeout", "1", "--max-stream-buffer-bytes", str(64 << 20),
    )  # fmt: skip
    s = _unread_stream(srv, 100_000)
    t0 = time.monotonic()
    cut = False
    while time.monotonic() - t0 < 15:
        time.sleep(0.25)
        try:
            if not s.recv(16):
                cut = True
                break
        except ConnectionResetError:
            cut = True
            break
        if _metric(srv, "deepinfer_aborted_requests_total", 'reason="client_disconnect"') == 1:
            cut = True
            break
    assert cut, "a reader taking 64 bytes a second was never cut"
    assert _wait_for(lambda: _metric(srv, "vllm:num_requests_running") == 0, 5)
    assert time.monotonic() - t0 < 12
    s.close()
