"""Acknowledged means stored (issue 40, point 3), tested by causing the faults: a SQLite store on a small tmpfs
that fills and empties, and a PostgreSQL server stopped under two replicas. Storing clients (stored responses,
streamed and not, and conversation appends) run throughout; every answer that said "stored" is checked against the
store afterwards. A store that cannot commit must answer 503 `store_unavailable` with Retry-After in the door's
envelope, never a 200, and must take writes again by itself within seconds of the fault ending."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server

from pg_server import cluster, fresh_database

# Lines of the batch that runs beside the storing clients on SQLite: still running as the disk fills.
LINES = 2000
# Seconds the store may take to take writes again once its fault ends.
RECOVERY_S = 10.0


@dataclass
class Tally:
    """What the storing clients were told."""

    stored: list[str] = field(default_factory=list)  # response ids acknowledged as stored
    appended: list[str] = field(default_factory=list)  # conversation item texts acknowledged as added
    refused: Counter[str] = field(default_factory=Counter)  # error codes of the refusals
    bad: list[str] = field(default_factory=list)  # answers that are neither: a 200 without its end, a 5xx
    last_ok: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def ok(self, what: list[str], item: str) -> None:
        with self.lock:
            what.append(item)
            self.last_ok = time.monotonic()


def refusal(tally: Tally, status: int, headers: httpx.Headers, body: dict[str, Any]) -> None:
    """A refusal must be the store's 503 with Retry-After, in OpenAI's envelope."""
    code = (body.get("error") or {}).get("code")
    if status == 503 and code == "store_unavailable" and headers.get("retry-after"):
        with tally.lock:
            tally.refused[code] += 1
    else:
        tally.bad.append(f"{status} {json.dumps(body)[:200]}")


def store_responses(base: str, tally: Tally, stop: threading.Event, stream: bool) -> None:
    body = {"model": MODEL, "input": "fault tally", "max_output_tokens": 8, "store": True, "stream": stream}
    with httpx.Client(base_url=base, timeout=60) as http:
        while not stop.is_set():
            try:
                if not stream:
                    r = http.post("/v1/responses", json=body)
                    if r.status_code == 200 and r.json().get("status") in ("completed", "incomplete"):
                        tally.ok(tally.stored, r.json()["id"])
                    else:
                        refusal(tally, r.status_code, r.headers, r.json())
                    continue
                with http.stream("POST", "/v1/responses", json=body) as r:
                    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
                ends = [e for e in events if e.get("type") in ("response.completed", "response.incomplete")]
                errors = [e for e in events if e.get("type") == "error"]
                if ends and not errors:
                    tally.ok(tally.stored, ends[0]["response"]["id"])
                elif errors and not ends and r.status_code == 200:
                    # A stream has its 200 already: the store's refusal is its error event, with the same code.
                    code = errors[0].get("code") or (errors[0].get("error") or {}).get("code")
                    if code == "store_unavailable":
                        with tally.lock:
                            tally.refused[code] += 1
                    else:
                        tally.bad.append(f"stream error {json.dumps(errors[0])[:200]}")
                else:
                    tally.bad.append(f"stream {r.status_code}: {len(ends)} ends, {len(errors)} errors")
            except httpx.TransportError as e:
                tally.bad.append(f"transport: {e!r}")


def append_items(base: str, conv: str, tally: Tally, stop: threading.Event) -> None:
    n = 0
    with httpx.Client(base_url=base, timeout=60) as http:
        while not stop.is_set():
            text = f"append {n} {os.getpid()}"
            n += 1
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": text}]}
            r = http.post(f"/v1/conversations/{conv}/items", json={"items": [item]})
            if r.status_code == 200:
                tally.ok(tally.appended, text)
            else:
                refusal(tally, r.status_code, r.headers, r.json())


@dataclass
class Load:
    tally: Tally
    stop: threading.Event
    threads: list[threading.Thread]
    conv: str
    base: str

    def end(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)


def start_load(bases: list[str]) -> Load:
    """Storing clients on each server: two non-streamed, one streamed, and one appending to a conversation."""
    conv = httpx.post(f"{bases[0]}/v1/conversations", json={}, timeout=30).json()["id"]
    tally, stop = Tally(), threading.Event()
    work: list[Callable[[], None]] = []
    for base in bases:
        work += [lambda b=base: store_responses(b, tally, stop, False)] * 2  # type: ignore[misc]
        work.append(lambda b=base: store_responses(b, tally, stop, True))  # type: ignore[misc]
    work.append(lambda: append_items(bases[-1], conv, tally, stop))
    threads = [threading.Thread(target=w, daemon=True) for w in work]
    for t in threads:
        t.start()
    return Load(tally, stop, threads, conv, bases[0])


def wait_for_writes(tally: Tally, after: float, timeout: float) -> float:
    """Seconds from `after` until a store write was acknowledged again."""
    deadline = after + timeout
    while time.monotonic() < deadline:
        if tally.last_ok > after:
            return tally.last_ok - after
        time.sleep(0.1)
    raise AssertionError(f"the store took no write for {timeout} s after the fault ended")


def missing(base: str, load: Load) -> tuple[list[str], list[str]]:
    """The acknowledged responses and conversation items the store does not have."""
    gone = []
    with httpx.Client(base_url=base, timeout=30) as http:
        for rid in load.tally.stored:
            got = http.get(f"/v1/responses/{rid}")
            if got.status_code != 200:
                gone.append(f"{rid} {got.status_code} {got.text[:120]}")
        texts, after = [], None
        while True:
            page = http.get(
                f"/v1/conversations/{load.conv}/items",
                params={"order": "asc", "limit": 100, **({"after": after} if after else {})},
            ).json()
            texts += [c["text"] for item in page["data"] for c in item.get("content", []) if "text" in c]
            if not page.get("has_more"):
                break
            after = page["last_id"]
    have = set(texts)
    return gone, [t for t in load.tally.appended if t not in have]


class BatchWatch:
    """A batch of `n` chat lines, polled as it runs: whether its counts ever went backwards."""

    def __init__(self, base: str, n: int) -> None:
        self.base, self.n, self.stop = base, n, threading.Event()
        self.backwards: list[str] = []
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": MODEL,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                    "max_tokens": 64,
                    "ignore_eos": True,
                },
            }
            for i in range(n)
        ]
        text = "\n".join(json.dumps(x) for x in lines).encode()
        f = httpx.post(f"{base}/v1/files", files={"file": ("in.jsonl", text)}, data={"purpose": "batch"}, timeout=30)
        body = {"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        self.id = httpx.post(f"{base}/v1/batches", json=body, timeout=30).json()["id"]
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def poll(self) -> None:
        seen = 0
        with httpx.Client(base_url=self.base, timeout=30) as http:
            while not self.stop.is_set():
                r = http.get(f"/v1/batches/{self.id}")
                if r.status_code == 200:
                    counts = r.json()["request_counts"]
                    done = counts["completed"] + counts["failed"]
                    if done < seen:
                        self.backwards.append(f"{seen} -> {done}")
                    seen = max(seen, done)
                time.sleep(0.2)

    def finish(self, timeout: float) -> tuple[str, list[str]]:
        """Its end status and the custom_ids of its output, once it ended."""
        deadline = time.monotonic() + timeout
        while (b := httpx.get(f"{self.base}/v1/batches/{self.id}", timeout=30).json())["status"] not in (
            "completed",
            "failed",
            "cancelled",
            "expired",
        ):
            assert time.monotonic() < deadline, f"the batch is still {b['status']}: {b['request_counts']}"
            time.sleep(0.2)
        self.stop.set()
        self.thread.join()
        out = b.get("output_file_id")
        text = httpx.get(f"{self.base}/v1/files/{out}/content", timeout=30).text if out else ""
        return b["status"], [json.loads(line)["custom_id"] for line in text.splitlines()]


def fill(path: str) -> int:
    """Fill the file system holding `path` until it has no room; the bytes written."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        chunk = b"\0" * (64 << 10)
        try:
            while True:
                n += f.write(chunk)
        except OSError:
            pass
    return n


