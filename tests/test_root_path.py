"""`--root-path /deepinfer`: every route, /openapi.json and /metrics answer under the prefix and without it, directly
and behind nginx with a location prefix, both when nginx forwards the full path and when it strips the prefix;
the OpenAPI document names the prefix in `servers`."""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import nginx_replicas as nx

PREFIX = "/deepinfer"
NO_THINKING = {"thinking": {"type": "disabled"}}
# One nginx, two ways to mount the server under the prefix: `proxy_pass` without a URI forwards /deepinfer/v1/...
# as it is; with one (the trailing /) it replaces the location's prefix, so the server sees /v1/....
NGINX_CONF = """\
worker_processes 1;
daemon off;
pid nginx.pid;
error_log error.log notice;
events {{ worker_connections 256; }}
http {{
    access_log access.log;
    server {{
        listen 127.0.0.1:{forward};
        location {prefix}/ {{
            proxy_pass http://127.0.0.1:{upstream};
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
    server {{
        listen 127.0.0.1:{strip};
        location {prefix}/ {{
            proxy_pass http://127.0.0.1:{upstream}/;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


@pytest.fixture(scope="module")
def prefixed() -> Iterator[Server]:
    srv = start_server("--served-model-name", MODEL, "--root-path", f"{PREFIX}/")
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def nginx(prefixed: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """nginx in front of the server: {"forward": url, "strip": url}, each the proxy's address without the prefix."""
    if nx.NGINX is None:
        pytest.skip("nginx is not installed (scripts/test.sh installs Debian's nginx package as root)")
    workdir = tmp_path_factory.mktemp("nginx")
    ports = {"forward": nx.free_port(), "strip": nx.free_port()}
    upstream = prefixed.url.rsplit(":", 1)[1]
    (workdir / "nginx.conf").write_text(NGINX_CONF.format(prefix=PREFIX, upstream=upstream, **ports))
    cmd = [nx.NGINX, "-p", str(workdir), "-c", "nginx.conf", "-e", "error.log"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 15
        for port in ports.values():
            while True:
                with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                    break
                assert proc.poll() is None and time.monotonic() < deadline, (workdir / "error.log").read_text()
                time.sleep(0.05)
        yield {style: f"http://127.0.0.1:{port}" for style, port in ports.items()}
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_every_route_answers_under_the_prefix_and_without_it(prefixed: Server) -> None:
    with httpx.Client(base_url=prefixed.url, timeout=30) as c:
        for path in ("/health", "/v1/models", "/version", "/get_load"):
            assert c.get(f"{PREFIX}{path}").status_code == 200, path
            assert c.get(path).status_code == 200, path
        metrics = c.get(f"{PREFIX}/metrics")
        assert metrics.status_code == 200 and "vllm:num_requests_running" in metrics.text
        doc = c.get(f"{PREFIX}/openapi.json").json()
        assert doc["servers"] == [{"url": PREFIX}]
        assert c.get("/openapi.json").json()["servers"] == [{"url": PREFIX}]
        assert "/v1/chat/completions" in doc["paths"], "the paths stay relative to the server URL"
        # A query survives the rewrite.
        loads = c.get(f"{PREFIX}/v1/loads", params={"model": "other"})
        assert loads.status_code == 404 and loads.json()["error"]["code"] == "model_not_found"
        # Only the prefix itself is stripped, not a path that merely starts with its letters.
        assert c.get(f"{PREFIX}x/health").status_code == 404
        # Refusals after the rewrite keep the envelope of the door the stripped path names.
        r = c.get(f"{PREFIX}/v1/messages/no-such-route")
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error", r.text


def test_without_the_option_the_prefix_is_just_a_path(server: Server) -> None:
    assert httpx.get(f"{server.url}{PREFIX}/health", timeout=10).status_code == 404


@pytest.mark.parametrize("style", ["forward", "strip"])
def test_the_sdks_behind_nginx_under_the_prefix(nginx: dict[str, str], style: str) -> None:
    base = f"{nginx[style]}{PREFIX}"
    with openai.OpenAI(base_url=f"{base}/v1", api_key="k", max_retries=0) as client:
        r = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body=NO_THINKING
        )
        assert r.choices[0].message.content
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "count"}],
            max_tokens=16,
            stream=True,
            extra_body={**NO_THINKING, "ignore_eos": True},
        )
        deltas = [c.choices[0].delta.content for c in stream if c.choices and c.choices[0].delta.content]
        assert len(deltas) >= 2, deltas
    with anthropic.Anthropic(base_url=base, api_key="k", max_retries=0) as claude:
        m = claude.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "hi"}])
        assert m.content[0].type == "text" and m.content[0].text
    with httpx.Client(base_url=base, timeout=30) as c:
        assert c.get("/health").json() == {"status": "ok"}
        assert "vllm:e2e_request_latency_seconds" in c.get("/metrics").text
        assert c.get("/openapi.json").json()["servers"] == [{"url": PREFIX}]


def test_bad_root_paths_are_refused_at_start_up() -> None:
    for value, needle in (("deepinfer", "a path such as"), ("/v1", "routes itself"), ("/a b", "a path such as")):
        cmd = [sys.executable, "-m", "deepinfer_server", "--root-path", value]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and needle in r.stderr.splitlines()[-1], (value, r.stderr)
