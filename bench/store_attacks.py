#!/usr/bin/env python3
"""The stored-state attacks of issue 39, point 3, scaled down, on the sim engine with a SQLite store: what each
leaves in the database and on disk, and how long the requests take. Run it on a build before and after a change.

- chain: `--turns` stored Responses turns, each carrying `--mib` MiB the prompt drops (a reasoning item's summary
  and an unknown key), each naming the one before (`previous_response_id`); then one request naming the last.
- eviction: two API keys, a 4 MiB store; key B keeps a response and a conversation, key A adds 7 × 1 MiB of
  conversation items. Does B's data survive, and what does A get?
- batch: a 200 kB files total; a batch of 200 lines of 256 tokens each. How much output lands, and the batch's end.

    python bench/store_attacks.py [--turns 8] [--mib 1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import MODEL, Server, start_server


def db_bytes(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))


def serve(tmp: Path, *args: str) -> tuple[Server, Path]:
    db = tmp / "state.sqlite3"
    s = start_server("--served-model-name", MODEL, "--max-model-len", "8192", "--state-store", str(db), *args)
    return s, db


def chain(tmp: Path, turns: int, mib: int) -> dict[str, Any]:
    s, db = serve(tmp)
    junk = "x" * (mib << 20)
    out: dict[str, Any] = {"turns": turns, "mib_per_turn": mib}
    try:
        with httpx.Client(base_url=s.base_url, timeout=120) as c:
            prev = None
            statuses = []
            t0 = time.monotonic()
            for i in range(turns):
                body: dict[str, Any] = {
                    "model": MODEL,
                    "max_output_tokens": 4,
                    "input": [
                        {"type": "reasoning", "summary": [{"type": "summary_text", "text": junk}]},
                        {"role": "user", "content": f"turn {i}", "x_unknown": "y"},
                    ],
                }
                if prev:
                    body["previous_response_id"] = prev
                r = c.post("/v1/responses", json=body)
                statuses.append(r.status_code)
                if r.status_code != 200:
                    break
                prev = r.json()["id"]
            out["turn_statuses"] = statuses
            out["turns_s"] = round(time.monotonic() - t0, 2)
            time.sleep(0.5)
            out["db_bytes"] = db_bytes(db)
            t0 = time.monotonic()
            r = c.post(
                "/v1/responses",
                json={"model": MODEL, "max_output_tokens": 4, "input": "next", "previous_response_id": prev},
            )
            out["naming_it"] = {"status": r.status_code, "s": round(time.monotonic() - t0, 3)}
            if r.status_code != 200:
                out["naming_it"]["error"] = r.json().get("error", {}).get("code")
    finally:
        s.stop()
    return out


def eviction(tmp: Path) -> dict[str, Any]:
    keys = tmp / "keys"
    keys.write_text("key-a\nkey-b\n")
    s, _ = serve(tmp, "--api-key-file", str(keys), "--state-store-max-bytes", str(4 << 20))
    out: dict[str, Any] = {}
    try:
        a = httpx.Client(base_url=s.base_url, timeout=60, headers={"Authorization": "Bearer key-a"})
        b = httpx.Client(base_url=s.base_url, timeout=60, headers={"Authorization": "Bearer key-b"})
        kept = b.post("/v1/responses", json={"model": MODEL, "input": "mine", "max_output_tokens": 4}).json()["id"]
        conv = b.post("/v1/conversations", json={"items": [{"role": "user", "content": "mine"}]}).json()["id"]
        mine = a.post("/v1/conversations", json={}).json()["id"]
        t0 = time.monotonic()
        statuses = []
        for _ in range(7):
            items = [{"role": "user", "content": "z" * (256 << 10)} for _ in range(4)]
            r = a.post(f"/v1/conversations/{mine}/items", json={"items": items})
            statuses.append(r.status_code if r.status_code == 200 else f"{r.status_code} {r.json()['error']['code']}")
            time.sleep(0.3)
        out["a_statuses"] = statuses
        out["a_s"] = round(time.monotonic() - t0, 2)
        time.sleep(2)
        out["b_response_after"] = b.get(f"/v1/responses/{kept}").status_code
        out["b_conversation_after"] = b.get(f"/v1/conversations/{conv}").status_code
        out["a_reads_b_response"] = a.get(f"/v1/responses/{kept}").status_code
    finally:
        s.stop()
    return out


def batch(tmp: Path) -> dict[str, Any]:
    room = tmp / "files"
    cap = 200_000
    s, _ = serve(tmp, "--files-dir", str(room), "--files-max-total-bytes", str(cap))
    out: dict[str, Any] = {"files_cap": cap}
    try:
        c = s.client()
        lines = [
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                    "max_tokens": 256,
                    "ignore_eos": True,
                },
            }
            for i in range(200)
        ]
        text = "\n".join(json.dumps(x) for x in lines).encode()
        out["input_bytes"] = len(text)
        import io

        f = c.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch")
        t0 = time.monotonic()
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled", "expired"):
            time.sleep(0.2)
        out["batch_s"] = round(time.monotonic() - t0, 2)
        out["status"] = b.status
        out["counts"] = b.request_counts.model_dump() if b.request_counts else None
        out["errors"] = b.errors.model_dump() if b.errors else None
        out["files_bytes"] = sum(x.bytes for x in c.files.list())
        out["dir_bytes"] = sum(p.stat().st_size for p in room.iterdir())
    finally:
        s.stop()
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--mib", type=int, default=1)
    p.add_argument("--only", default="chain,eviction,batch")
    a = p.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(json.dumps({"commit": commit, "dirty": bool(os.popen("git status --porcelain rust").read())}))
    for name in a.only.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            if name == "chain":
                r = chain(Path(tmp), a.turns, a.mib)
            elif name == "eviction":
                r = eviction(Path(tmp))
            else:
                r = batch(Path(tmp))
        print(json.dumps({name: r}), flush=True)


if __name__ == "__main__":
    main()
