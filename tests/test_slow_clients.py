"""Clients that go quiet (trickled headers, stalled bodies, idle keep-alive, responses nobody reads) hold neither
engine capacity nor connections: `--client-timeout` bounds each, and a request's slot is free once its rank is done.
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
    # with pauses shorter than the timeout gets through.
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
        time.sleep(0.4)
        slow.sendall(payload[i : i + len(payload) // 3 + 1])
    assert _closed_after(slow)[1].startswith(b"HTTP/1.1 200")

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
    srv = make_server("--dp", "1", "--max-num-seqs", "1", "--max-model-len", "32768", "--stream-interval-ms", "0")
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
        "--sim-decode-step-ms", "0.1", "--client-timeout", "1",
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
    )  # fmt: skip
    quiet = _unread_stream(srv, 120_000)  # ~12 s of generation; the socket fills in ~2-3 s
    t0 = time.monotonic()
    assert _wait_for(lambda: _metric(srv, "deepinfer_aborted_requests_total", 'reason="timeout"') == 1, 10)
    assert 4 < time.monotonic() - t0 < 8
    assert _metric(srv, "vllm:generation_tokens_total") < 100_000
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text
    quiet.close()
