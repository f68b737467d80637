"""Two sim replicas behind the real vllm-router (the `vllm-router` wheel from the test extra), on loopback:
start-up, routing of JSON and streamed chat, and power_of_two acting on our GET /get_load (it polls each worker's
{"load": int} and sends new requests to the replica that reports less)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from conftest import MODEL, Server, free_ports, start_server, terminate, wait_for

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
pytestmark = pytest.mark.skipif(
    ROUTER is None, reason="the vllm-router wheel is not installed (pip install -e '.[test]' installs it from PyPI)"
)

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "thinking": {"type": "disabled"}}


@dataclass
class Router:
    proc: subprocess.Popen[bytes]
    url: str
    replicas: list[Server]


@pytest.fixture
def router(tmp_path: Path) -> Iterator[Router]:
    replicas = [start_server("--served-model-name", MODEL, "--sim-decode-step-ms", "5") for _ in range(2)]
    port, metrics = free_ports(2)
    cmd = [
        str(ROUTER), "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *[r.url for r in replicas],
        "--policy", "power_of_two", "--worker-startup-check-interval", "1",  # also the load-poll interval
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
    ]  # fmt: skip
    with (tmp_path / "vllm-router.log").open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    rt = Router(proc, f"http://127.0.0.1:{port}", replicas)
    try:
        wait_for("the router to start", lambda: httpx.get(f"{rt.url}/v1/models", timeout=2).status_code == 200)
        yield rt
    finally:
        terminate(proc)
        for srv in replicas:
            srv.stop()


def finished(srv: Server, request_id: str) -> bool:
    return f"request_id={request_id} " in srv.log()


def test_start_up_and_json_and_streamed_chat(router: Router) -> None:
    with httpx.Client(base_url=router.url, timeout=30) as c:
        assert MODEL in [m["id"] for m in c.get("/v1/models").json()["data"]]
        r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5, r.text
        body = {**CHAT, "max_tokens": 8, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        with c.stream("POST", "/v1/chat/completions", json=body) as s:
            assert s.status_code == 200
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and '"completion_tokens":8' in events[-2]


def test_power_of_two_sends_new_requests_to_the_replica_reporting_less_load(router: Router) -> None:
    busy, idle = router.replicas
    stop = threading.Event()

    def hold() -> None:  # a long stream straight to `busy`, held open until the test ends
        body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{busy.url}/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            next(lines)
            stop.wait(30)

    holders = [threading.Thread(target=hold) for _ in range(5)]
    for t in holders:
        t.start()
    try:
        wait_for("busy to report its load", lambda: httpx.get(f"{busy.url}/get_load").json() == {"load": 5})
        workers = httpx.get(f"{router.url}/get_loads").json()["workers"]  # the router asks each /get_load now
        assert {w["worker"]: w["load"] for w in workers} == {busy.url: 5, idle.url: 0}
        time.sleep(2.5)  # the policy's own copy is refreshed every --worker-startup-check-interval (1 s)
        with httpx.Client(base_url=router.url, timeout=30) as c:
            for i in range(20):
                headers = {"x-request-id": f"p2-{i}"}
                r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 3}, headers=headers)
                assert r.status_code == 200, r.text

        def on(srv: Server) -> int:
            return sum(finished(srv, f"p2-{i}") for i in range(20))

        wait_for("every request's log line", lambda: on(idle) + on(busy) == 20, timeout=5)  # logs arrive async
        assert (on(idle), on(busy)) == (20, 0)
    finally:
        stop.set()
        for t in holders:
            t.join(timeout=30)
