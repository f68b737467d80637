#!/usr/bin/env python3
"""What each attack of issue 29 costs the attacker and does to the server, measured on a running server: the
figures behind BENCHMARKS.md's "Hostile clients" table. Prints one row per attack and a JSON summary.

    python bench/hostile.py [--base OTHER_TREE/python] [--only grammar,ring,...] [--connections 4000]

`--base` measures a server built from another tree's `python/` (its `_native` module built there) after this one,
for the before and after in one run. Each attack runs on a fresh server (default flags: the sim, no API key) while
a plain client sends one short chat request every 50 ms; its latency is reported as p50/p95 beside the baseline
taken just before the attack, with the server's RSS before, at the peak and 5 s after.

Attacks:
- grammar: four concurrent chat requests whose forced tool has 48 integer parameters bounded near 1.2e300 (5 KB).
- ring: one such request with 6 parameters (it no longer fit the request ring: 503 with /health 200).
- render: POST /v1/chat/completions/render with an image and `X-Request-Id: a/b` (500 and a raw traceback).
- echo: a 4 MB `model` string (echoed in a 4 MB 404 body and one 4 MB log line).
- browser: a `Content-Type: text/plain` chat request (what any web page may send cross-origin).
- trickle: N connections that trickle a request body a byte a second.
- readers: 16 streams of 8,000 tokens with top_logprobs 20 that nobody reads.
- heads (issue 39): with --api-key and --max-connections 200, 200 connections that send an unauthenticated
  `POST /v1/files` head declaring a 100 MB body and send nothing more; a keyed client's request meanwhile.
- logprobs (issue 39): 16 concurrent chats of 50 tokens, half with top_logprobs 20 and half with 2, three rounds (it
  killed the rank's output thread and wedged every later request behind /health 200); then a plain request.
- forms (issue 39): what a web page on another origin may send with no preflight: a form upload and a chat and a
  conversation POSTed without a `Content-Type`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import selectors
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

MODEL = "deepseek-v4.1-flash"
MSG = [{"role": "user", "content": "hi"}]
LISTENING = re.compile(r"listening on http://[\d.]+:(\d+)")


class Server:
    def __init__(self, pythonpath: str | None, *flags: str) -> None:
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", "0", *flags]
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        ready = threading.Event()
        self.port = 0

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                m = LISTENING.search(line)
                if m and not ready.is_set():
                    self.port = int(m.group(1))
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        if not ready.wait(120):
            self.proc.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        self.url = f"http://127.0.0.1:{self.port}"

    def rss_mib(self) -> float:
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024  # type: ignore[union-attr]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Prober:
    """A plain client: one short chat request every 50 ms, its latencies, and the server's RSS peak."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.latencies: list[float] = []
        self.failures = 0
        self.peak = srv.rss_mib()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self) -> None:
        body = {"model": MODEL, "messages": MSG, "max_tokens": 2, "thinking": {"type": "disabled"}}
        with httpx.Client(base_url=self.srv.url, timeout=120) as c:
            while not self.stop.is_set():
                t0 = time.monotonic()
                try:
                    ok = c.post("/v1/chat/completions", json=body).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    self.latencies.append(time.monotonic() - t0)
                else:
                    self.failures += 1
                self.peak = max(self.peak, self.srv.rss_mib())
                time.sleep(0.05)

    def __enter__(self) -> Prober:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(130)

    def summary(self) -> dict[str, Any]:
        xs = sorted(self.latencies) or [float("nan")]
        return {
            "plain_p50_ms": round(statistics.median(xs) * 1e3, 1),
            "plain_p95_ms": round(xs[min(len(xs) - 1, int(0.95 * len(xs)))] * 1e3, 1),
            "plain_failed": self.failures,
        }


def baseline(srv: Server, seconds: float = 2.0) -> dict[str, Any]:
    with Prober(srv) as p:
        time.sleep(seconds)
    return p.summary()


def integer_tool(n: int) -> list[dict[str, Any]]:
    props = {f"p{i}": {"type": "integer", "minimum": 0, "maximum": float(f"1.{i:04d}e300")} for i in range(n)}
    params = {"type": "object", "properties": props, "required": list(props)}
    return [{"type": "function", "function": {"name": "f", "parameters": params}}]