@pytest.fixture
def small_disk() -> Iterator[str]:
    """A 16 MiB tmpfs, mounted for the test (root with CAP_SYS_ADMIN, as CI and the container builds have)."""
    where = tempfile.mkdtemp(prefix="deepinfer-full-")
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", where], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root with CAP_SYS_ADMIN): {mounted.stderr.decode()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True)
        os.rmdir(where)


def test_sqlite_on_a_disk_that_fills_and_empties(make_server: Callable[..., Server], small_disk: str) -> None:
    files = tempfile.mkdtemp(prefix="deepinfer-files-")
    srv = make_server(
        "--state-store", f"{small_disk}/state.sqlite3", "--files-dir", files, "--max-num-seqs", "16",
        "--claim-lease", "4",
    )  # fmt: skip
    load = start_load([srv.url])
    batch = BatchWatch(srv.url, LINES)  # beside the storing clients: its results rows are in the same database
    try:
        time.sleep(3)
        before = len(load.tally.stored)
        filler = f"{small_disk}/filler"
        fill(filler)
        at_fill = httpx.get(f"{srv.url}/v1/batches/{batch.id}", timeout=30).json()["request_counts"]
        time.sleep(5)  # full: every store write is refused, generation without storing goes on
        unstored = httpx.post(
            f"{srv.url}/v1/chat/completions",
            json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]},
            timeout=30,
        )
        assert unstored.status_code == 200, unstored.text
        refused_full = sum(load.tally.refused.values())
        os.unlink(filler)
        took = wait_for_writes(load.tally, time.monotonic(), RECOVERY_S)
        time.sleep(3)
    finally:
        load.end()
    gone, items_gone = missing(srv.url, load)
    status, ids = batch.finish(120)
    print(
        f"the batch beside them: {at_fill} as the disk filled; {status}, {len(ids)} results, "
        f"{len(set(ids))} custom_ids, backwards: {batch.backwards}"
    )
    print(
        f"sqlite full disk: {len(load.tally.stored)} responses and {len(load.tally.appended)} items acknowledged "
        f"({before} before the fill), {dict(load.tally.refused)} refused, writes again {took:.1f} s after room came "
        f"back; missing: {len(gone)} responses, {len(items_gone)} items"
    )
    assert refused_full > 0, "the full disk refused nothing: the test did not fill it"
    assert not load.tally.bad, load.tally.bad[:5]
    assert gone == [] and items_gone == [], (gone[:5], items_gone[:5])
    assert status == "completed" and sorted(ids) == sorted(f"line-{i}" for i in range(LINES)), (status, len(ids))
    assert batch.backwards == [], batch.backwards


