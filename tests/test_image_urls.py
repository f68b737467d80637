"""Image URLs over real HTTP: the front end fetches them behind its address guard. A local image server on
loopback is refused by default and served when the operator allows it; a redirect from an allowed host to
loopback is refused; a slow host trips the fetch deadline and frees the request's slot; a failed fetch says
whether a retry may help (`x-should-retry`, which the openai and anthropic SDKs read)."""

from __future__ import annotations

import http.server
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from test_images import NO_THINK, echo, expected, picture


class ImageHost:
    """A tiny HTTP server with a few routes: /ok.png, /ok.jpg, /slow.png (answers after `slow_s`), /gone (404),
    /broken (500), /redirect?to=URL (302)."""

    def __init__(self, host: str = "127.0.0.1", slow_s: float = 3.0) -> None:
        self.png, self.jpeg = picture(256, 160), picture(300, 300, "JPEG")
        self.hits: list[str] = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer.hits.append(self.path)
                if self.path.startswith("/redirect?to="):
                    self.send_response(302)
                    self.send_header("Location", self.path.split("=", 1)[1])
                    self.end_headers()
                    return
                if self.path == "/slow.png":
                    time.sleep(slow_s)
                body, ctype, status = {
                    "/ok.png": (outer.png, "image/png", 200),
                    "/slow.png": (outer.png, "image/png", 200),
                    "/ok.jpg": (outer.jpeg, "image/jpeg", 200),
                    "/broken": (b"oops", "text/plain", 500),
                }.get(self.path, (b"no", "text/plain", 404))
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", ctype)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass

        self.httpd = http.server.ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def host() -> Iterator[ImageHost]:
    h = ImageHost()
    yield h
    h.close()


@pytest.fixture(scope="module")
def guarded() -> Iterator[Server]:
    s = start_server("--served-model-name", MODEL, "--max-num-seqs", "1", "--media-fetch-timeout", "1")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def allowed() -> Iterator[Server]:
    s = start_server(
        "--served-model-name",
        MODEL,
        "--max-num-seqs",
        "1",
        "--media-fetch-timeout",
        "1",
        "--allowed-media-networks",
        "127.0.0.1/32",
    )
    yield s
    s.stop()


def ask(url: str, detail: str = "auto") -> list[dict[str, Any]]:
    return [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "sim:images what is this?"},
                {"type": "image_url", "image_url": {"url": url, "detail": detail}},
            ],
        }
    ]


def post(srv: Server, messages: list[dict[str, Any]]) -> httpx.Response:
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        return h.post(
            "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 200, **NO_THINK}
        )


def test_loopback_urls_are_refused_by_default(guarded: Server, host: ImageHost) -> None:
    before = len(host.hits)
    with pytest.raises(openai.BadRequestError) as e:
        guarded.client().chat.completions.create(
            model=MODEL,
            messages=ask(f"{host.url}/ok.png"),
            max_tokens=5,  # type: ignore[arg-type]
        )
    err = e.value.body if isinstance(e.value.body, dict) else {}
    assert err.get("code") == "image_url_refused", err
    assert err.get("param") == "messages[0].content[1].image_url.url", err
    assert e.value.response.headers.get("x-should-retry") == "false"
    for url in (
        "http://localhost:1/x.png",
        "http://[::1]:1/x.png",
        "http://2130706433/x.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://10.0.0.1/x.png",
        "file:///etc/passwd",
        "ftp://example.com/x.png",
        "gopher://x/",
    ):
        r = post(guarded, ask(url))
        assert r.status_code == 400, (url, r.text)
        assert r.json()["error"]["code"] in ("image_url_refused", "image_scheme_unsupported"), (url, r.text)
    assert len(host.hits) == before  # nothing was fetched


def test_an_allowed_host_is_fetched_with_the_openai_sdk(allowed: Server, host: ImageHost) -> None:
    r = allowed.client().chat.completions.create(
        model=MODEL,
        messages=ask(f"{host.url}/ok.jpg", "low"),
        max_tokens=200,
        extra_body=NO_THINK,  # type: ignore[arg-type]
    )
    n, seen, _ = echo(r.choices[0].message.content or "")
    assert (n, seen) == (1, expected((host.jpeg, "low")))


def test_anthropic_url_image_block(allowed: Server, host: ImageHost) -> None:
    client = anthropic.Anthropic(base_url=allowed.url, api_key="x")
    msg = client.messages.create(
        model=MODEL,
        max_tokens=200,
        thinking={"type": "disabled"},
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "url", "url": f"{host.url}/ok.png"}},
                    {"type": "text", "text": "sim:images"},
                ],
            }
        ],  # type: ignore[list-item]
    )
    n, seen, _ = echo("".join(b.text for b in msg.content if b.type == "text"))
    assert (n, seen) == (1, expected((host.png, "high")))


def test_a_redirect_from_an_allowed_host_to_loopback_is_refused(host: ImageHost) -> None:
    # 127.0.0.2 is allowed, 127.0.0.1 (where the redirect points) is not.
    other = ImageHost("127.0.0.2")
    s = start_server("--served-model-name", MODEL, "--allowed-media-networks", "127.0.0.2/32")
    try:
        ok = post(s, ask(f"{other.url}/ok.png"))
        assert ok.status_code == 200, ok.text
        hits = len(host.hits)
        r = post(s, ask(f"{other.url}/redirect?to={host.url}/ok.png"))
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "image_url_refused", r.text
        assert len(host.hits) == hits  # the loopback host never saw the request
    finally:
        s.stop()
        other.close()


def test_a_slow_host_trips_the_deadline_and_frees_the_slot(allowed: Server, host: ImageHost) -> None:
    t0 = time.monotonic()
    r = post(allowed, ask(f"{host.url}/slow.png"))
    took = time.monotonic() - t0
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "image_fetch_timeout", r.text
    assert r.headers.get("x-should-retry") == "true"
    assert took < 2.5, took  # --media-fetch-timeout 1, the host answers after 3 s
    # --max-num-seqs 1: the slot is free again at once.
    ok = post(allowed, [{"role": "user", "content": "hi"}])
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(
    ("path", "code", "retry"), [("/gone", "image_fetch_failed", "false"), ("/broken", "image_fetch_failed", "true")]
)
def test_a_failed_fetch_says_whether_to_retry(
    allowed: Server, host: ImageHost, path: str, code: str, retry: str
) -> None:
    r = post(allowed, ask(f"{host.url}{path}"))
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == code, r.text
    assert r.headers.get("x-should-retry") == retry