def attack_grammar(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MSG, "tools": integer_tool(48), "tool_choice": "required", "max_tokens": 8}
    results: list[tuple[int, float]] = []

    def one() -> None:
        t0 = time.monotonic()
        try:
            status = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300).status_code
        except httpx.HTTPError:
            status = 0
        results.append((status, time.monotonic() - t0))

    threads = [threading.Thread(target=one) for _ in range(4)]
    with Prober(srv) as p:
        for t in threads:
            t.start()
        for t in threads:
            t.join(310)
        time.sleep(0.5)
    return {
        "attacker": f"4 requests of {len(json.dumps(body))} bytes",
        "statuses": sorted(s for s, _ in results),
        "decided_s": round(max(t for _, t in results), 2),
        **p.summary(),
        "rss_peak_mib": round(p.peak),
    }


def attack_ring(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": MODEL, "messages": MSG, "tools": integer_tool(6), "tool_choice": "required", "max_tokens": 8}
    t0 = time.monotonic()
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=300)
    health = httpx.get(f"{srv.url}/health").status_code
    return {
        "attacker": f"1 request of {len(json.dumps(body))} bytes",
        "statuses": [r.status_code],
        "decided_s": round(time.monotonic() - t0, 2),
        "health": health,
    }


def attack_render(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    import base64
    import io

    from PIL import Image  # the test extras have Pillow

    out = io.BytesIO()
    Image.new("RGB", (64, 48), (200, 40, 40)).save(out, "PNG")
    png = out.getvalue()
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    before = len(srv.lines)
    parts = [{"type": "image_url", "image_url": {"url": url}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": parts}]}
    statuses = []
    for rid in ("a/b", "../../x"):
        r = httpx.post(f"{srv.url}/v1/chat/completions/render", json=body, headers={"X-Request-Id": rid}, timeout=60)
        statuses.append(r.status_code)
    time.sleep(0.5)
    raw = [ln for ln in srv.lines[before:] if not ln.lstrip().startswith("{")]
    for ln in raw[:5]:
        print("  not JSON:", ln.rstrip()[:160])
    return {"attacker": "2 requests", "statuses": statuses, "non_json_log_lines": len(raw)}


def attack_echo(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    before = len(srv.lines)
    r = httpx.post(f"{srv.url}/v1/chat/completions", json={"model": "m" * (4 << 20), "messages": MSG}, timeout=60)
    time.sleep(0.5)
    longest = max((len(ln) for ln in srv.lines[before:]), default=0)
    return {
        "attacker": "1 request of 4 MB",
        "statuses": [r.status_code],
        "body_bytes": len(r.content),
        "log_line_bytes": longest,
    }


def attack_browser(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    raw = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 2})
    r = httpx.post(f"{srv.url}/v1/chat/completions", content=raw, headers={"Content-Type": "text/plain"}, timeout=60)
    pre = httpx.options(
        f"{srv.url}/v1/chat/completions",
        headers={"Origin": "https://page.example", "Access-Control-Request-Method": "POST"},
    )
    return {"attacker": "1 simple cross-origin request", "statuses": [r.status_code], "preflight": pre.status_code}


def attack_trickle(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    head = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000000\r\n\r\n{"
    )
    sel = selectors.DefaultSelector()
    socks: list[socket.socket] = []
    rss0 = srv.rss_mib()
    with Prober(srv) as p:
        # Each head sent once its socket is connected: a non-blocking send on a socket still connecting (the
        # listen backlog full while the server accepts the rest) fails with EAGAIN, and most heads were never sent.
        for _ in range(args.connections):
            s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            s.sendall(head)
            s.setblocking(False)
            socks.append(s)
        t0 = time.monotonic()
        closed_at: dict[int, float] = {}
        for s in socks:
            sel.register(s, selectors.EVENT_READ)
        while time.monotonic() - t0 < args.trickle_seconds:
            for s in socks:
                if s.fileno() not in closed_at:
                    try:
                        s.send(b" ")
                    except BlockingIOError:
                        pass  # its socket buffer is full: not closed
                    except OSError:
                        closed_at[s.fileno()] = time.monotonic() - t0
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                for key, _ in sel.select(timeout=0.1):
                    sock = key.fileobj
                    assert isinstance(sock, socket.socket)
                    try:
                        data = sock.recv(65536)
                    except OSError:
                        data = b""
                    if not data or data.startswith(b"HTTP/1.1 408"):
                        closed_at.setdefault(sock.fileno(), time.monotonic() - t0)
                        sel.unregister(sock)
    rss_peak = p.peak
    for s in socks:
        s.close()
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return {
        "attacker": f"{args.connections} connections, a byte a second each",
        "closed_within_s": f"{len(closed_at)}/{len(socks)} in {args.trickle_seconds:.0f} s",
        **p.summary(),
        "rss_growth_mib": round(rss_peak - rss0),
    }


def attack_readers(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    request = {
        "model": MODEL, "messages": MSG, "max_tokens": 8000, "ignore_eos": True, "stream": True,
        "logprobs": True, "top_logprobs": 20,
    }  # fmt: skip
    body = json.dumps(request).encode()
    # The first request with logprobs loads deepseek-recipe's tokenizer (tens of MB, once): not the attack's cost.
    warm = {**request, "max_tokens": 20, "stream": False}
    httpx.post(f"{srv.url}/v1/chat/completions", json=warm, timeout=120).raise_for_status()
    rss0 = srv.rss_mib()
    socks = []
    with Prober(srv) as p:
        for _ in range(16):
            s = socket.socket()
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect(("127.0.0.1", srv.port))
            s.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Content-Length: {len(body)}\r\n\r\n".encode()
                + body
            )
            socks.append(s)
        time.sleep(args.readers_seconds)
        held = p.peak - rss0
    for s in socks:
        s.close()
    return {"attacker": "16 unread streams (8000 tokens, top_logprobs 20)", **p.summary(), "rss_held_mib": round(held)}


KEY = "hostile-key"
UPLOAD_HEAD = (
    b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
    b"Content-Length: 100000000\r\n\r\n"
)


def open_fds(srv: Server) -> int:
    return len(os.listdir(f"/proc/{srv.proc.pid}/fd"))


def attack_heads(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    keyed = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2}
    httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=keyed, timeout=60).raise_for_status()
    fds0, rss0 = open_fds(srv), srv.rss_mib()
    socks = []
    for _ in range(200):
        s = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
        s.sendall(UPLOAD_HEAD)
        socks.append(s)
    time.sleep(1.0)
    fds_during, rss_during = open_fds(srv), srv.rss_mib()
    t0 = time.monotonic()
    try:
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=keyed, timeout=args.heads_wait)
        keyed_answer = f"{r.status_code} in {time.monotonic() - t0:.2f} s"
    except httpx.TimeoutException:
        keyed_answer = f"none within {args.heads_wait:.0f} s"
    answered = closed = 0
    for s in socks:
        s.settimeout(0.2)
        try:
            data = s.recv(4096)
            answered += data.startswith(b"HTTP/1.1 401")
            closed += data == b"" or s.recv(4096) == b""
        except OSError:
            pass
        s.close()
    return {
        "attacker": "200 unauthenticated upload heads (100 MB declared), no body",
        "keyed_chat": keyed_answer,
        "heads_answered_401": answered,
        "heads_closed_by_server": closed,
        "server_fds_before_during": [fds0, fds_during],
        "rss_growth_mib": round(rss_during - rss0, 1),
    }


def attack_forms(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    page = {"Origin": "https://page.example"}
    # The store may be shared with earlier servers: count what this attack adds.
    held = {f["id"] for f in httpx.get(f"{srv.url}/v1/files", timeout=60).json().get("data", [])}
    files = {"file": ("x.jsonl", b'{"a": 1}\n', "application/octet-stream")}
    form = httpx.post(f"{srv.url}/v1/files", files=files, data={"purpose": "batch"}, headers=page, timeout=60)
    raw = json.dumps({"model": MODEL, "messages": MSG, "max_tokens": 2}).encode()
    # httpx sends no Content-Type for raw bytes, as a page's fetch() with a Blob body does.
    chat = httpx.post(f"{srv.url}/v1/chat/completions", content=raw, headers=page, timeout=60)
    conv = httpx.post(f"{srv.url}/v1/conversations", headers=page, timeout=60)
    # A page that sends no Origin (none has been seen to, but the body rule holds alone).
    bare = httpx.post(f"{srv.url}/v1/chat/completions", content=raw, timeout=60)
    files_now = httpx.get(f"{srv.url}/v1/files", timeout=60).json().get("data", [])
    return {
        "attacker": "a form upload, a chat (no Content-Type), a bodiless conversation from another origin; "
        "the chat again without Origin",
        "statuses": [form.status_code, chat.status_code, conv.status_code, bare.status_code],
        "files_stored": sum(f["id"] not in held for f in files_now),
    }


def attack_logprobs(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    statuses: dict[str, int] = {}

    def one(i: int) -> None:
        top = 20 if i % 2 else 2
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": f"item {i}"}], "max_tokens": 50,
            "ignore_eos": True, "seed": i, "thinking": {"type": "disabled"}, "logprobs": True, "top_logprobs": top,
        }  # fmt: skip
        try:
            code = str(httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30).status_code)
        except httpx.HTTPError as e:
            code = type(e).__name__
        statuses[code] = statuses.get(code, 0) + 1

    with Prober(srv) as p:
        for r in range(3):
            threads = [threading.Thread(target=one, args=(16 * r + i,)) for i in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
    plain = {"model": MODEL, "messages": MSG, "max_tokens": 2, "thinking": {"type": "disabled"}}
    try:
        after: int | str = httpx.post(f"{srv.url}/v1/chat/completions", json=plain, timeout=15).status_code
    except httpx.HTTPError as e:
        after = type(e).__name__
    health = httpx.get(f"{srv.url}/health", timeout=5).status_code
    return {"attacker": statuses, "plain_after": after, "health": health, **p.summary()}


ATTACKS: dict[str, tuple[Callable[[Server, argparse.Namespace], dict[str, Any]], tuple[str, ...]]] = {
    "grammar": (attack_grammar, ()),
    "ring": (attack_ring, ()),
    "render": (attack_render, ("--log-format", "json")),
    "echo": (attack_echo, ()),
    "browser": (attack_browser, ()),
    "trickle": (attack_trickle, ()),
    # Capacity beyond the 16 readers, so the plain client measures their cost, not a full server's 429s.
    "readers": (attack_readers, ("--stream-interval-ms", "0", "--sim-decode-step-ms", "1", "--max-num-seqs", "32")),
    "heads": (attack_heads, ("--api-key", KEY, "--max-connections", "200")),
    "forms": (attack_forms, ()),
    "logprobs": (attack_logprobs, ("--dp", "2")),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="another build's python/ directory, measured after this tree")
    ap.add_argument("--only", default=",".join(ATTACKS), help="comma-separated attacks")
    ap.add_argument("--connections", type=int, default=4000)
    ap.add_argument("--trickle-seconds", type=float, default=40.0)
    ap.add_argument("--readers-seconds", type=float, default=15.0)
    ap.add_argument("--heads-wait", type=float, default=90.0, help="how long the keyed client waits (heads)")
    args = ap.parse_args()
    builds = {"this": None} if args.base is None else {"this": None, "base": args.base}
    out: dict[str, dict[str, Any]] = {}
    for name in args.only.split(","):
        fn, flags = ATTACKS[name]
        for label, path in builds.items():
            srv = Server(path, "--served-model-name", MODEL, *flags)
            try:
                rss0 = srv.rss_mib()
                # The plain client sends no key: no baseline where one is needed.
                row = {} if "--api-key" in flags else {"baseline": baseline(srv)}
                row.update(fn(srv, args))
                time.sleep(5)
                row["rss_before_mib"], row["rss_after_mib"] = round(rss0), round(srv.rss_mib())
            finally:
                srv.stop()
            out.setdefault(name, {})[label] = row
            print(f"{name:8} {label:5} {json.dumps(row)}", flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
