#!/usr/bin/env python3
"""The wait queue under a closed loop at twice capacity: DP 2 x 16 seqs = 32 slots, a 10 ms decode step, 256-token
prompts and 64 streamed output tokens (ignore_eos). Four cases, in alternating rounds, each on a fresh server:

  c32 no queue     32 clients, --max-queued-requests 0 (the baseline: exactly capacity)
  c32 queue 32     32 clients with a 32-deep queue that they never need: CPU per token must not move
  c64 queue 32     64 clients: half of them wait in the queue; 0 errors, TTFT includes the queue time
  c64 no queue     64 clients without a queue: the 429s a client that does not retry sees today

    python bench/queue.py [--rounds 3] [--requests 600]

Prints each case's median round (TTFT p50/p99, mean queue time from `vllm:request_queue_time_seconds`, errors,
server CPU per token) and the CPU ratios to the baseline.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import ROOT, launch, loadgen, ours_cmd

CASES = {
    "c32 no queue": (32, 0),
    "c32 queue 32": (32, 32),
    "c64 queue 32": (64, 32),
    "c64 no queue": (64, 0),
}
SIM = ["--dp", "2", "--max-num-seqs", "16", "--sim-decode-step-ms", "10", "--sim-prefill-ms-per-1k-tokens", "4"]


def queue_time(url: str) -> dict[str, float]:
    """Mean queue time and the request count, from the server's histogram (warm-up included)."""
    text = httpx.get(f"{url}/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^vllm:request_queue_time_seconds_{name}{{[^}}]*}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    n = value("count")
    return {"queue_mean_ms": round(1e3 * value("sum") / n, 2) if n else 0.0, "requests": n}


def run_case(bench_dir: Path, clients: int, queue: int, requests: int, port: int) -> dict[str, Any]:
    srv = launch("ours", ours_cmd(port, *SIM, "--max-queued-requests", str(queue)), port)
    try:
        r = loadgen(
            bench_dir,
            srv,
            "--concurrency",
            str(clients),
            "--requests",
            str(requests),
            "--warmup",
            str(clients),
            "--prompt-tokens",
            "256",
            "--max-tokens",
            "64",
            "--ignore-eos",
        )
        q = queue_time(srv.url)
    finally:
        srv.stop()
    return {
        "ok": r["ok"],
        "errors": r["errors_by_status"],
        "ttft_p50_ms": r["ttft_ms"]["p50"],
        "ttft_p99_ms": r["ttft_ms"]["p99"],
        "queue_mean_ms": q["queue_mean_ms"],
        "tok_s": r["output_tokens_per_s"],
        "cpu_us_per_token": r["server_cpu_us_per_token"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-dir", type=Path, default=ROOT.parent / "shared" / "bench")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--requests", type=int, default=600)
    args = ap.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {case: [] for case in CASES}
    for i in range(args.rounds):
        for j, (case, (clients, queue)) in enumerate(CASES.items()):
            print(f"round {i + 1}: {case}", file=sys.stderr, flush=True)
            runs[case].append(run_case(args.bench_dir, clients, queue, args.requests, 18760 + j))
            time.sleep(1)
    base = statistics.median(r["cpu_us_per_token"] for r in runs["c32 no queue"])
    print(
        f"{'case':14} {'ok':>5} {'errors':>18} {'TTFT p50':>9} {'p99':>8} {'queue':>8} {'tok/s':>7} "
        f"{'CPU/tok':>8} ratio"
    )
    for case, rs in runs.items():
        mid = sorted(rs, key=lambda r: r["ttft_p50_ms"])[len(rs) // 2]
        cpu = statistics.median(r["cpu_us_per_token"] for r in rs)
        errors = ",".join(f"{k}:{v}" for k, v in mid["errors"].items()) or "0"
        print(
            f"{case:14} {mid['ok']:>5} {errors:>18} {mid['ttft_p50_ms']:>9.1f} {mid['ttft_p99_ms']:>8.1f} "
            f"{mid['queue_mean_ms']:>8.1f} {mid['tok_s']:>7.0f} {cpu:>8.2f} {cpu / base:.3f}"
        )
    print("TTFT and queue in ms (queue: mean wait from arrival to its rank, server-side); CPU in us per token,")
    print(f"median of {args.rounds} rounds; ratio to 'c32 no queue'. Row figures but CPU: the median-TTFT round.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
