#!/usr/bin/env python3
"""Issue 39's attacks, measured on a running server: the figures behind BENCHMARKS.md's second attack table.
Prints one row per attack and a JSON summary.

    python bench/hostile39.py [--base OTHER_TREE/python] [--only logprobs,multipart,...]

Each attack runs on a fresh server (the sim, a SQLite store and a files directory of its own) while a plain client
sends a short chat request every 50 ms (its p50 / p95 beside the baseline taken just before), with the server's RSS
before, at the peak and 5 s after. `--base` measures another tree's build after this one, as bench/hostile.py does.

Attacks:
- logprobs: 16 concurrent chats of 50 tokens, half with top_logprobs 20 and half with 2, three rounds; then a plain
  request must still be answered.
- multipart: 4 uploads whose multipart boundary never comes (64 MiB each, sent as fast as the server takes it).
- batchline: a batch input file with one 32 MiB line.
- widebody: 4 clients looping a 15.6 MiB chat body with an 8M-element array under an unknown key, for 10 s.
- chain: 12 turns of a previous_response_id chain, each with a 1 MiB reasoning item the prompt drops.
- evict: two API keys; one stores 8 MiB responses until refused, against a 64 MiB store; is the other's still there?
- batchfair: a 64-line batch of long lines, then another owner's 1-line batch: how long until the 1-line one ends.
- background: background POSTs until the first 429 (how many, its code), and whether a new one is taken once
  those ended.
- heads: with --api-key, 200 connections send a `POST /v1/files` head and no body; a keyed request's latency.
- crosssite: a multipart form post and a bodiless POST with a foreign Origin (CORS off): what they get.
"""

from __future__ import annotations

import argparse
import io
import json
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from hostile import MODEL, Prober, Server, baseline

NO_THINK = {"thinking": {"type": "disabled"}}
KEYS = ("key-alpha", "key-beta")


