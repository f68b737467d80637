#!/usr/bin/env python3
"""What storing a response costs (issue 31): servers alike but for the store, on the paced sim, each in turn
(the order rotates every round): storing off (`--disable-response-store`), on in the default SQLite file, and on
in PostgreSQL when Debian's package is installed (tests/pg_server.py starts a throwaway one).

Each round: a closed loop of `--clients` streaming Responses requests (stored by default, as OpenAI's are) for
`--seconds`, then `--probes` lone requests. Per request: time to the first text delta (TTFT) and to
`response.completed`, which now leaves only once the response is committed (the store's added latency), and the
server process's CPU (HTTP, codec, SSE, the store's writer) and thread switches (all its threads' voluntary and
involuntary context switches) from /proc, per request served. CPU swings by a quarter from round to round on a
shared machine, so each round's figure is also divided by storing-off's in the same round, and the medians of
those ratios are what to quote.

    python bench/store_cost.py [--rounds 3] [--seconds 10] [--clients 16] [--tokens 32] [--probes 40]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bench import TICK, cpu_seconds, wait_health

from pg_server import bindir, postgres

MODEL = "deepseek-v4.1-flash"
PACED = ["--sim-decode-step-ms", "5", "--max-num-seqs", "64"]


def body(tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": True,
        "input": "Tell me about the weather in Paris in one long paragraph.",
        "max_output_tokens": tokens,
        "reasoning": {"effort": "none"},
    }


def one(c: httpx.Client, url: str, tokens: int) -> tuple[float, float]:
    """(TTFT, time to response.completed) of one streamed, stored Response, in seconds."""
    t0 = time.perf_counter()
    first = None
    with c.stream("POST", f"{url}/v1/responses", json=body(tokens)) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if first is None and line.startswith("event: response.output_text.delta"):
                first = time.perf_counter() - t0
            if line.startswith("event: response.completed") or line.startswith("event: response.incomplete"):
                done = time.perf_counter() - t0
                break
        else:
            raise RuntimeError("the stream ended without response.completed")
    return first or done, done


def switches(pid: int) -> int:
    """Context switches so far of every thread of `pid` (threads that ended are not counted)."""
    total = 0
    for status in Path(f"/proc/{pid}/task").glob("*/status"):
        with contextlib.suppress(OSError):
            for line in status.read_text().splitlines():
                if "ctxt_switches:" in line:
                    total += int(line.split()[1])
    return total


def store_thread_seconds(pid: int) -> float:
    """CPU so far of the threads that run SQLite's statements (sqlx's connection workers): the store's own work."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (task / "comm").read_text().startswith("sqlx-sqlite"):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def loop(url: str, clients: int, seconds: float, tokens: int, pid: int) -> dict[str, float]:
    got: list[tuple[float, float]] = []
    stop = time.monotonic() + seconds

    def client() -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < stop:
                got.append(one(c, url, tokens))

    cpu0, sw0, db0 = cpu_seconds([pid]), switches(pid), store_thread_seconds(pid)
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    cpu, sw, db = cpu_seconds([pid]) - cpu0, switches(pid) - sw0, store_thread_seconds(pid) - db0
    ttft, e2e = sorted(g[0] for g in got), sorted(g[1] for g in got)
    p95 = lambda xs: xs[int(0.95 * (len(xs) - 1))]  # noqa: E731
    return {
        "requests": len(got),
        "ttft_ms_p50": round(1e3 * statistics.median(ttft), 3),
        "ttft_ms_p95": round(1e3 * p95(ttft), 3),
        "e2e_ms_p50": round(1e3 * statistics.median(e2e), 3),
        "e2e_ms_p95": round(1e3 * p95(e2e), 3),
        "server_us_per_request": round(1e6 * cpu / max(1, len(got)), 1),
        "switches_per_request": round(sw / max(1, len(got)), 1),
        "sqlite_thread_us_per_request": round(1e6 * db / max(1, len(got)), 1),
    }


def lone(url: str, probes: int, tokens: int) -> dict[str, float]:
    with httpx.Client(timeout=60) as c:
        got = [one(c, url, tokens) for _ in range(probes)]
    return {
        "lone_ttft_ms_p50": round(1e3 * statistics.median(g[0] for g in got), 3),
        "lone_e2e_ms_p50": round(1e3 * statistics.median(g[1] for g in got), 3),
    }


@contextlib.contextmanager
def servers(port: int, extra: list[str]) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], str]]]:
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        stores = {"off": ["--disable-response-store"], "sqlite": ["--state-store", f"{tmp}/state.sqlite3"]}
        if bindir() is not None:
            stores["postgresql"] = ["--state-store", stack.enter_context(postgres())]
        up: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        try:
            for k, (label, flags) in enumerate(stores.items()):
                cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", str(port + k)]
                cmd += ["--served-model-name", MODEL, "--log-level", "warning", *PACED, *flags, *extra]
                proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                up[label] = (proc, f"http://127.0.0.1:{port + k}")
                wait_health(up[label][1], proc)
            yield up
        finally:
            for proc, _ in up.values():
                proc.terminate()
                proc.wait(timeout=60)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--probes", type=int, default=40)
    ap.add_argument("--port", type=int, default=18850)
    ap.add_argument("--server-args", default="", help="more flags for every server")
    args = ap.parse_args()
    with servers(args.port, args.server_args.split()) as up:
        runs: dict[str, list[dict[str, float]]] = {label: [] for label in up}
        labels = list(up)
        for i in range(args.rounds):
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:
                proc, url = up[label]
                run = loop(url, args.clients, args.seconds, args.tokens, proc.pid) | lone(url, args.probes, args.tokens)
                runs[label].append(run)
                print(f"round {i + 1} {label}: {run}", file=sys.stderr, flush=True)
    # Each round's CPU and switches over storing-off's in the same round.
    for rs in runs.values():
        for r, off_r in zip(rs, runs["off"], strict=True):
            r["cpu_over_off"] = round(r["server_us_per_request"] / off_r["server_us_per_request"], 3)
            r["switches_over_off"] = round(r["switches_per_request"] / off_r["switches_per_request"], 3)
    keys = list(next(iter(runs.values()))[0])
    summary = {label: {k: statistics.median(r[k] for r in rs) for k in keys} for label, rs in runs.items()}
    print(json.dumps({"rounds": runs, "median": summary}, indent=1))
    print("\n| store | TTFT p50 / p95 ms | to response.completed p50 / p95 ms | lone TTFT / completed p50 ms "
          "| server µs/request | / off, per round | SQLite thread µs/request | switches/request (/ off) | requests |\n"
          "|---|---|---|---|---|---|---|---|---|")  # fmt: skip
    for label, s in summary.items():
        rounds = ", ".join(f"{r['cpu_over_off']:.2f}" for r in runs[label])
        print(
            f"| {label} | {s['ttft_ms_p50']:.2f} / {s['ttft_ms_p95']:.2f} | {s['e2e_ms_p50']:.2f} / "
            f"{s['e2e_ms_p95']:.2f} | {s['lone_ttft_ms_p50']:.2f} / {s['lone_e2e_ms_p50']:.2f} | "
            f"{s['server_us_per_request']:.0f} | {s['cpu_over_off']:.3f} ({rounds}) | "
            f"{s['sqlite_thread_us_per_request']:.0f} | "
            f"{s['switches_per_request']:.1f} ({s['switches_over_off']:.3f}) | {s['requests']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
