"""Issue 39, points 5 and 6, over real HTTP: the key and the route are checked on the request head, before any body
deadline (a head nobody let in costs a few KB for a second at most), and writes a web page of another origin may
send without a CORS preflight (a form upload, a POST without a JSON body) are refused."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": MODEL, "messages": MSG, "max_tokens": 2}
KEY = "edge-key"
KEYED = {"Authorization": f"Bearer {KEY}"}
EVIL = "https://evil.example"


def _addr(srv: Server) -> tuple[str, int]:
    host, port = srv.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _fds(srv: Server) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def _rss_kib(srv: Server) -> int:
    status = Path(f"/proc/{srv.proc.pid}/status").read_text()
    m = re.search(r"VmRSS:\s+(\d+)", status)
    assert m is not None
    return int(m.group(1))


def _upload_head(length: int) -> bytes:
    return (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        + f"Content-Length: {length}\r\n\r\n".encode()
    )


def _answer_and_close(s: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sent on `s` within `within` seconds, and whether it closed the connection."""
    s.settimeout(within)
    got = b""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            chunk = s.recv(65536)
        except TimeoutError:
            return got, False
        if not chunk:
            return got, True
        got += chunk
    return got, False


# -- the key is checked first ---------------------------------------------------------------------------------------


def test_unauthenticated_upload_heads_do_not_starve_a_keyed_client(make_server: Any) -> None:
    """--max-connections worth of unauthenticated upload heads that send no body (half declaring 100 MB, half 100
    bytes) each get their 401 and a closed connection within a couple of seconds; a keyed client is answered
    meanwhile, and the server's descriptors and memory come back."""
    srv: Server = make_server("--api-key", KEY, "--max-connections", "200")
    host, port = _addr(srv)
    with httpx.Client(base_url=srv.url, headers=KEYED, timeout=30) as c:
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 200  # warm: the first request's costs
    fds0, rss0 = _fds(srv), _rss_kib(srv)
    socks = []
    for i in range(200):
        s = socket.create_connection((host, port), timeout=10)
        s.sendall(_upload_head(100_000_000 if i % 2 else 100))
        socks.append(s)
    rss_peak = _rss_kib(srv)
    t0 = time.monotonic()
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=CHAT, headers=KEYED, timeout=30)
    keyed_s = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert keyed_s < 3.0, f"the keyed client waited {keyed_s:.1f} s behind the heads"
    outcomes = [_answer_and_close(s, 5.0) for s in socks]
    for s in socks:
        s.close()
    refused = sum(got.startswith(b"HTTP/1.1 401") and b"invalid_api_key" in got for got, _ in outcomes)
    closed = sum(was_closed for _, was_closed in outcomes)
    assert (refused, closed) == (200, 200), outcomes[:2]
    t0 = time.monotonic()
    while _fds(srv) > fds0 + 2 and time.monotonic() - t0 < 5:
        time.sleep(0.1)
    assert _fds(srv) <= fds0 + 2, f"descriptors {fds0} before, {_fds(srv)} after"
    per_conn = (rss_peak - rss0) / 200
    print(
        f"keyed client answered in {keyed_s:.2f} s; RSS +{rss_peak - rss0} KiB for 200 heads ({per_conn:.1f} KiB each)"
    )
    assert per_conn < 32, f"{per_conn:.1f} KiB per refused head"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/files", "/no/such/route"])