def parallel(fn: Callable[[int], Any], items: range) -> list[Any]:
    """`fn` over `items`, one thread each (no concurrent.futures: bench/queue.py shadows the stdlib's queue)."""
    out: list[Any] = [None] * len(items)

    def run(k: int, i: int) -> None:
        out[k] = fn(i)

    threads = [threading.Thread(target=run, args=(k, i)) for k, i in enumerate(items)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def chat(i: int, tokens: int, **extra: Any) -> dict[str, Any]:
    msg = [{"role": "user", "content": f"item {i}"}]
    return {"model": MODEL, "messages": msg, "max_tokens": tokens, "ignore_eos": True, "seed": i, **NO_THINK, **extra}


def attack_logprobs(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    statuses: dict[str, int] = {}

    def one(i: int) -> None:
        top = 20 if i % 2 else 2
        try:
            code = str(
                httpx.post(
                    f"{srv.url}/v1/chat/completions", json=chat(i, 50, logprobs=True, top_logprobs=top), timeout=30
                ).status_code
            )
        except httpx.HTTPError as e:
            code = type(e).__name__
        statuses[code] = statuses.get(code, 0) + 1

    with Prober(srv) as p:
        for r in range(3):
            parallel(one, range(16 * r, 16 * r + 16))
    try:
        after = httpx.post(f"{srv.url}/v1/chat/completions", json=chat(0, 5), timeout=15).status_code
    except httpx.HTTPError as e:
        after = type(e).__name__  # type: ignore[assignment]
    health = httpx.get(f"{srv.url}/health", timeout=5).status_code
    return {"attacker": statuses, "plain_after": after, "health": health, **p.summary(), "rss_peak_mib": round(p.peak)}


def raw_post(port: int, head: str, body: bytes, chunk: int = 1 << 20) -> tuple[str, float]:
    """Send a request head and `body` as fast as the server takes it; its status line and when it came."""
    s = socket.create_connection(("127.0.0.1", port))
    s.settimeout(60)
    t0 = time.monotonic()
    status = "closed"
    try:
        s.sendall(head.encode())
        for k in range(0, len(body), chunk):
            s.sendall(body[k : k + chunk])
        data = s.recv(4096)
        status = data.split(b"\r\n", 1)[0].decode(errors="replace") if data else "closed"
    except OSError as e:
        status = f"{type(e).__name__} after send"
        try:
            data = s.recv(4096)
            status = data.split(b"\r\n", 1)[0].decode(errors="replace") or status
        except OSError:
            pass
    finally:
        s.close()
    return status, round(time.monotonic() - t0, 2)


def attack_multipart(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    size = args.multipart_mib << 20
    junk = b"x" * size
    head = (
        "POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=NEVERCOMES\r\n"
        f"Content-Length: {size}\r\n\r\n"
    )
    with Prober(srv) as p:
        got = parallel(lambda _: raw_post(srv.port, head, junk), range(4))
    return {"attacker": got, **p.summary(), "rss_peak_mib": round(p.peak)}


def upload(srv: Server, data: bytes, **kw: Any) -> httpx.Response:
    files = {"file": ("in.jsonl", io.BytesIO(data), "application/jsonl")}
    return httpx.post(f"{srv.url}/v1/files", data={"purpose": "batch"}, files=files, timeout=120, **kw)


def attack_batchline(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    body = chat(0, 4) | {"messages": [{"role": "user", "content": "x" * (32 << 20)}]}
    line = json.dumps({"custom_id": "big", "method": "POST", "url": "/v1/chat/completions", "body": body})
    with Prober(srv) as p:
        t0 = time.monotonic()
        r = upload(srv, line.encode())
        row: dict[str, Any] = {"upload": r.status_code, "upload_s": round(time.monotonic() - t0, 2)}
        if r.status_code == 200:
            b = httpx.post(
                f"{srv.url}/v1/batches",
                timeout=60,
                json={"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"},
            )
            row["create"] = b.status_code
            if b.status_code == 200:
                row["batch"] = wait_batch(srv, b.json()["id"], 120)
        else:
            row["message"] = r.json()["error"]["message"][:120]
    return {"attacker": row, **p.summary(), "rss_peak_mib": round(p.peak)}


def wait_batch(srv: Server, bid: str, timeout: float, **kw: Any) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        b = httpx.get(f"{srv.url}/v1/batches/{bid}", timeout=30, **kw).json()
        if b["status"] in ("completed", "failed", "cancelled", "expired"):
            return f"{b['status']} {b['request_counts']}"
        time.sleep(0.2)
    return "still running"


def attack_widebody(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    body = json.dumps(chat(0, 2) | {"x": [0] * 8_000_000}, separators=(",", ":")).encode()  # 15.3 MiB
    results: list[tuple[int, float]] = []
    stop = time.monotonic() + 10

    def loop() -> None:
        with httpx.Client(timeout=60) as c:
            while time.monotonic() < stop:
                t0 = time.monotonic()
                code = c.post(
                    f"{srv.url}/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}
                ).status_code
                results.append((code, time.monotonic() - t0))

    with Prober(srv) as p:
        threads = [threading.Thread(target=loop) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    codes = sorted({c for c, _ in results})
    times = sorted(t for _, t in results)
    return {
        "attacker": {"codes": codes, "n": len(results), "p50_s": round(times[len(times) // 2], 3)},
        **p.summary(),
        "rss_peak_mib": round(p.peak),
    }


def attack_chain(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    big = "y" * (1 << 20)
    prev = None
    row: dict[str, Any] = {}
    with Prober(srv) as p:
        for turn in range(12):
            items: list[Any] = [
                {"type": "reasoning", "id": f"rs_{turn}", "summary": [{"type": "summary_text", "text": big}]},
                {"role": "user", "content": f"turn {turn}"},
            ]
            body: dict[str, Any] = {"model": MODEL, "input": items, "max_output_tokens": 4}
            if prev:
                body["previous_response_id"] = prev
            t0 = time.monotonic()
            r = httpx.post(f"{srv.url}/v1/responses", json=body, timeout=120)
            row[f"turn{turn}"] = [r.status_code, round(time.monotonic() - t0, 2)]
            if r.status_code != 200:
                row["refusal"] = r.json().get("error", {}).get("code")
                break
            prev = r.json()["id"]
    db = Path(args.state) / "state.sqlite3"
    size = sum(f.stat().st_size for f in db.parent.glob("state.sqlite3*"))
    return {"attacker": row, "db_mib": round(size / 2**20, 1), **p.summary(), "rss_peak_mib": round(p.peak)}


def attack_evict(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    a, b = ({"Authorization": f"Bearer {k}"} for k in KEYS)
    kept = httpx.post(
        f"{srv.url}/v1/responses",
        headers=b,
        timeout=60,
        json={"model": MODEL, "input": "remember me", "max_output_tokens": 4},
    ).json()["id"]
    conv = httpx.post(f"{srv.url}/v1/conversations", headers=b, timeout=60, json={}).json()["id"]
    big = "z" * (8 << 20)  # a reasoning item the prompt drops: stored, never encoded
    items = [{"type": "reasoning", "id": "rs_1", "summary": [{"type": "summary_text", "text": big}]}]
    codes: list[int] = []
    for i in range(12):
        body = {"model": MODEL, "input": [*items, {"role": "user", "content": f"hi {i}"}], "max_output_tokens": 2}
        codes.append(httpx.post(f"{srv.url}/v1/responses", headers=a, timeout=60, json=body).status_code)
    time.sleep(2)  # the sweeper's turn
    after = httpx.get(f"{srv.url}/v1/responses/{kept}", headers=b, timeout=30).status_code
    conv_after = httpx.get(f"{srv.url}/v1/conversations/{conv}", headers=b, timeout=30).status_code
    return {"attacker": codes, "other_response": after, "other_conversation": conv_after}


def attack_batchfair(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    a, b = ({"Authorization": f"Bearer {k}"} for k in KEYS)

    def submit(headers: dict[str, str], n: int, tokens: int) -> str:
        lines = [
            {"custom_id": f"l{i}", "method": "POST", "url": "/v1/chat/completions", "body": chat(i, tokens)}
            for i in range(n)
        ]
        f = upload(srv, "\n".join(json.dumps(x) for x in lines).encode(), headers=headers).json()["id"]
        return httpx.post(
            f"{srv.url}/v1/batches",
            headers=headers,
            timeout=60,
            json={"input_file_id": f, "endpoint": "/v1/chat/completions", "completion_window": "24h"},
        ).json()["id"]

    t0 = time.monotonic()
    alone = submit(b, 1, 400)
    state = wait_batch(srv, alone, 300, headers=b)
    alone_s = round(time.monotonic() - t0, 2)
    big = submit(a, 64, 400)
    time.sleep(1)
    t0 = time.monotonic()
    small = submit(b, 1, 400)
    small_state = wait_batch(srv, small, args.fair_timeout, headers=b)
    behind_s = round(time.monotonic() - t0, 2)
    httpx.post(f"{srv.url}/v1/batches/{big}/cancel", headers=a, timeout=30)
    return {"attacker": {"alone_s": alone_s, "alone": state, "behind_s": behind_s, "behind": small_state}}


def attack_background(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    body = {"model": MODEL, "input": "x", "max_output_tokens": 400, "background": True}
    n, code, first429 = 0, None, None
    t0 = time.monotonic()
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        while n < args.background_max:
            r = c.post("/v1/responses", json=body)
            if r.status_code == 429:
                first429 = r.json()["error"].get("code")
                break
            n += 1
        code = first429
        fill_s = round(time.monotonic() - t0, 1)
        # Once what was queued has ended, a new one must be taken at once.
        t1 = time.monotonic()
        while time.monotonic() - t1 < args.background_wait:
            if c.post("/v1/responses", json=body).status_code == 200:
                break
            time.sleep(1)
        again_s = round(time.monotonic() - t1, 1)
    return {
        "attacker": {"accepted": n, "then": code, "fill_s": fill_s, "new_one_taken_after_s": again_s},
        "rss_now_mib": round(srv.rss_mib()),
    }


def attack_heads(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    socks = []
    head = (
        b"POST /v1/files HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=b\r\n"
        b"Content-Length: 1073741824\r\n\r\n"
    )
    rss0 = srv.rss_mib()
    for _ in range(args.heads):
        s = socket.create_connection(("127.0.0.1", srv.port))
        s.sendall(head)
        socks.append(s)
    time.sleep(2)
    held = srv.rss_mib() - rss0
    t0 = time.monotonic()
    try:
        code = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json=chat(0, 2),
            timeout=120,
            headers={"Authorization": f"Bearer {KEYS[0]}"},
        ).status_code
    except httpx.HTTPError as e:
        code = type(e).__name__  # type: ignore[assignment]
    keyed_s = round(time.monotonic() - t0, 2)
    closed = 0
    for s in socks:
        s.settimeout(0.01)
        try:
            closed += s.recv(1) == b"" or 1
        except (TimeoutError, BlockingIOError):
            pass
        except OSError:
            closed += 1
        s.close()
    return {
        "attacker": {
            "connections": args.heads,
            "answered_or_closed": closed,
            "rss_per_conn_kib": round(held * 1024 / args.heads, 1),
        },
        "keyed": code,
        "keyed_s": keyed_s,
    }


def attack_crosssite(srv: Server, args: argparse.Namespace) -> dict[str, Any]:
    evil = {"Origin": "http://evil.example"}
    files = {"file": ("a.jsonl", io.BytesIO(b"{}"), "application/jsonl")}
    form = httpx.post(f"{srv.url}/v1/files", data={"purpose": "batch"}, files=files, headers=evil, timeout=30)
    bare = httpx.post(f"{srv.url}/v1/conversations", content=b"", headers=evil, timeout=30)
    untyped = httpx.post(
        f"{srv.url}/v1/chat/completions",
        content=json.dumps(chat(0, 2)).encode(),
        timeout=30,
        headers={**evil, "Content-Type": ""},
    )
    return {
        "attacker": {
            "form_upload": form.status_code,
            "bodiless_conversation": bare.status_code,
            "untyped_chat": untyped.status_code,
        }
    }


STATE = tempfile.mkdtemp(prefix="hostile39-")
Attack = Callable[[Server, argparse.Namespace], dict[str, Any]]
PACED = ("--sim-profile", "paced", "--max-num-seqs", "8")
KEYED = ("--api-key-file", f"{STATE}/keys")
ATTACKS: dict[str, tuple[Attack, tuple[str, ...]]] = {
    "logprobs": (attack_logprobs, ("--dp", "2")),
    "multipart": (attack_multipart, ()),
    "batchline": (attack_batchline, ()),
    "widebody": (attack_widebody, ()),
    "chain": (attack_chain, ()),
    "evict": (attack_evict, (*KEYED, "--state-store-max-bytes", str(64 << 20))),
    "batchfair": (attack_batchfair, (*KEYED, *PACED)),
    "background": (attack_background, PACED),
    "heads": (attack_heads, ("--api-key", KEYS[0], "--max-connections", "200")),
    "crosssite": (attack_crosssite, ()),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", default=None, help="another build's python/ directory, measured after this tree")
    ap.add_argument("--only", default=",".join(ATTACKS), help="comma-separated attacks")
    ap.add_argument("--multipart-mib", type=int, default=64)
    ap.add_argument("--heads", type=int, default=200)
    ap.add_argument("--fair-timeout", type=float, default=120.0)
    ap.add_argument("--background-max", type=int, default=5000)
    ap.add_argument("--background-wait", type=float, default=60.0)
    args = ap.parse_args()
    Path(f"{STATE}/keys").write_text("\n".join(KEYS) + "\n")
    builds = {"this": None} if args.base is None else {"this": None, "base": args.base}
    out: dict[str, dict[str, Any]] = {}
    for name in args.only.split(","):
        fn, flags = ATTACKS[name]
        for label, path in builds.items():
            args.state = tempfile.mkdtemp(dir=STATE)
            store = ("--state-store", f"{args.state}/state.sqlite3", "--files-dir", f"{args.state}/files")
            srv = Server(path, "--served-model-name", MODEL, *store, *flags)
            try:
                rss0 = srv.rss_mib()
                keyed = "--api-key" in flags or "--api-key-file" in flags
                row = ({} if keyed else {"baseline": baseline(srv)}) | fn(srv, args)
                time.sleep(5)
                row["rss_before_mib"], row["rss_after_mib"] = round(rss0), round(srv.rss_mib())
            except Exception as e:  # an attack that breaks the server is a result, not a crash of the bench
                row = {"error": f"{type(e).__name__}: {e}"[:300]}
            finally:
                srv.stop()
            out.setdefault(name, {})[label] = row
            print(f"{name:10} {label:5} {json.dumps(row)}", flush=True)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
