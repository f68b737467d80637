#!/usr/bin/env python3
"""The lanes' fairness (issue 39, point 4): what one client's batch or background requests do to another's.

batch       4 slots, 20 ms decode steps: a 1-line batch (10 tokens) alone, then created 3 s after a batch of 64
            lines of 100 tokens (2 s each) started: the 1-line batch's time from creation to completed
background  20 ms decode steps, anonymous: background POSTs (--fill-tokens each) until the first 429 (its code),
            whether a new one is accepted once they have all ended; keyed: the same from key A, then one from B
memory      N background runs of T tokens each (free decode steps) at once: the server's RSS before, at the end
            and 5 s after (each process of the server, summed)

  python bench/lanes.py [--only batch|background|memory] [--runs 512] [--tokens 32000]
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import MODEL, Server, launch, ours_cmd

DONE = ("completed", "failed", "cancelled", "expired")


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server(*flags: str) -> Server:
    p = port()
    return launch("ours", ours_cmd(p, "--state-store", "memory", "--max-model-len", "65536", *flags), p)


def line(i: int, tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": tokens}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "ignore_eos": True}}


def submit(c: httpx.Client, lines: list[dict[str, Any]]) -> str:
    text = "\n".join(json.dumps(x) for x in lines).encode()
    f = c.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(text))}, data={"purpose": "batch"}).json()
    body = {"input_file_id": f["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return str(c.post("/v1/batches", json=body).json()["id"])


def until(c: httpx.Client, bid: str, states: tuple[str, ...], timeout: float = 600) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (b := c.get(f"/v1/batches/{bid}").json())["status"] not in states:
        assert time.monotonic() < deadline, b
        time.sleep(0.05)
    return b


def batch() -> None:
    s = server("--max-num-seqs", "4", "--sim-decode-step-ms", "20")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            t = time.monotonic()
            until(c, submit(c, [line(0, 10)]), DONE)
            alone = time.monotonic() - t
            big = submit(c, [line(i, 100) for i in range(64)])
            until(c, big, ("in_progress",))
            time.sleep(3)
            t = time.monotonic()
            small = submit(c, [line(0, 10)])
            until(c, small, DONE)
            behind = time.monotonic() - t
            left = until(c, big, DONE)
            print(f"batch: 1 line alone {alone:.2f} s; behind 64 lines of 2 s on 4 slots {behind:.2f} s", flush=True)
            print(f"       (the big batch: {left['request_counts']})")
    finally:
        s.stop()


def background_post(c: httpx.Client, key: str = "", tokens: int = 16) -> httpx.Response:
    body = {"model": MODEL, "input": "x", "max_output_tokens": tokens, "background": True, "ignore_eos": True}
    return c.post("/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"} if key else {})


def fill(
    c: httpx.Client, key: str = "", tokens: int = 16, most: int = 5000
) -> tuple[int, httpx.Response | None, list[str]]:
    ids = []
    for _ in range(most):
        r = background_post(c, key, tokens)
        if r.status_code != 200:
            return len(ids), r, ids
        ids.append(r.json()["id"])
    return len(ids), None, ids


def settle(c: httpx.Client, ids: list[str], key: str = "") -> float:
    t = time.monotonic()
    h = {"Authorization": f"Bearer {key}"} if key else {}
    for rid in ids:
        while c.get(f"/v1/responses/{rid}", headers=h).json()["status"] in ("queued", "in_progress"):
            time.sleep(0.05)
    return time.monotonic() - t


def background(tokens: int) -> None:
    s = server("--max-num-seqs", "64", "--sim-decode-step-ms", "20")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            t = time.monotonic()
            n, refused, ids = fill(c, tokens=tokens)
            took = time.monotonic() - t
            code = refused.json()["error"]["code"] if refused is not None else None
            ended = settle(c, ids)
            again = background_post(c)
            print(
                f"background, no key: {n} POSTs accepted in {took:.1f} s, then {refused and refused.status_code} "
                f"{code}; all ended {ended:.1f} s later; a new POST then: {again.status_code}",
                flush=True,
            )
    finally:
        s.stop()
    keys = Path(tempfile.mkdtemp()) / "keys"
    keys.write_text("key-a\nkey-b\n")
    s = server("--max-num-seqs", "64", "--sim-decode-step-ms", "20", "--api-key-file", str(keys))
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            n, refused, ids = fill(c, "key-a", tokens)
            code = refused.json()["error"]["code"] if refused is not None else None
            other = background_post(c, "key-b")
            print(
                f"background, keyed: key A {n} accepted, then {refused and refused.status_code} {code}; "
                f"key B then: {other.status_code} {(other.json().get('error') or {}).get('code', '')}",
                flush=True,
            )
            settle(c, ids, "key-a")
    finally:
        s.stop()


def rss_mib(s: Server) -> float:
    total = 0
    for pid in s.pids():
        out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.split()
        total += int(out[0]) if out else 0
    return total / 1024


def memory(runs: int, tokens: int, *flags: str) -> None:
    s = server("--max-num-seqs", "64", *flags)
    try:
        with httpx.Client(base_url=s.url, timeout=120) as c:
            before = rss_mib(s)
            # Threads, not concurrent.futures: bench/queue.py shadows the standard module here.
            answers: list[httpx.Response] = []
            sender = lambda k: answers.extend(background_post(c, tokens=tokens) for _ in range(k, runs, 16))  # noqa: E731
            threads = [threading.Thread(target=sender, args=(k,)) for k in range(16)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            ids = [r.json()["id"] for r in answers if r.status_code == 200]
            took = settle(c, ids)
            end = rss_mib(s)
            time.sleep(5)
            print(
                f"memory: {len(ids)} of {runs} runs of {tokens} tokens accepted, ended in {took:.0f} s; RSS "
                f"{before:.0f} -> {end:.0f} MiB, 5 s later {rss_mib(s):.0f} MiB",
                flush=True,
            )
    finally:
        s.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["batch", "background", "memory"])
    ap.add_argument("--runs", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=32000)
    ap.add_argument("--flag", action="append", default=[], help="a server flag for the memory round (repeat)")
    ap.add_argument("--fill-tokens", type=int, default=16, help="tokens of each background POST (20 ms a token)")
    a = ap.parse_args()
    if a.only in (None, "batch"):
        batch()
    if a.only in (None, "background"):
        background(a.fill_tokens)
    if a.only in (None, "memory"):
        memory(a.runs, a.tokens, *a.flag)


if __name__ == "__main__":
    main()
