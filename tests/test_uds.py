"""`--uds PATH`: the server on a Unix socket instead of TCP, reached with httpx's UDS transport and the openai SDK:
requests, a stream, /health and /metrics; the socket's mode; a stale socket file replaced, a live one and a
plain file not; the file gone after the server stops."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import openai
import pytest
from conftest import MODEL, Server, sse_events, start_server, wait_for

NO_THINKING = {"thinking": {"type": "disabled"}}


@pytest.fixture(scope="module")
def sock_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("uds")


@pytest.fixture(scope="module")
def uds_server(sock_dir: Path) -> Iterator[tuple[Server, Path]]:
    path = sock_dir / "deepinfer.sock"
    # A socket file left behind by a server that is gone: nothing listens on it.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    assert path.exists()
    srv = start_server("--served-model-name", MODEL, "--uds", str(path))
    yield srv, path
    srv.stop()


@pytest.fixture
def http(uds_server: tuple[Server, Path]) -> Iterator[httpx.Client]:
    _, path = uds_server
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost", timeout=30) as c:
        yield c


def test_it_listens_on_the_socket_only(uds_server: tuple[Server, Path]) -> None:
    srv, path = uds_server
    assert srv.url == f"http+unix:{path}"
    assert f"replacing the stale socket {path}" in srv.log()
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o660, oct(mode)
    # No TCP port: the server process has no listening inet socket.
    inodes = {os.readlink(f"/proc/{srv.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{srv.proc.pid}/fd")}
    sockets = {i[len("socket:[") : -1] for i in inodes if i.startswith("socket:[")}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            assert not (fields[3] == "0A" and fields[9] in sockets), f"a TCP socket listens: {line}"


def test_health_metrics_and_a_request(http: httpx.Client, uds_server: tuple[Server, Path]) -> None:
    srv, _ = uds_server
    assert http.get("/health").json() == {"status": "ok"}
    assert "vllm:num_requests_running" in http.get("/metrics").text
    r = http.post(
        "/v1/chat/completions",
        headers={"x-request-id": "uds-request-1"},
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **NO_THINKING},
    )
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
    assert r.headers["x-request-id"] == "uds-request-1"
    # The request log line has no TCP peer to name, and is written all the same (once the request has ended).
    wait_for("the request's log line", lambda: "uds-request-1" in srv.log(), timeout=10)


def test_a_stream(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count"}],
        "max_tokens": 24,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
        **NO_THINKING,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert sum(1 for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")) >= 2
    assert chunks[-1]["usage"]["completion_tokens"] == 24


def test_the_openai_sdk(uds_server: tuple[Server, Path]) -> None:
    _, path = uds_server
    transport = httpx2.HTTPTransport(uds=str(path))
    with openai.OpenAI(
        base_url="http://localhost/v1",
        api_key="k",
        max_retries=0,
        http_client=openai.DefaultHttpxClient(transport=transport),
    ) as client:
        assert [m.id for m in client.models.list()] == [MODEL]
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, stream=True, extra_body=NO_THINKING
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)


def test_a_second_server_does_not_take_over_a_live_socket(uds_server: tuple[Server, Path], http: httpx.Client) -> None:
    _, path = uds_server
    cmd = [sys.executable, "-m", "deepinfer_server", "--uds", str(path), "--served-model-name", MODEL]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r
    assert f"start-up failed: --uds {path}: another process is listening on this socket" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    assert http.get("/health").status_code == 200, "the first server still answers on it"


def test_a_plain_file_is_never_replaced(sock_dir: Path) -> None:
    path = sock_dir / "not-a-socket"
    path.write_text("keep me")
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer_server", "--uds", str(path)], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and f"--uds {path}: exists and is not a socket" in r.stderr.splitlines()[-1], r.stderr
    assert path.read_text() == "keep me"


def test_the_socket_file_goes_when_the_server_stops(sock_dir: Path) -> None:
    path = sock_dir / "short-lived.sock"
    srv = start_server("--served-model-name", MODEL, "--uds", str(path))
    with httpx.Client(transport=httpx.HTTPTransport(uds=str(path)), base_url="http://localhost") as c:
        assert c.get("/health").status_code == 200
    assert srv.stop() == 0
    assert not path.exists()
