#!/usr/bin/env python3
"""Image input: time to first token and server CPU per request with images, against text alone. One server on the
zero-cost sim (DP 2; started with `--allowed-media-networks 127.0.0.1/32` for the URL case), 16 streamed chat
requests at a time (closed loop), 16 output tokens each (ignore_eos). Four variants, in alternating rounds:

  text        the prompt alone (the baseline)
  1 image     plus one 1024x1024 JPEG as a data URL
  8 images    plus eight of them as data URLs
  1 URL       plus one by http URL, from an image server this script runs on 127.0.0.1

    python bench/images.py [--rounds 3] [--scale 1.0]

The images are photo-like (a gradient, a colour wave and Gaussian noise from a fixed seed; ~560 KB as JPEG), eight
different ones, so the codecs do real work on each. TTFT is the client's: request sent to the first chunk carrying
content. CPU is the server's and its children's (ranks, reaper), utime + stime from /proc, over each timed run,
divided by its requests. Prints each variant's median over rounds [min-max], then the server's TTFT stages per
variant (`deepinfer_ttft_stage_seconds` sum/count, the difference across that variant's runs): `encode` is the
codec's part, where images are preprocessed (for the URL variant it also holds the fetch, done after admission).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import http.server
import io
import json
import re
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import MODEL, cpu_seconds, launch, ours_cmd, spread

STREAMS = 16
MAX_TOKENS = 16
SIZE = 1024
PROMPT = "Describe what you see in a few words."
# Requests per timed run at --scale 1: enough that each run lasts several seconds on two shared cores.
REQUESTS = {"text": 800, "1 image": 64, "8 images": 32, "1 URL": 64}
SERVER_FLAGS = ["--dp", "2", "--max-num-seqs", "32", "--allowed-media-networks", "127.0.0.1/32"]
SERVER_FLAGS += ["--max-request-body-bytes", str(64 << 20)]


def photo(seed: int, size: int = SIZE) -> bytes:
    """A photo-like JPEG: smooth gradients and a colour wave under Gaussian noise, so neither codec has it easy."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    wave = 128 + 100 * np.sin(2 * np.pi * (3 * x + 2 * y + seed / 8))
    base = np.stack([255 * x, 255 * y, wave], -1)
    pixels = np.clip(base + rng.normal(0, 24, (size, size, 3)), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG", quality=90)
    return out.getvalue()


class ImageHost:
    """Serves /img/<k>.jpg (any query string) from memory on 127.0.0.1."""

    def __init__(self, images: list[bytes]) -> None:
        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                m = re.match(r"/img/(\d+)\.jpg", self.path)
                body = images[int(m.group(1)) % len(images)] if m else b"no"
                self.send_response(200 if m else 404)
                self.send_header("Content-Type", "image/jpeg" if m else "text/plain")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def body(urls: list[str]) -> bytes:
    content: Any = PROMPT
    if urls:
        content = [{"type": "text", "text": PROMPT}]
        content += [{"type": "image_url", "image_url": {"url": u}} for u in urls]
    return json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
            "thinking": {"type": "disabled"},
        }
    ).encode()


class Bodies:
    """Each variant's request bodies, built once (the client should cost the server's cores little)."""

    def __init__(self, images: list[bytes], host: ImageHost) -> None:
        urls = [f"data:image/jpeg;base64,{base64.b64encode(im).decode()}" for im in images]
        self.host = host
        self.fixed: dict[str, list[bytes]] = {
            "text": [body([])],
            "1 image": [body([u]) for u in urls],
            "8 images": [body(urls[k:] + urls[:k]) for k in range(len(urls))],
        }
        self.n = 0

    def get(self, variant: str) -> bytes:
        self.n += 1
        if variant == "1 URL":  # a new query string each time: nothing on the way may answer from a cache
            return body([f"{self.host.url}/img/{self.n % 8}.jpg?r={self.n}"])
        pool = self.fixed[variant]
        return pool[self.n % len(pool)]


async def one(session: aiohttp.ClientSession, url: str, data: bytes) -> tuple[float | None, int]:
    """One streamed request: (TTFT in seconds or None, status)."""
    t0 = time.perf_counter()
    first = None
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            await r.read()
            return None, r.status
        buf = b""
        async for chunk in r.content.iter_any():
            if first is None:
                buf += chunk
                for line in buf.split(b"\n"):
                    if line.startswith(b"data: {") and b'"content":"' in line and b'"content":""' not in line:
                        first = time.perf_counter() - t0
                        break
                buf = buf[buf.rfind(b"\n") + 1 :]
    return first, 200


async def closed_loop(url: str, bodies: Bodies, variant: str, requests: int) -> dict[str, Any]:
    ttfts: list[float] = []
    errors: dict[str, int] = {}
    left = requests

    async def worker(session: aiohttp.ClientSession) -> None:
        nonlocal left
        while left > 0:
            left -= 1
            ttft, status = await one(session, f"{url}/v1/chat/completions", bodies.get(variant))
            if ttft is None:
                key = str(status) if status != 200 else "no content"
                errors[key] = errors.get(key, 0) + 1
            else:
                ttfts.append(ttft)

    timeout = aiohttp.ClientTimeout(total=600)
    conn = aiohttp.TCPConnector(limit=STREAMS)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(session) for _ in range(STREAMS)))
        wall = time.perf_counter() - t0
    ttfts.sort()
    ms = [1e3 * t for t in ttfts]
    return {
        "ok": len(ttfts),
        "errors": errors,
        "wall_s": wall,
        "ttft_p50_ms": statistics.median(ms) if ms else None,
        "ttft_p95_ms": ms[min(len(ms) - 1, int(0.95 * len(ms)))] if ms else None,
        "ttft_mean_ms": statistics.fmean(ms) if ms else None,
    }


