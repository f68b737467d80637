"""Soak test: sustained mixed load against deepinfer-server, watching memory and file descriptors.

Starts a server (simulated engine by default) or targets --base-url, then for --duration seconds runs:
  * steady workers: streaming and non-streaming chat completions, some streams dropped after their first chunk;
  * bursts over capacity every --burst-every seconds (expected to get 429s).
Every --interval seconds it prints elapsed time, ok / 429 / error counts, and RSS (MB) and open file descriptors of the
server process and its rank processes (from /proc). At the end it prints a JSON summary with the server's RSS growth
since the end of the first interval (warm-up) and PASS/FAIL against --max-rss-growth-pct (default 5).

    python bench/soak.py --duration 600 --interval 30
    python bench/soak.py --base-url http://127.0.0.1:8000 --pid 12345   # an already running server

Uses only the standard library, httpx and asyncio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


@dataclass
class Counters:
    ok: int = 0
    ok_stream: int = 0
    ok_unary: int = 0
    dropped: int = 0  # streams deliberately closed mid-generation
    r429: int = 0
    errors: int = 0
    error_kinds: dict[str, int] = field(default_factory=dict)

    def error(self, kind: str) -> None:
        self.errors += 1
        self.error_kinds[kind] = self.error_kinds.get(kind, 0) + 1


# ------------------------------------------------------------------------------------------------ /proc readers


def proc_rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def proc_fds(pid: int) -> int | None:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return None


def children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            text = Path(f"/proc/{pid}/task/{task}/children").read_text()
            out.extend(int(x) for x in text.split())
    except OSError:
        pass
    return sorted(set(out))


def is_rank(pid: int) -> bool:
    """A rank process, not the server's reaper (deepinfer_server/reaper.py)."""
    try:
        return b"deepinfer_server.engine.rank" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def snapshot(pid: int | None) -> dict[str, Any]:
    if pid is None:
        return {"rss_mb": None, "fds": None, "ranks": []}
    ranks = [{"pid": c, "rss_mb": proc_rss_mb(c), "fds": proc_fds(c)} for c in children(pid) if is_rank(c)]
    return {"rss_mb": proc_rss_mb(pid), "fds": proc_fds(pid), "ranks": ranks}


# ------------------------------------------------------------------------------------------------------ server


class LocalServer:
    def __init__(self, extra: list[str], model: str) -> None:
        cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--served-model-name", model, *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.url = ""
        self.tail: list[str] = []
        found = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.tail = [*self.tail[-200:], line]
                m = LISTENING.search(line)
                if m and not found.is_set():
                    self.url = f"http://{m.group(1)}:{m.group(2)}"
                    found.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 120
        while not found.wait(0.1):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise SystemExit("server did not start:\n" + "".join(self.tail))

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


# -------------------------------------------------------------------------------------------------------- load


def chat_body(model: str, stream: bool, max_tokens: int) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": random.choice(["hi", "tell me a story", "explain rings " * 20])}],
        "max_tokens": max_tokens,
        "ignore_eos": random.random() < 0.5,
        "thinking": {"type": random.choice(["enabled", "disabled"])},
        "stream": stream,
    }
    if stream:
        b["stream_options"] = {"include_usage": True}
    return b


async def one_request(client: httpx.AsyncClient, c: Counters, model: str, kind: str, max_tokens: int) -> int:
    """One request of `kind` (stream / unary / drop); returns its HTTP status (0 on a transport error)."""
    try:
        if kind == "unary":
            r = await client.post("/v1/chat/completions", json=chat_body(model, False, max_tokens))
            if r.status_code == 200 and "usage" not in r.json():
                c.error("completion without usage")
            elif r.status_code == 200:
                c.ok += 1
                c.ok_unary += 1
            elif r.status_code == 429:
                c.r429 += 1
            else:
                c.error(f"http {r.status_code}")
            return r.status_code
        body = chat_body(model, True, max_tokens)
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                if r.status_code == 429:
                    c.r429 += 1
                else:
                    c.error(f"http {r.status_code}")
                return r.status_code
            last = ""
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                last_prev, last = last, line[6:]
                if kind == "drop" and '"content":"' in line:
                    c.dropped += 1
                    return 200  # leaving the block closes the connection mid-stream
                if last == "[DONE]":
                    if '"error"' in last_prev:
                        c.error("stream error event")
                    else:
                        c.ok += 1
                        c.ok_stream += 1
                    return 200
            c.error("stream ended without [DONE]")
            return 200
    except httpx.HTTPError as e:
        c.error(type(e).__name__)
        return 0


async def steady_worker(client: httpx.AsyncClient, c: Counters, model: str, stop: asyncio.Event) -> None:
    while not stop.is_set():
        kind = random.choices(["stream", "unary", "drop"], weights=[45, 35, 20])[0]
        status = await one_request(client, c, model, kind, random.randint(8, 64))
        if status == 429:
            await asyncio.sleep(random.uniform(0.1, 0.5))


