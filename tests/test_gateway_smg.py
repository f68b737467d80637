"""Two sim replicas behind the real SGLang Model Gateway (`smg launch`, the `smg` wheel from the test extra), on
loopback: model listing, JSON and streamed chat, x-request-id pass-through, the API key on both sides, the
gateway reading our /v1/loads, and a rolling restart under streamed load where each replica is stopped by a
SIGTERM to its whole process group and started again, with no failed request.

Gateway settings as docs/deploy.md recommends them: health checks every 2 s, one success to come back, a 5 s
circuit-breaker timeout (the defaults, 60 s and 60 s, keep a restarted replica out for a minute).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from conftest import MODEL, Server, free_ports, start_server, terminate, wait_for

SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
pytestmark = pytest.mark.skipif(
    SMG is None, reason="the smg wheel is not installed (pip install -e '.[test]' installs it from PyPI)"
)

KEY = "gateway-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "thinking": {"type": "disabled"}}


def start_replica(port: int, *args: str) -> Server:
    """A replica that leads its own process group, on a fixed port (the gateway knows it by URL)."""
    return start_server(
        "--served-model-name", MODEL, "--port", str(port), "--api-key", KEY, "--sim-decode-step-ms", "5", *args,
        new_session=True,
    )  # fmt: skip


@dataclass
class Gateway:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path
    replicas: dict[str, Server] = field(default_factory=dict)

    def workers(self) -> list[dict[str, object]]:
        return list(httpx.get(f"{self.url}/workers", headers=AUTH, timeout=5).json()["workers"])

    def healthy(self) -> set[str]:
        return {str(w["url"]) for w in self.workers() if w.get("is_healthy")}


def up(gw: Gateway) -> bool:
    """False until the gateway answers; fails at once, with its log, if it has exited."""
    if gw.proc.poll() is not None:
        pytest.fail(f"smg exited with {gw.proc.returncode}: {gw.log.read_text(errors='replace')[-3000:]}")
    return True


@contextlib.contextmanager
def smg(tmp_path: Path, *flags: str, replica_args: tuple[str, ...] = ()) -> Iterator[Gateway]:
    """Two replicas and `smg launch` in front of them (round robin unless `flags` pick another policy)."""
    *ports, port, metrics = free_ports(4)
    replicas = {f"http://127.0.0.1:{p}": start_replica(p, *replica_args) for p in ports}
    log = tmp_path / "smg.log"
    cmd = [
        str(SMG), "launch", "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *replicas,
        "--policy", "round_robin", "--api-key", KEY,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics),
        "--health-check-interval-secs", "2", "--health-success-threshold", "1", "--health-failure-threshold", "1",
        "--cb-timeout-duration-secs", "5", "--log-level", "info", *flags,
    ]  # fmt: skip
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    gw = Gateway(proc, f"http://127.0.0.1:{port}", log, replicas)
    try:
        wait_for("the gateway to list both replicas as healthy", lambda: up(gw) and gw.healthy() == set(replicas), 60)
        yield gw
    finally:
        terminate(proc)
        for srv in gw.replicas.values():
            srv.stop()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[Gateway]:
    with smg(tmp_path) as gw:
        yield gw


def streamed_chat(
    client: httpx.Client, max_tokens: int, request_id: str | None = None, last: list[str] | None = None
) -> tuple[str, str]:
    """One streamed chat through the gateway; returns (routed worker, failure or ""). `last` gets its final
    data payloads."""
    headers = {**AUTH, **({"x-request-id": request_id} if request_id else {})}
    body = {**CHAT, "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    try:
        with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            worker = r.headers.get("x-smg-routed-worker-id", "?")
            if r.status_code != 200:
                return worker, f"HTTP {r.status_code}: {r.read()[:300]!r}"
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    except httpx.HTTPError as e:
        return "?", f"{type(e).__name__}: {e}"
    if last is not None:
        last.extend(events[-2:])
    if not events or events[-1] != "[DONE]":
        return worker, f"no [DONE]: {events[-2:]}"
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        return worker, f"error event: {chunks[-1]}"
    usage = chunks[-1].get("usage") or {}
    if usage.get("completion_tokens") != max_tokens:
        return worker, f"usage {usage}"
    return worker, ""


def test_models_json_and_streamed_chat_and_request_id_through_smg(gateway: Gateway) -> None:
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        # one key on the gateway and the replicas: clients need it at the gateway, which sends it on
        assert c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}).status_code == 401
        models = c.get("/v1/models", headers=AUTH).json()
        assert MODEL in [m["id"] for m in models["data"]]
        routed = Counter()
        for i in range(6):
            r = c.post(
                "/v1/chat/completions", json={**CHAT, "max_tokens": 5}, headers={**AUTH, "x-request-id": f"gw-{i}"}
            )
            assert r.status_code == 200, r.text
            assert r.json()["usage"]["completion_tokens"] == 5
            assert r.headers["x-request-id"] == f"gw-{i}"
            routed[r.headers["x-smg-routed-worker-id"]] += 1
        assert set(routed) == set(gateway.replicas), routed  # round robin reached both replicas
        worker, failure = streamed_chat(c, 12, request_id="gw-stream-1")
        assert failure == "", failure
    # the id reached the replica that ran the request, in its request log line (logs arrive asynchronously)
    wait_for("the stream's log line", lambda: "request_id=gw-stream-1 " in gateway.replicas[worker].log(), 5)
    for i in range(6):
        logged = lambda i=i: any(f"request_id=gw-{i} " in srv.log() for srv in gateway.replicas.values())  # noqa: E731
        wait_for(f"gw-{i}'s log line", logged, 5)


def test_smg_reads_our_loads_for_each_replica(gateway: Gateway) -> None:
    """smg polls each replica (with the key) and reports what our /v1/loads said: one DP rank, its KV capacity."""

    def loads() -> dict[str, dict[str, object]]:
        got = httpx.get(f"{gateway.url}/get_loads", headers=AUTH, timeout=5).json()["loads"]
        return {str(e["worker"]): e for e in got}

    wait_for("smg to report both replicas' loads", lambda: set(loads()) == set(gateway.replicas))
    for entry in loads().values():
        assert entry["max_total_num_tokens"] == 16 * 32768  # --max-num-seqs x --max-model-len (the sim's KV)
        assert entry["max_running_requests"] == 16


def test_rolling_restart_with_group_sigterm_loses_no_request(gateway: Gateway) -> None:
    failures: list[str] = []
    done: list[tuple[float, str]] = []
    stop = threading.Event()

    def client_loop(k: int) -> None:
        with httpx.Client(base_url=gateway.url, timeout=60) as c:
            while not stop.is_set():
                worker, failure = streamed_chat(c, 40)
                if failure:
                    failures.append(f"client {k} via {worker}: {failure}")
                else:
                    done.append((time.monotonic(), worker))

    clients = [threading.Thread(target=client_loop, args=(k,)) for k in range(4)]
    for t in clients:
        t.start()
    try:
        time.sleep(1.0)
        for url in list(gateway.replicas):
            old = gateway.replicas[url]
            os.killpg(old.proc.pid, signal.SIGTERM)  # the replica's whole process group, as systemd or tini -g do
            assert old.proc.wait(timeout=30) == 0, f"{url} lost requests in its drain:\n{old.log()[-2000:]}"
            old.stop()
            port = int(url.rsplit(":", 1)[1])
            gateway.replicas[url] = start_replica(port)
            back = time.monotonic()
            wait_for(f"the gateway to route to the restarted {url}",
                     lambda u=url, t=back: sum(1 for ts, w in done if w == u and ts > t) >= 3)  # fmt: skip
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=60)
    assert not failures, failures[:5]
    per_worker = Counter(w for _, w in done)
    assert set(per_worker) == set(gateway.replicas) and len(done) > 40, per_worker


def test_sigkill_of_one_replica_ends_only_its_streams_with_the_gateways_error_event(gateway: Gateway) -> None:
    victim, survivor = list(gateway.replicas)
    results: dict[int, tuple[str, str, list[str]]] = {}

    def one(i: int) -> None:
        tail: list[str] = []
        with httpx.Client(base_url=gateway.url, timeout=30) as c:
            worker, failure = streamed_chat(c, 400, last=tail)
        results[i] = (worker, failure, tail)

    streams = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for t in streams:
        t.start()
    running = lambda u: httpx.get(f"{u}/get_load").json()["load"]  # noqa: E731
    wait_for("streams on both replicas", lambda: running(victim) == running(survivor) == 3)
    os.killpg(gateway.replicas[victim].proc.pid, signal.SIGKILL)  # the server and its ranks, no drain
    for t in streams:
        t.join(timeout=30)
        assert not t.is_alive(), "a stream hangs after the SIGKILL"
    on_victim = [r for r in results.values() if r[0] == victim]
    on_survivor = [r for r in results.values() if r[0] == survivor]
    assert len(on_victim) + len(on_survivor) == 6 and on_victim and on_survivor, results
    assert all(failure == "" for _, failure, _ in on_survivor), on_survivor
    for _, failure, tail in on_victim:  # cut: the gateway's error event, then [DONE]
        assert failure.startswith("error event") and tail[-1] == "[DONE]", (failure, tail)
        assert json.loads(tail[-2])["error"]["type"] == "stream_error"
    with httpx.Client(base_url=gateway.url, timeout=30) as c:  # new requests go to the survivor
        for _ in range(4):
            worker, failure = streamed_chat(c, 5)
            assert (worker, failure) == (survivor, "")


def test_power_of_two_sends_fewer_requests_to_the_replica_reporting_more_load(tmp_path: Path) -> None:
    """smg's power_of_two (its default metric, expected wait) on what /v1/loads reports, polled every second here.
    smg 1.13.0 weighs a replica's reported requests against what it has sent each replica since the last poll: with
    12 of 16 slots running on one replica, sequential requests go 4 : 16 (10 : 10 when neither reports load)."""
    flags = ["--policy", "power_of_two", "--load-monitor-interval", "1"]
    with smg(tmp_path, *flags) as gw:
        busy, idle = list(gw.replicas)
        stop = threading.Event()

        def hold() -> None:  # long streams straight to `busy`
            body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
            with (
                httpx.Client(timeout=60) as c,
                c.stream("POST", f"{busy}/v1/chat/completions", json=body, headers=AUTH) as r,
            ):
                assert r.status_code == 200
                lines = r.iter_lines()
                next(lines)
                stop.wait(30)

        holders = [threading.Thread(target=hold) for _ in range(12)]
        for t in holders:
            t.start()
        try:

            def running() -> dict[str, int]:
                got = httpx.get(f"{gw.url}/get_loads", headers=AUTH, timeout=5).json()["loads"]
                return {str(e["worker"]): int(e["num_running_reqs"]) for e in got}

            wait_for("smg to see busy's running requests", lambda: running() == {busy: 12, idle: 0})
            with httpx.Client(base_url=gw.url, timeout=30) as c:
                for i in range(20):
                    headers = {**AUTH, "x-request-id": f"p2-{i}"}
                    r = c.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2}, headers=headers)
                    assert r.status_code == 200, r.text

            def seen() -> dict[str, int]:
                return {u: sum(f"request_id=p2-{i} " in r.log() for i in range(20)) for u, r in gw.replicas.items()}

            wait_for("every request's log line", lambda: sum(seen().values()) == 20, 5)  # logs arrive async
            assert seen()[busy] <= 6, seen()
        finally:
            stop.set()
            for t in holders:
                t.join(timeout=30)


def test_sglangs_generate_through_smg(gateway: Gateway) -> None:
    """SGLang's native /generate through SGLang's own gateway, in front of both replicas: JSON, n samples, a stream
    and a refusal; the key needed at the gateway, and the rid the replica's id for the request."""
    body = {"text": "Once upon", "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}}
    with httpx.Client(base_url=gateway.url, timeout=30) as c:
        assert c.post("/generate", json=body).status_code == 401
        routed = Counter()
        for i in range(4):
            r = c.post("/generate", json={**body, "rid": f"smg-gen-{i}"}, headers=AUTH)
            assert r.status_code == 200, r.text
            out = r.json()
            assert out["meta_info"]["completion_tokens"] == 6 == len(out["output_ids"])
            assert out["meta_info"]["id"] == f"smg-gen-{i}" and out["meta_info"]["weight_version"] == "default"
            routed[r.headers.get("x-smg-routed-worker-id", "?")] += 1
        assert set(routed) == set(gateway.replicas), routed  # round robin reached both replicas
        # smg takes one prompt per /generate (its own schema refuses a list of texts, a 422); n samples of it work.
        fanned = c.post(
            "/generate", json={**body, "sampling_params": {**body["sampling_params"], "n": 3}}, headers=AUTH
        )
        assert fanned.status_code == 200, fanned.text
        assert [o["meta_info"]["completion_tokens"] for o in fanned.json()] == [6] * 3
        with c.stream("POST", "/generate", json={**body, "stream": True}, headers=AUTH) as s:
            assert s.status_code == 200
            data = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "[DONE]" and json.loads(data[-2])["meta_info"]["finish_reason"]["type"] == "length"
        bad = c.post("/generate", json={"text": "x", "sampling_params": {"min_p": 0.5}}, headers=AUTH)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "sampling_params.min_p"