def stage_totals(url: str) -> dict[str, tuple[float, float]]:
    """(sum seconds, count) of each TTFT stage, over the server's life."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    found = re.findall(r'^deepinfer_ttft_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', text, re.M)
    out: dict[str, list[float]] = {}
    for kind, stage, v in found:
        out.setdefault(stage, [0.0, 0.0])[0 if kind == "sum" else 1] = float(v)
    return {s: (v[0], v[1]) for s, v in out.items()}


def run(url: str, pids: list[int], bodies: Bodies, variant: str, requests: int) -> dict[str, Any]:
    stages0 = stage_totals(url)
    cpu0 = cpu_seconds(pids)
    res = asyncio.run(closed_loop(url, bodies, variant, requests))
    res["cpu_ms_per_request"] = 1e3 * (cpu_seconds(pids) - cpu0) / max(1, res["ok"])
    stages1 = stage_totals(url)
    zero = (0.0, 0.0)
    res["stages"] = {s: (v[0] - stages0.get(s, zero)[0], v[1] - stages0.get(s, zero)[1]) for s, v in stages1.items()}
    return res


FIGURES = ("ttft_p50_ms", "ttft_p95_ms", "ttft_mean_ms", "cpu_ms_per_request")


def cell(s: dict[str, float | None]) -> str:
    if s["median"] is None:
        return "-"
    digits = 1 if s["median"] >= 10 else 2
    return f"{s['median']:.{digits}f} [{s['min']:.{digits}f}–{s['max']:.{digits}f}]"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every run's request count")
    ap.add_argument("--port", type=int, default=18795)
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    t_start = time.monotonic()
    images = [photo(seed) for seed in range(8)]
    host = ImageHost(images)
    bodies = Bodies(images, host)
    requests = {v: max(4, round(n * args.scale)) for v, n in REQUESTS.items()}
    srv = launch("ours", ours_cmd(args.port, *SERVER_FLAGS), args.port)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in REQUESTS}
    try:
        pids = srv.pids()
        for variant in REQUESTS:  # warm-up: a few requests of each variant, unmeasured
            warm = asyncio.run(closed_loop(srv.url, bodies, variant, 4))
            if warm["errors"]:
                raise SystemExit(f"warm-up {variant}: errors {warm['errors']}")
        for i in range(args.rounds):
            order = list(REQUESTS) if i % 2 == 0 else list(reversed(REQUESTS))
            for variant in order:
                r = run(srv.url, pids, bodies, variant, requests[variant])
                runs[variant].append(r)
                brief = {k: round(v, 2) if isinstance(v, float) else v for k, v in r.items() if k != "stages"}
                print(f"round {i + 1} {variant}: {brief}", file=sys.stderr, flush=True)
    finally:
        srv.stop()
        host.close()
    elapsed = time.monotonic() - t_start
    summary = {
        v: {f: spread([r[f] for r in rs]) for f in FIGURES} | {"errors": [r["errors"] for r in rs]}
        for v, rs in runs.items()
    }
    stages: dict[str, dict[str, float]] = {}
    for v, rs in runs.items():
        total: dict[str, list[float]] = {}
        for r in rs:
            for s, (sec, n) in r["stages"].items():
                acc = total.setdefault(s, [0.0, 0.0])
                acc[0] += sec
                acc[1] += n
        stages[v] = {s: 1e3 * sec / n for s, (sec, n) in total.items() if n}
    if args.json_out:
        args.json_out.write_text(json.dumps({"summary": summary, "stages_ms": stages, "runs": runs}, indent=1) + "\n")

    print(f"\n{STREAMS} streams, closed loop, {MAX_TOKENS} output tokens, zero-cost sim (DP 2), {args.rounds} rounds;")
    print(f"median [min–max] over rounds; requests per run: {', '.join(f'{v} {n}' for v, n in requests.items())}\n")
    print("| variant | TTFT p50 ms | TTFT p95 ms | TTFT mean ms | server CPU ms / request | errors |")
    print("|---|---:|---:|---:|---:|---:|")
    for v, s in summary.items():
        errs = sum(sum(e.values()) for e in s["errors"])
        print(f"| {v} | {' | '.join(cell(s[f]) for f in FIGURES)} | {errs} |")
    order = ("parse", "queue", "encode", "dispatch", "ring", "engine_queue", "prefill", "publish", "sse", "engine")
    names = [s for s in order if any(s in st for st in stages.values())]
    print("\nServer TTFT stages, mean ms per request over all rounds (deepinfer_ttft_stage_seconds sum / count):\n")
    print(f"| variant | {' | '.join(names)} |")
    print(f"|---|{'---:|' * len(names)}")
    for v, st in stages.items():
        print(f"| {v} | {' | '.join(f'{st.get(s, 0.0):.2f}' for s in names)} |")
    print(f"\n{elapsed:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
