"""Load and fault injection over real HTTP: overload bursts, disconnect storms, SIGKILL of the server and of a rank.

Each test prints its figures (counts, timings, memory) so `pytest -s` shows them.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from conftest import MODEL, Server, shm_segments, sse_events

LEAK = re.compile(r"Traceback|File \"|\.rs:\d+|panicked")


def body(max_tokens: int, stream: bool = False, **extra: Any) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "go"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "thinking": {"type": "disabled"},
        "stream": stream,
        **extra,
    }
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


def assert_envelope(resp: httpx.Response, code: str) -> None:
    doc = resp.json()
    assert set(doc) == {"error"} and set(doc["error"]) == {"message", "type", "param", "code"}, doc
    assert doc["error"]["code"] == code, doc
    assert not LEAK.search(doc["error"]["message"]), doc


def metric(url: str, name: str, **labels: str) -> list[float]:
    """Every sample value of `name` whose labels include `labels`."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    out = []
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        m = re.match(r"([^{\s]+)(?:\{([^}]*)\})?\s+(\S+)", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            out.append(float(m.group(3)))
    return out


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def pid_alive(pid: int) -> bool:
    """True while the process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


class HealthPoller:
    """Polls /health in a thread; remembers every status and the slowest answer."""

    def __init__(self, url: str, period: float = 0.05) -> None:
        self.url, self.period = url, period
        self.statuses: dict[int | str, int] = {}
        self.slowest = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as c:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    key: int | str = c.get(f"{self.url}/health").status_code
                except httpx.HTTPError as e:
                    key = type(e).__name__
                self.slowest = max(self.slowest, time.monotonic() - t0)
                self.statuses[key] = self.statuses.get(key, 0) + 1
                self._stop.wait(self.period)

    def __enter__(self) -> HealthPoller:
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(timeout=10)


# ------------------------------------------------------------------------------------------------------ overload


def test_overload_burst_of_ten_times_capacity(make_server) -> None:
    srv: Server = make_server("--dp", "2", "--max-num-seqs", "4", "--sim-decode-step-ms", "20")
    # 150 tokens at 20 ms a step keep each admitted request busy for 3 s: far longer than the send spread of an
    # 80-thread burst on a loaded 2-core machine (up to 1 s seen), so no slot is freed while the burst still arrives.
    capacity, total, tokens = 8, 80, 150
    clients = [httpx.Client(base_url=srv.url, timeout=30) for _ in range(total)]
    for c in clients:  # connect before the burst, so the burst is only the requests
        assert c.get("/health").status_code == 200
    barrier = threading.Barrier(total)
    results: list[dict[str, Any]] = [{} for _ in range(total)]

    def one(i: int) -> None:
        stream = i % 2 == 0
        c = clients[i]
        barrier.wait()
        t0 = time.monotonic()
        res = results[i]
        res["stream"], res["sent"] = stream, t0
        if not stream:
            r = c.post("/v1/chat/completions", json=body(tokens))
            res["status"], res["headers"] = r.status_code, r.headers
            if r.status_code == 200:
                res["completion_tokens"] = r.json()["usage"]["completion_tokens"]
            else:
                res["resp"] = r
        else:
            with c.stream("POST", "/v1/chat/completions", json=body(tokens, stream=True)) as r:
                res["status"], res["headers"] = r.status_code, r.headers
                if r.status_code == 200:
                    events = sse_events(r)
                    assert events[-1] == "[DONE]"
                    res["completion_tokens"] = json.loads(events[-2])["usage"]["completion_tokens"]
                else:
                    r.read()
                    res["resp"] = r
        res["elapsed"] = time.monotonic() - t0

    with HealthPoller(srv.url) as health:
        t_start = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(total)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        wall = time.monotonic() - t_start
    for c in clients:
        c.close()
    assert all(not t.is_alive() for t in threads)

    ok = [r for r in results if r["status"] == 200]
    rejected = [r for r in results if r["status"] == 429]
    spread = max(r["sent"] for r in results) - min(r["sent"] for r in results)
    rej_times = sorted(r["elapsed"] for r in rejected)
    print(
        f"\noverload: {total} requests at capacity {capacity}: ok={len(ok)} "
        f"(stream {sum(r['stream'] for r in ok)}), 429={len(rejected)} "
        f"(stream {sum(r['stream'] for r in rejected)}), other={total - len(ok) - len(rejected)}; "
        f"send spread {spread * 1000:.0f} ms, 429 latency median {rej_times[len(rej_times) // 2] * 1000:.1f} ms "
        f"max {rej_times[-1] * 1000:.1f} ms, admitted e2e max {max(r['elapsed'] for r in ok):.2f} s, "
        f"wall {wall:.2f} s; "
        f"/health statuses {health.statuses}, slowest {health.slowest * 1000:.1f} ms"
    )
    assert spread < min(r["elapsed"] for r in ok), "the burst took longer to send than a request takes to finish"
    assert len(ok) == capacity and len(rejected) == total - capacity, [r["status"] for r in results]
    assert {r["stream"] for r in rejected} == {True, False}
    for r in rejected:
        assert r["headers"]["retry-after"] == "1"
        assert r["headers"]["content-type"].startswith("application/json")
        assert_envelope(r["resp"], "rate_limit_exceeded")
    assert all(r["completion_tokens"] == tokens for r in ok), [r.get("completion_tokens") for r in ok]
    assert set(health.statuses) == {200}, health.statuses


# ---------------------------------------------------------------------------------------------- disconnect storm

CONTENT = re.compile(rb'"content":"[^"]')


async def open_and_drop(port: int, payload: bytes, timeout: float = 20.0) -> int:
    """Open a stream on a raw socket, read until the first content chunk, then drop the connection.

    Returns the HTTP status (200 when a content chunk was seen)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def read_until_content() -> int:
        buf = b""
        while True:
            chunk = await reader.read(65536)
            if not chunk:
                raise AssertionError(f"connection closed before a content chunk: {buf[:300]!r}")
            buf += chunk
            status = int(buf[9:12]) if len(buf) >= 12 else 0
            if status and status != 200:
                return status
            if CONTENT.search(buf):
                return 200

    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        await writer.drain()
        return await asyncio.wait_for(read_until_content(), timeout)
    finally:
        writer.transport.abort()  # drop the connection at once, mid-stream


async def wave(port: int, n: int, payload: bytes) -> list[int]:
    statuses = await asyncio.gather(*(open_and_drop(port, payload) for _ in range(n)))
    await asyncio.sleep(0.01)  # let the aborted transports run connection_lost and close their sockets
    return statuses


def test_disconnect_storm(make_server) -> None:
    capacity, total = 128, 1000
    srv: Server = make_server("--dp", "2", "--max-num-seqs", "64", "--sim-decode-step-ms", "5")
    port = int(srv.url.rsplit(":", 1)[1])
    payload = json.dumps(body(30000, stream=True)).encode()
    pid = srv.proc.pid

    def settle(timeout: float = 5.0) -> float:
        """Seconds until num_requests_running is 0 (fails after `timeout`)."""
        t0 = time.monotonic()
        while metric(srv.url, "vllm:num_requests_running", model_name=MODEL) != [0.0]:
            assert time.monotonic() - t0 < timeout, "requests still running"
            time.sleep(0.02)
        return time.monotonic() - t0

    # warm-up wave, then the baseline
    assert asyncio.run(wave(port, capacity, payload)) == [200] * capacity
    settle()
    rss0 = rss_kb(pid)
    rings0 = metric(srv.url, "deepinfer_ring_used_bytes")

    t0 = time.monotonic()
    statuses: dict[int, int] = {}
    done = 0
    while done < total:
        n = min(capacity, total - done)
        # a slot frees asynchronously after a drop: retry a 429 once the previous wave has settled
        for s in asyncio.run(wave(port, n, payload)):
            statuses[s] = statuses.get(s, 0) + 1
        done += n
        if done < total:
            settle()  # a dropped stream frees its slot asynchronously: let the wave's aborts land first
    storm = time.monotonic() - t0
    t_end = time.monotonic()
    settle_s = settle(1.0)
    again = asyncio.run(wave(port, capacity, payload))
    full_wave_s = time.monotonic() - t_end
    settle()
    time.sleep(0.2)
    rings1 = metric(srv.url, "deepinfer_ring_used_bytes")
    rss1 = rss_kb(pid)
    aborted = metric(srv.url, "deepinfer_aborted_requests_total", reason="client_disconnect")
    print(
        f"\ndisconnect storm: {total} streams in waves of {capacity} in {storm:.2f} s, statuses {statuses}; "
        f"running->0 after {settle_s * 1000:.0f} ms; next full wave of {capacity}: "
        f"{again.count(200)} admitted, {again.count(429)} x 429 in {full_wave_s:.2f} s; "
        f"ring used bytes before {sum(rings0):.0f} after {sum(rings1):.0f}; "
        f"aborted(client_disconnect) counter {sum(aborted):.0f}; "
        f"server RSS {rss0 / 1024:.1f} MB -> {rss1 / 1024:.1f} MB (+{(rss1 - rss0) / 1024:.1f} MB)"
    )
    assert statuses == {200: total}, statuses
    assert sum(aborted) >= total + 2 * capacity, aborted
    assert again == [200] * capacity
    assert full_wave_s < 1.0 + 1.0, "a full wave should be admitted within a second"  # + time to see first chunks
    assert sum(rings1) <= 4096, rings1
    assert rss1 - rss0 < 20 * 1024, (rss0, rss1)
    assert srv.proc.poll() is None


async def send_and_drop(port: int, payload: bytes, after_s: float) -> None:
    """Send a whole request and drop the connection `after_s` later, before reading any answer."""
    _reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    await asyncio.sleep(after_s)
    writer.transport.abort()


def test_disconnect_during_conversion_leaks_nothing(make_server) -> None:
    """The codec thread dispatches a request right after converting it; a client that already left must not leave
    it running or holding an admission slot. Long prompts keep both codec threads busy, so most of the 300 clients
    leave while their request waits for or is in conversion."""
    capacity = 64
    srv: Server = make_server("--dp", "2", "--max-num-seqs", str(capacity // 2), "--sim-decode-step-ms", "5")
    port = int(srv.url.rsplit(":", 1)[1])
    long = body(10000, stream=True, messages=[{"role": "user", "content": "word " * 6000}])  # ~12k tokens
    payload = json.dumps(long).encode()

    async def storm() -> None:
        for _ in range(3):  # dropped 0-40 ms after sending: queued for a codec thread, in conversion, or dispatched
            await asyncio.gather(*(send_and_drop(port, payload, i * 0.0004) for i in range(100)))

    asyncio.run(storm())
    t0 = time.monotonic()
    while True:  # the last conversions finish, their tickets drop and abort
        running = metric(srv.url, "vllm:num_requests_running", model_name=MODEL)
        waiting = metric(srv.url, "vllm:num_requests_waiting", model_name=MODEL)
        if running == [0.0] and waiting in ([0.0], []):
            break
        assert time.monotonic() - t0 < 20, (running, waiting)
        time.sleep(0.05)
    aborted = sum(metric(srv.url, "deepinfer_aborted_requests_total", reason="client_disconnect"))
    # every slot came back: a full wave of streams is admitted and gets content
    again = asyncio.run(wave(port, capacity, json.dumps(body(30000, stream=True)).encode()))
    assert again == [200] * capacity, again
    print(f"\naborted after dispatch: {aborted:.0f} of 300")
    assert aborted > 0  # some were dispatched before their client was seen gone, and were aborted on their rank
    assert srv.proc.poll() is None


# ---------------------------------------------------------------------------------------------- SIGKILL of server


def test_sigkill_server_takes_ranks_and_segments_with_it(make_server) -> None:
    before = shm_segments()
    srv: Server = make_server("--dp", "2")
    ranks = srv.rank_pids()
    assert len(ranks) == 2, ranks
    mine = {s for s in shm_segments() - before if s.startswith(f"deepinfer-{srv.proc.pid}-")}
    t0 = time.monotonic()
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(timeout=5)
    alive = list(ranks)
    while alive and time.monotonic() - t0 < 5:
        alive = [p for p in ranks if pid_alive(p)]
        time.sleep(0.02)
    gone_after = time.monotonic() - t0
    left = {s for s in shm_segments() if s.startswith(f"deepinfer-{srv.proc.pid}-")}
    print(
        f"\nSIGKILL server pid {srv.proc.pid}: ranks {ranks} gone after {gone_after * 1000:.0f} ms "
        f"(still alive: {alive}); its segments while running: {sorted(mine)}, left after: {sorted(left)}"
    )
    for p in alive:  # don't leak processes if the assertion below fails
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)
    assert not alive, f"rank processes survived the server: {alive}"
    assert not left, left


def test_stale_segments_of_dead_pids_are_removed_at_start(make_server) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert not pid_alive(dead.pid)
    stale = Path(f"/dev/shm/deepinfer-{dead.pid}-deadbeef-r0-req")
    live = Path(f"/dev/shm/deepinfer-{os.getpid()}-cafebabe-r0-req")
    try:
        stale.write_bytes(b"\0" * 4096)
        live.write_bytes(b"\0" * 4096)
        srv: Server = make_server("--dp", "1")
        print(
            f"\nstale segment {stale.name}: exists after start = {stale.exists()}; "
            f"live-owner segment {live.name}: exists after start = {live.exists()}"
        )
        assert not stale.exists(), "stale segment of a dead pid was not removed"
        assert live.exists(), "a segment whose owner pid is alive must be left alone"
        assert srv.proc.poll() is None
    finally:
        for p in (stale, live):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


# ------------------------------------------------------------------------------------------- rank SIGKILL on load


def test_rank_sigkill_mid_load(make_server) -> None:
    before = shm_segments()
    grace = 2.0
    srv: Server = make_server(
        "--dp", "2", "--max-num-seqs", "4", "--sim-decode-step-ms", "10", "--exit-on-rank-failure", str(grace)
    )
    n = 8
    results: list[list[str] | BaseException] = [[] for _ in range(n)]
    started = threading.Barrier(n + 1)

    def consume(i: int) -> None:
        events: list[str] = []
        try:
            with (
                httpx.Client(base_url=srv.url, timeout=httpx.Timeout(30, read=15)) as c,
                c.stream("POST", "/v1/chat/completions", json=body(30000, stream=True)) as r,
            ):
                assert r.status_code == 200
                signalled = False
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if not signalled and '"content":"' in line and '"content":""' not in line:
                            signalled = True
                            started.wait(timeout=20)
            results[i] = events
        except BaseException as e:
            results[i] = e
            if not started.broken:
                started.abort()

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        started.wait(timeout=20)  # every stream produced content: all 8 slots are busy
    except threading.BrokenBarrierError:
        seen = [r if isinstance(r, BaseException) else f"{len(r)} events" for r in results]
        raise AssertionError(f"not every stream produced content: {seen}\n{srv.log()[-3000:]}") from None
    victim = srv.rank_pids()[0]
    t0 = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    code = srv.proc.wait(timeout=grace + 15)
    exit_s = time.monotonic() - t0
    for t in threads:
        t.join(timeout=10)
    hung = sum(t.is_alive() for t in threads)
    ended_with_error = sum(
        1
        for ev in results
        if isinstance(ev, list)
        and len(ev) >= 2
        and ev[-1] == "[DONE]"
        and '"error"' in ev[-2]
        and "usage" not in ev[-2]
    )
    other = [
        (ev if isinstance(ev, BaseException) else ev[-2:])
        for ev in results
        if not (isinstance(ev, list) and len(ev) >= 2 and ev[-1] == "[DONE]" and '"error"' in ev[-2])
    ]
    left = {s for s in shm_segments() - before if s.startswith(f"deepinfer-{srv.proc.pid}-")}  # other servers may run
    print(
        f"\nrank SIGKILL mid-load: server exit code {code} after {exit_s:.2f} s (grace {grace} s); "
        f"{ended_with_error}/{n} streams ended with an error event + [DONE], hung {hung}, "
        f"others {other[:4]}; segments left {sorted(left)}"
    )
    assert code != 0
    assert exit_s < grace + 1.5, exit_s
    assert hung == 0
    assert not left, left
    assert ended_with_error == n, results