def test_postgresql_stopped_under_two_replicas(make_server: Callable[..., Server]) -> None:
    with cluster() as pg:
        url = fresh_database(pg.url, "outage")
        files = tempfile.mkdtemp(prefix="deepinfer-files-")
        a = make_server("--state-store", url, "--files-dir", files)
        b = make_server("--state-store", url, "--files-dir", files)
        load = start_load([a.url, b.url])
        try:
            time.sleep(3)
            pg.stop()
            stopped = time.monotonic()
            time.sleep(12)  # longer than a write's wait: clients waiting on a write get their 503 meanwhile
            unstored = httpx.post(
                f"{b.url}/v1/responses",
                json={"model": MODEL, "input": "x", "max_output_tokens": 4, "store": False},
                timeout=30,
            )
            assert unstored.status_code == 200, unstored.text
            refused_down = sum(load.tally.refused.values())
            pg.start()
            took = wait_for_writes(load.tally, time.monotonic(), RECOVERY_S)
            time.sleep(3)
        finally:
            load.end()
        gone, items_gone = missing(a.url, load)
        print(
            f"postgresql stopped {time.monotonic() - stopped:.0f} s: {len(load.tally.stored)} responses and "
            f"{len(load.tally.appended)} items acknowledged, {dict(load.tally.refused)} refused, writes again "
            f"{took:.1f} s after it came back; missing: {len(gone)} responses, {len(items_gone)} items"
        )
        assert refused_down > 0, "the outage refused nothing"
        assert not load.tally.bad, load.tally.bad[:5]
        assert gone == [] and items_gone == [], (gone[:5], items_gone[:5])