def test_a_huge_declared_body_without_a_key_is_refused_at_once_and_closed(make_server: Any, path: str) -> None:
    srv: Server = make_server("--api-key", KEY)
    with socket.create_connection(_addr(srv), timeout=10) as s:
        t0 = time.monotonic()
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Content-Length: 10000000000\r\n\r\n{".encode()
        )
        got, closed = _answer_and_close(s, 5.0)
        took = time.monotonic() - t0
    head = got.split(b"\r\n\r\n")[0].lower()
    assert got.split(b"\r\n")[0] in (b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 404 Not Found"), got
    assert b"connection: close" in head and closed, got
    assert took < 2.0, f"{took:.1f} s"


def test_a_keyed_upload_keeps_its_long_deadline_and_a_chat_body_does_not_get_it(make_server: Any) -> None:
    """The upload deadline is granted past the key check: a keyed upload whose body takes longer than
    --client-timeout is stored; a chat body as slow gets its 408."""
    srv: Server = make_server("--api-key", KEY, "--client-timeout", "1.5")
    body = (
        b'--b\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="slow.jsonl"\r\n'
        b"Content-Type: application/octet-stream\r\n\r\n" + b'{"a": 1}\n' * 50 + b"\r\n--b--\r\n"
    )
    with socket.create_connection(_addr(srv), timeout=15) as s:
        s.sendall(
            _upload_head(len(body)).replace(b"Host: x\r\n", f"Host: x\r\nAuthorization: Bearer {KEY}\r\n".encode())
        )
        half = len(body) // 2
        s.sendall(body[:half])
        time.sleep(2.5)
        s.sendall(body[half:])
        got, _ = _answer_and_close(s, 10.0)
    assert got.startswith(b"HTTP/1.1 200"), got
    assert b'"filename":"slow.jsonl"' in got, got
    raw = json.dumps(CHAT).encode()
    with socket.create_connection(_addr(srv), timeout=15) as s:
        s.sendall(
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n".encode()
            + raw[:5]
        )
        time.sleep(2.5)
        with contextlib.suppress(OSError):
            s.sendall(raw[5:])
        with_rest, _ = _answer_and_close(s, 5.0)
    assert with_rest.startswith(b"HTTP/1.1 408"), with_rest


# -- cross-site writes refused --------------------------------------------------------------------------------------


def _form_upload(srv: Server, origin: str | None, name: str) -> httpx.Response:
    headers = {"Origin": origin} if origin else {}
    files = {"file": (name, b'{"a": 1}\n', "application/octet-stream")}
    return httpx.post(f"{srv.url}/v1/files", files=files, data={"purpose": "batch"}, headers=headers, timeout=30)


def _stored_files(srv: Server) -> dict[str, str]:
    """id: filename of every file the store holds (servers of one test run may share a store)."""
    r = httpx.get(f"{srv.url}/v1/files", timeout=30)
    assert r.status_code == 200, r.text
    return {f["id"]: f["filename"] for f in r.json()["data"]}


def _new_files(srv: Server, before: dict[str, str]) -> list[str]:
    return sorted(name for id_, name in _stored_files(srv).items() if id_ not in before)


def _refused_for_origin(r: httpx.Response) -> None:
    assert r.status_code == 403, r.text
    err = r.json()["error"]
    assert err["code"] == "origin_not_allowed" and EVIL in err["message"], err


def test_a_form_upload_from_another_origin_is_refused_without_cors(make_server: Any) -> None:
    srv: Server = make_server()
    before = _stored_files(srv)
    _refused_for_origin(_form_upload(srv, EVIL, "evil.jsonl"))
    r = _form_upload(srv, "null", "sandboxed.jsonl")
    assert r.status_code == 403, r.text
    r = _form_upload(srv, f"http://127.0.0.1:{_addr(srv)[1]}", "own.jsonl")
    assert r.status_code == 200, f"the server's own origin: {r.text}"
    r = _form_upload(srv, None, "sdk.jsonl")
    assert r.status_code == 200, f"no Origin (not a browser): {r.text}"
    assert _new_files(srv, before) == ["own.jsonl", "sdk.jsonl"]
    metrics = httpx.get(f"{srv.url}/metrics", timeout=30).text
    assert 'deepinfer_rejected_requests_total{reason="origin_not_allowed"} 2' in metrics


def test_with_cors_only_the_named_origin_may_upload(make_server: Any) -> None:
    srv: Server = make_server("--allowed-origins", "https://app.example")
    before = _stored_files(srv)
    _refused_for_origin(_form_upload(srv, EVIL, "evil.jsonl"))
    r = _form_upload(srv, "https://app.example", "app.jsonl")
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == "https://app.example"
    assert _new_files(srv, before) == ["app.jsonl"]


def test_a_post_without_a_body_from_another_origin_is_refused(make_server: Any) -> None:
    """A page may POST with no body and no preflight: a conversation, a cancel."""
    srv: Server = make_server()
    for path in ("/v1/conversations", "/v1/responses/resp_x/cancel", "/v1/batches/batch_x/cancel"):
        _refused_for_origin(httpx.post(srv.url + path, headers={"Origin": EVIL}, timeout=30))
    # The Anthropic door's envelope under /v1/messages.
    r = httpx.post(f"{srv.url}/v1/messages/batches/msgbatch_x/cancel", headers={"Origin": EVIL}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error", r.text
    # Without an Origin (no browser) the same bodiless create is served.
    r = httpx.post(f"{srv.url}/v1/conversations", timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "conversation", r.text


def _prompt_tokens(srv: Server) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=30).text
    m = re.search(r"^vllm:prompt_tokens_total\{[^}]*\} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", CHAT),
        ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 2}),
        ("/v1/conversations", {"items": [{"role": "user", "content": "hi"}]}),
        ("/v1/messages", {"model": MODEL, "messages": MSG, "max_tokens": 2}),
    ],
)
def test_a_body_without_a_content_type_is_refused(server: Server, path: str, body: dict[str, Any]) -> None:
    """What a page's fetch() with a Blob body sends: no Content-Type, no preflight, and (here) no Origin either."""
    srv = server
    before = _prompt_tokens(srv)
    r = httpx.post(srv.url + path, content=json.dumps(body).encode(), timeout=30)
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert "Content-Type" in err["message"], err
    if path != "/v1/messages":
        assert (err["code"], err["param"]) == ("unsupported_media_type", "Content-Type"), err
    assert "object" not in r.json() and "id" not in r.json(), "nothing created"
    assert _prompt_tokens(srv) == before, "nothing was generated"
    r = httpx.post(srv.url + path, json=body, timeout=30)
    assert r.status_code == 200, f"the same request as JSON: {r.text}"
    if path != "/v1/conversations":
        assert _prompt_tokens(srv) > before, "the counter the refusal is checked by does count"
