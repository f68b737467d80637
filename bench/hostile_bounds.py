"""What the unbounded-input attacks of issue 39 (points 2 and 7) cost the server: RSS (VmRSS) before, at its peak
and after each attack, how long the attack took to be answered, and the latency of a plain chat request beside it.
The figures go into BENCHMARKS.md's attack table; tests/test_hostile_bounds.py holds the behaviour.

    python bench/hostile_bounds.py [--only multipart,batch_line,json,message_batch]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import MODEL, Server, start_server

MIB = 1 << 20
NO_THINK = {"chat_template_kwargs": {"thinking": False}}


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(next(ln.split()[1] for ln in f if ln.startswith("VmRSS:"))) / 1024


class Watch:
    """RSS peak and plain-request latencies while an attack runs."""

    def __init__(self, s: Server) -> None:
        self.s, self.peak = s, rss_mib(s.proc.pid)
        self.lat: list[float] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self.rss), threading.Thread(target=self.plain)]
        for t in self.threads:
            t.start()

    def rss(self) -> None:
        while not self.stop.wait(0.05):
            self.peak = max(self.peak, rss_mib(self.s.proc.pid))

    def plain(self) -> None:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **NO_THINK}
        while not self.stop.wait(0.2):
            t0 = time.monotonic()
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(f"{self.s.url}/v1/chat/completions", json=body, timeout=60)
            self.lat.append(time.monotonic() - t0)

    def end(self) -> dict[str, float]:
        self.stop.set()
        for t in self.threads:
            t.join()
        lat = sorted(self.lat) or [0.0]
        return {"peak_mib": self.peak, "plain_p50_s": statistics.median(lat), "plain_max_s": lat[-1]}


def settle(s: Server, rss0: float, what: str, seconds: float = 3.0) -> float:
    time.sleep(seconds)
    after = rss_mib(s.proc.pid)
    print(f"  {what}: RSS start {rss0:.0f} MiB, after {after:.0f} MiB (+{after - rss0:.0f})", flush=True)
    return after


def endless_multipart(s: Server, total: int) -> tuple[float, str]:
    """A multipart body whose boundary never comes, sent raw; (seconds to the answer, its status line)."""
    host, port = s.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        "POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=NEVER\r\n"
        f"Content-Length: {total}\r\n\r\n"
    )
    sock.sendall(head.encode())
    t0, chunk, sent, answer = time.monotonic(), b"a" * (1 << 16), 0, b""
    sock.settimeout(0.0)
    try:
        while sent < total:
            try:
                answer += sock.recv(4096)
                if answer:
                    break
            except BlockingIOError:
                pass
            sock.settimeout(5.0)
            sent += sock.send(chunk[: total - sent])
            sock.settimeout(0.0)
        sock.settimeout(60)
        while b"\r\n" not in answer:
            got = sock.recv(4096)
            if not got:
                break
            answer += got
    except OSError as e:
        # The server answered and closed while the body was still being sent: read what it said.
        try:
            sock.settimeout(5)
            while b"\r\n" not in answer and (got := sock.recv(4096)):
                answer += got
        except OSError:
            pass
        answer = answer or f"closed: {e}".encode()
    finally:
        sock.close()
    return time.monotonic() - t0, answer.split(b"\r\n")[0].decode(errors="replace")


def attack_multipart(s: Server) -> None:
    print("multipart: 4 concurrent uploads of 256 MiB whose boundary never comes", flush=True)
    rss0, w, out = rss_mib(s.proc.pid), Watch(s), [None] * 4

    def one(i: int) -> None:
        out[i] = endless_multipart(s, 256 * MIB)  # type: ignore[call-overload]

    ts = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    r = w.end()
    print(f"  answers: {out}; {r}", flush=True)
    settle(s, rss0, "multipart")


def attack_batch_line(s: Server, mib: int) -> None:
    print(f"batch line: one {mib} MiB line in a purpose=batch file, then POST /v1/batches", flush=True)
    rss0 = rss_mib(s.proc.pid)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x" * (mib * MIB)}], "max_tokens": 2}
    line = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions", "body": body})
    w = Watch(s)
    t0 = time.monotonic()
    up = httpx.post(
        f"{s.url}/v1/files", files={"file": ("b.jsonl", line.encode() + b"\n")}, data={"purpose": "batch"}, timeout=120
    )
    print(f"  upload: {up.status_code} in {time.monotonic() - t0:.2f}s {up.text[:200]}", flush=True)
    if up.status_code == 200:
        b = httpx.post(
            f"{s.url}/v1/batches",
            json={"input_file_id": up.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            timeout=60,
        )
        print(f"  create: {b.status_code} {b.text[:200]}", flush=True)
        if b.status_code == 200:
            bid = b.json()["id"]
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                st = httpx.get(f"{s.url}/v1/batches/{bid}", timeout=30).json()
                if st["status"] in ("completed", "failed", "expired", "cancelled"):
                    break
                time.sleep(0.5)
            print(f"  batch: {st['status']} {st.get('request_counts')} in {time.monotonic() - t0:.1f}s", flush=True)
    print(f"  {w.end()}", flush=True)
    settle(s, rss0, f"batch line {mib} MiB")


def attack_json(s: Server, seconds: float = 20.0) -> None:
    n = 8_000_000
    raw = (
        f'{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "hi"}}], "max_tokens": 2, "junk": ['
        + ",".join(["0"] * n)
        + "]}"
    ).encode()
    print(f"json: 4 clients looping a {len(raw) / MIB:.1f} MiB chat body with {n:,} elements under 'junk'", flush=True)
    rss0, w, answers = rss_mib(s.proc.pid), Watch(s), []
    end = time.monotonic() + seconds

    def loop() -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < end:
                t0 = time.monotonic()
                r = c.post(f"{s.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
                answers.append((r.status_code, time.monotonic() - t0))

    ts = [threading.Thread(target=loop) for _ in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    r = w.end()
    codes = sorted({a[0] for a in answers})
    med = statistics.median(a[1] for a in answers)
    print(f"  {len(answers)} answers {codes}, median {med:.3f}s; {r}", flush=True)
    settle(s, rss0, "json")


def attack_message_batch(s: Server, n: int = 50_001) -> None:
    print(f"message batch of {n:,} requests", flush=True)
    reqs = [
        {
            "custom_id": f"r{i}",
            "params": {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]},
        }
        for i in range(n)
    ]
    r = httpx.post(f"{s.url}/v1/messages/batches", json={"requests": reqs}, timeout=120)
    print(f"  create: {r.status_code} {r.text[:300]}", flush=True)
    if r.status_code != 200:
        return
    bid = r.json()["id"]
    time.sleep(8)
    st = httpx.get(f"{s.url}/v1/messages/batches/{bid}", timeout=30).json()
    print(f"  after 8 s: {st['processing_status']} {st['request_counts']}", flush=True)
    httpx.post(f"{s.url}/v1/messages/batches/{bid}/cancel", timeout=30)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--only", default="multipart,batch_line,json,message_batch")
    p.add_argument("--malloc", default="auto")
    a = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="hostile-bounds-"))
    s = start_server(
        "--served-model-name", MODEL, "--max-num-seqs", "8", "--max-model-len", "8192",
        "--state-store", str(tmp / "state.sqlite3"), "--malloc", a.malloc,
    )  # fmt: skip
    try:
        only = a.only.split(",")
        if "multipart" in only:
            attack_multipart(s)
        if "batch_line" in only:
            attack_batch_line(s, 32)
            attack_batch_line(s, 64)
        if "json" in only:
            attack_json(s)
        if "message_batch" in only:
            attack_message_batch(s)
    finally:
        s.stop()


if __name__ == "__main__":
    main()
