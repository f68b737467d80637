#!/usr/bin/env python3
"""What open consoles cost (issue 43): server CPU per streamed token with ten pollers of GET /console/status (each
once a second, as ten open console tabs poll) and without them, in alternating rounds on one server; then the status
endpoint's own cost per call (server CPU over many calls, and the latency a client sees), on a fresh server, after
the load, and (`--full-window`) once every second of its five minutes holds samples.

    python bench/console.py [--rounds 3] [--seconds 8] [--conns 64] [--pollers 10] [--calls 2000] [--full-window]

Needs `wrk` (Debian package). The load is bench/doors.py's chat stream (256 tokens, `ignore_eos`) on the zero-cost
sim, so the server's own work per token is what is measured.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import cpu_seconds
from doors import start_server, wrk


class Pollers:
    """`n` consoles: each polls the status endpoint once a second while running."""

    def __init__(self, url: str, n: int) -> None:
        self.url, self.n = url, n
        self.stop = threading.Event()
        self.calls = 0
        self.threads = [threading.Thread(target=self.poll, args=(i,)) for i in range(n)]

    def poll(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as c:
            time.sleep(i / max(1, self.n))  # spread over the second, as tabs opened at different times are
            while not self.stop.wait(1.0):
                c.get("/console/status").raise_for_status()
                self.calls += 1

    def __enter__(self) -> Pollers:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join()


def status_cost(url: str, pid: int, calls: int) -> dict[str, float]:
    """Server CPU per status call (the server process alone), and the client's latency, idle server."""
    with httpx.Client(base_url=url, timeout=10) as c:
        for _ in range(50):
            c.get("/console/status")
        size = len(c.get("/console/status").content)
        lat = []
        cpu0 = cpu_seconds([pid])
        for _ in range(calls):
            t0 = time.perf_counter()
            c.get("/console/status")
            lat.append(time.perf_counter() - t0)
        cpu = cpu_seconds([pid]) - cpu0
    lat.sort()
    return {
        "server_cpu_us_per_call": round(1e6 * cpu / calls, 1),
        "client_latency_p50_us": round(1e6 * lat[len(lat) // 2], 1),
        "client_latency_p99_us": round(1e6 * lat[int(len(lat) * 0.99)], 1),
        "bytes": size,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--pollers", type=int, default=10)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--full-window", action="store_true", help="measure the endpoint again once 5 minutes are full")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, pids, url = start_server(port, None, [])
    started = time.monotonic()
    try:
        cost = {"fresh": status_cost(url, pids[0], args.calls)}
        runs: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
        for r in range(args.rounds):
            order = ["without", "with"] if r % 2 == 0 else ["with", "without"]
            for kind in order:
                if kind == "with":
                    with Pollers(url, args.pollers) as p:
                        runs[kind].append({**wrk(url, "chat", args.seconds, args.conns, pids), "polls": p.calls})
                else:
                    runs[kind].append(wrk(url, "chat", args.seconds, args.conns, pids))
        summary = {
            kind: {
                "cpu_us_per_token_median": statistics.median(x["cpu_us_per_token"] for x in rs),
                "cpu_us_per_token_rounds": [x["cpu_us_per_token"] for x in rs],
                "server_us_per_token_median": statistics.median(x["server_us_per_token"] for x in rs),
                "tokens_per_s_median": statistics.median(x["tokens_per_s"] for x in rs),
                "non_2xx": sum(x["non_2xx"] for x in rs),
            }
            for kind, rs in runs.items()
        }
        if args.full_window:
            # Every second of the window holds samples: the status document at its largest.
            with httpx.Client(base_url=url, timeout=30) as c:
                chat = {
                    "model": "deepseek-v4.1-flash",
                    "messages": [{"role": "user", "content": "x"}],
                    "max_tokens": 16,
                }
                while time.monotonic() - started < 310:
                    c.post("/v1/chat/completions", json=chat).raise_for_status()
                    time.sleep(0.2)
        cost["after_load"] = status_cost(url, pids[0], args.calls)
        w, wo = summary["with"]["cpu_us_per_token_median"], summary["without"]["cpu_us_per_token_median"]
        summary["ratio_with_to_without"] = round(w / wo, 3)
        print(json.dumps({"status_endpoint": cost, "pollers": args.pollers, "streams": summary}, indent=2))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
