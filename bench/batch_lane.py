#!/usr/bin/env python3
"""The batch lane on the paced sim (issue 31): what a large batch does to interactive clients beside it, and how
close a batch alone comes to a closed-loop client at full capacity. One server (`--sim-profile paced`: a 10 ms
decode step, 50 ms per 1k prompt tokens; 16 slots, no wait queue, state in memory); per round, alternating:

  interactive alone   4 streaming clients, closed loop, 128-token prompts, 32 output tokens: TTFT per request
  beside a batch      the same, while a batch of 3,000 lines (64-token prompts, 64 output tokens) runs
  batch alone         a batch of 400 such lines: lines/s from in_progress to completed
  closed loop         the same 400 requests from 16 concurrent clients: requests/s

    python bench/batch_lane.py [--rounds 2] [--seconds 20] [--base OTHER_TREE/python]

`--base` starts a second server from another build's `python/` directory and alternates the two round by round
(their order flips each round), for a before/after in one run; each build gets its own medians.

Prints each round and the medians: interactive TTFT p50/p95 alone and beside the batch (their ratio; the target is
at most 1.1), 429s seen by the interactive clients (must be 0), and batch / closed-loop throughput (at least 0.9).
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import MODEL, launch, ours_cmd

WORDS = "the quick brown fox jumps over a lazy dog while seven wise owls watch it " * 40


def prompt(tokens: int, salt: int) -> str:
    return f"{salt} " + " ".join(WORDS.split()[: max(1, tokens - 2)])


def body(tokens: int, out: int, salt: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt(tokens, salt)}],
        "max_tokens": out,
        "ignore_eos": True,
        "thinking": {"type": "disabled"},
    }


def interactive(url: str, seconds: float, clients: int = 4) -> tuple[list[float], int]:
    """TTFTs (s) of streaming clients in a closed loop, and the non-200 answers they got."""
    ttfts: list[float] = []
    refused = [0]
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        with httpx.Client(timeout=60) as c:
            i = 0
            while time.monotonic() < stop:
                i += 1
                t0 = time.perf_counter()
                with c.stream(
                    "POST", f"{url}/v1/chat/completions", json={**body(128, 32, k * 100000 + i), "stream": True}
                ) as r:
                    if r.status_code != 200:
                        refused[0] += 1
                        r.read()
                        continue
                    first = None
                    for line in r.iter_lines():
                        if first is None and line.startswith("data: {") and '"content"' in line:
                            first = time.perf_counter() - t0
                    if first is not None:
                        ttfts.append(first)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return ttfts, refused[0]


def closed_loop(call: Any, n: int, clients: int) -> list[int]:
    """`call(i)` for i < n from `clients` threads, each taking the next i as it finishes (bench/queue.py shadows the
    standard library's queue module here, and with it concurrent.futures)."""
    codes: list[int] = []
    next_i = iter(range(n))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                i = next(next_i, None)
            if i is None:
                return
            code = call(i)
            with lock:
                codes.append(code)

    threads = [threading.Thread(target=worker) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return codes


def submit(c: httpx.Client, url: str, lines: int, salt: int) -> str:
    text = "\n".join(
        json.dumps(
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": body(64, 64, salt + i)}
        )
        for i in range(lines)
    ).encode()
    f = c.post(f"{url}/v1/files", files={"file": ("in.jsonl", io.BytesIO(text))}, data={"purpose": "batch"}).json()
    b = c.post(
        f"{url}/v1/batches",
        json={"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
    )
    return str(b.json()["id"])


def wait_for(c: httpx.Client, url: str, bid: str, statuses: tuple[str, ...]) -> dict[str, Any]:
    while (b := c.get(f"{url}/v1/batches/{bid}").json())["status"] not in statuses:
        time.sleep(0.05)
    return dict(b)


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(p / 100 * (len(xs) - 1)))] if xs else float("nan")


def one_round(c: httpx.Client, url: str, seconds: float, rnd: int) -> dict[str, float]:
    alone, refused_alone = interactive(url, seconds)
    bid = submit(c, url, 3000, 10**6 * (rnd + 1))
    wait_for(c, url, bid, ("in_progress",))
    time.sleep(2)  # the batch holds the slots by now
    beside, refused_beside = interactive(url, seconds)
    c.post(f"{url}/v1/batches/{bid}/cancel")
    wait_for(c, url, bid, ("cancelled", "completed"))
    time.sleep(6)  # alone: no client seen for longer than the lane's memory of them (5 s)
    bid = submit(c, url, 400, 10**7 * (rnd + 1))
    wait_for(c, url, bid, ("in_progress", "completed"))
    t0 = time.monotonic()
    wait_for(c, url, bid, ("completed",))
    batch_rate = 400 / (time.monotonic() - t0)
    t0 = time.monotonic()
    salt = 10**8 * (rnd + 1)

    def one(i: int) -> int:
        return c.post(f"{url}/v1/chat/completions", json=body(64, 64, salt + i)).status_code

    codes = closed_loop(one, 400, 16)
    closed_rate = 400 / (time.monotonic() - t0)
    return {
        "alone_p50": pct(alone, 50) * 1e3, "alone_p95": pct(alone, 95) * 1e3,
        "beside_p50": pct(beside, 50) * 1e3, "beside_p95": pct(beside, 95) * 1e3,
        "refused": refused_alone + refused_beside, "batch_rate": batch_rate, "closed_rate": closed_rate,
        "closed_ok": codes.count(200), "n_alone": len(alone), "n_beside": len(beside),
    }  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seconds", type=float, default=20)
    ap.add_argument("--port", type=int, default=18790)
    ap.add_argument("--base", metavar="DIR", help="also run a server from another build's python/ directory")
    args = ap.parse_args()
    flags = ["--sim-profile", "paced", "--max-num-seqs", "16", "--state-store", "memory", "--max-model-len", "4096"]
    builds = {"this": None} if args.base is None else {"base": args.base, "this": None}
    servers = {}
    rows: dict[str, list[dict[str, float]]] = {label: [] for label in builds}
    try:
        for k, (label, path) in enumerate(builds.items()):
            servers[label] = launch(label, ours_cmd(args.port + k, *flags), args.port + k, path)
        with httpx.Client(timeout=120) as c:
            for srv in servers.values():
                interactive(srv.url, 3)  # warm-up
            for rnd in range(args.rounds):
                for label in list(builds) if rnd % 2 == 0 else list(builds)[::-1]:
                    row = one_round(c, servers[label].url, args.seconds, rnd)
                    rows[label].append(row)
                    print(
                        f"round {rnd + 1} {label}: TTFT alone p50 {row['alone_p50']:.1f} p95 {row['alone_p95']:.1f} "
                        f"ms ({row['n_alone']:.0f}), beside the batch p50 {row['beside_p50']:.1f} p95 "
                        f"{row['beside_p95']:.1f} ms ({row['n_beside']:.0f}); non-200 {row['refused']:.0f}; batch "
                        f"{row['batch_rate']:.1f} lines/s, closed loop {row['closed_rate']:.1f} req/s "
                        f"({row['closed_ok']:.0f}/400 ok)",
                        flush=True,
                    )
    finally:
        for srv in servers.values():
            srv.stop()
    for label, rs in rows.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"{label}: median of {len(rs)} rounds: TTFT p95 alone {med['alone_p95']:.1f} ms, beside a batch "
            f"{med['beside_p95']:.1f} ms, ratio {med['beside_p95'] / med['alone_p95']:.3f} "
            f"(p50 ratio {med['beside_p50'] / med['alone_p50']:.3f}); "
            f"interactive non-200s {int(sum(r['refused'] for r in rs))}; batch / closed loop throughput "
            f"{med['batch_rate'] / med['closed_rate']:.3f} ({med['batch_rate']:.1f} vs {med['closed_rate']:.1f} per s)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