async def burster(
    client: httpx.AsyncClient, c: Counters, model: str, stop: asyncio.Event, size: int, every: float
) -> None:
    while True:
        try:
            await asyncio.wait_for(stop.wait(), every)
            return
        except asyncio.TimeoutError:
            pass
        kinds = random.choices(["stream", "unary"], k=size)
        await asyncio.gather(*(one_request(client, c, model, k, 16) for k in kinds))


def fmt_ranks(ranks: list[dict[str, Any]]) -> str:
    return " ".join(
        f"r{i}:{r['rss_mb']:.0f}MB/{r['fds']}fd" if r["rss_mb"] is not None else f"r{i}:gone"
        for i, r in enumerate(ranks)
    )


async def soak(args: argparse.Namespace, base_url: str, pid: int | None) -> dict[str, Any]:
    c = Counters()
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=args.workers + args.burst_size + 16, max_keepalive_connections=64)
    samples: list[dict[str, Any]] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=args.request_timeout, limits=limits) as client:
        r = await client.get("/health")
        if r.status_code != 200:
            raise SystemExit(f"/health answered {r.status_code}: {r.text}")
        tasks = [asyncio.create_task(steady_worker(client, c, args.model, stop)) for _ in range(args.workers)]
        tasks.append(asyncio.create_task(burster(client, c, args.model, stop, args.burst_size, args.burst_every)))
        t0 = time.monotonic()
        next_tick = t0 + args.interval
        while True:
            now = time.monotonic()
            end = t0 + args.duration
            await asyncio.sleep(max(0.0, min(next_tick, end) - now))
            now = time.monotonic()
            snap = snapshot(pid)
            health = "?"
            try:
                health = str((await client.get("/health", timeout=5)).status_code)
            except httpx.HTTPError as e:
                health = type(e).__name__
            sample = {"t": round(now - t0, 1), **snap, "ok": c.ok, "r429": c.r429, "errors": c.errors, "health": health}
            samples.append(sample)
            rss = f"{snap['rss_mb']:.1f}" if snap["rss_mb"] is not None else "n/a"
            print(
                f"[{now - t0:7.1f}s] ok={c.ok} (stream {c.ok_stream}, unary {c.ok_unary}, dropped {c.dropped}) "
                f"429={c.r429} errors={c.errors} health={health} | server rss={rss}MB fds={snap['fds']} | "
                f"ranks {fmt_ranks(snap['ranks'])}",
                flush=True,
            )
            if now >= end:
                break
            next_tick += args.interval
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)

    base = samples[0]
    last = samples[-1]
    growth = None
    if base["rss_mb"] and last["rss_mb"]:
        growth = (last["rss_mb"] - base["rss_mb"]) / base["rss_mb"] * 100
    passed = growth is not None and growth < args.max_rss_growth_pct and c.errors == 0
    return {
        "duration_s": args.duration,
        "requests": {
            "ok": c.ok,
            "ok_stream": c.ok_stream,
            "ok_unary": c.ok_unary,
            "dropped_mid_stream": c.dropped,
            "rate_limited_429": c.r429,
            "errors": c.errors,
            "error_kinds": c.error_kinds,
        },
        "server": {
            "pid": pid,
            "rss_mb_after_warmup": base["rss_mb"],
            "rss_mb_end": last["rss_mb"],
            "rss_growth_pct": None if growth is None else round(growth, 2),
            "fds_after_warmup": base["fds"],
            "fds_end": last["fds"],
        },
        "ranks": {"after_warmup": base["ranks"], "end": last["ranks"]},
        "max_rss_growth_pct": args.max_rss_growth_pct,
        "result": "PASS" if passed else "FAIL",
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--duration", type=float, default=600.0, help="Seconds of load.")
    p.add_argument("--interval", type=float, default=30.0, help="Seconds between report lines.")
    p.add_argument("--base-url", default=None, help="Target a running server instead of starting one.")
    p.add_argument("--pid", type=int, default=None, help="Server pid for RSS/fd figures (with --base-url).")
    p.add_argument("--model", default="deepseek-v4.1-flash")
    p.add_argument("--workers", type=int, default=12, help="Steady concurrent clients.")
    p.add_argument("--burst-size", type=int, default=40, help="Concurrent requests in each burst.")
    p.add_argument("--burst-every", type=float, default=10.0, help="Seconds between bursts.")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--max-rss-growth-pct", type=float, default=5.0)
    p.add_argument(
        "--server-args",
        default="--dp 2 --max-num-seqs 8 --max-model-len 4096 --sim-decode-step-ms 5",
        help="Flags for the server started by this command (ignored with --base-url).",
    )
    args = p.parse_args()

    server: LocalServer | None = None
    if args.base_url:
        base_url, pid = args.base_url.rstrip("/"), args.pid
    else:
        server = LocalServer(shlex.split(args.server_args), args.model)
        base_url, pid = server.url, server.proc.pid
        print(f"started server pid {pid} at {base_url} with {args.server_args}", flush=True)
    try:
        summary = asyncio.run(soak(args, base_url, pid))
    finally:
        if server is not None:
            code = server.stop()
            print(f"server stopped with exit code {code}", flush=True)
    print(json.dumps(summary, indent=2))
    return 0 if summary["result"] == "PASS" else 1


if __name__ == "__main__":
    sys.exit(main())
