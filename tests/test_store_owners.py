"""Stored state is bounded per owner (issue 39, point 3), over HTTP on both stores (SQLite, and a PostgreSQL server
started here): what the prompt drops is not stored and a chain holds each turn once, so a chain carrying megabytes
of dropped items stays small, and one past --state-store-max-chain-bytes is refused fast; two owners (two API keys)
where one filling its share gets a 429 and the other's records all stay, and neither reads the other's; a batch
whose output would pass the files cap stops and ends `failed` with the total kept under the cap."""

from __future__ import annotations

import io
import json
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from state_servers import STATE_ARGS

JUNK = "x" * (1 << 20)  # 1 MiB the prompt never reads


@pytest.fixture(params=["sqlite", "postgresql"])
def spec(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "state.sqlite3")
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture
def serve(spec: str, tmp_path: Path) -> Iterator[Any]:
    started: list[Server] = []

    def make(*args: str) -> Server:
        s = start_server(*STATE_ARGS, "--state-store", spec, "--files-dir", str(tmp_path / "files"), *args)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def keys(tmp_path: Path, n: int) -> tuple[Path, list[str]]:
    """n fresh keys (fresh owners, also in a PostgreSQL store other tests share), in a --api-key-file."""
    names = [f"key-{i}-{secrets.token_hex(8)}" for i in range(n)]
    path = tmp_path / "keys"
    path.write_text("\n".join(names) + "\n")
    return path, names


def turn(c: httpx.Client, prev: str | None, text: str, junk: bool = False) -> httpx.Response:
    items: list[dict[str, Any]] = [{"role": "user", "content": text}]
    if junk:  # a reasoning summary and unknown keys: what the prompt drops
        items = [
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": JUNK}], "encrypted_content": JUNK},
            {"role": "user", "content": [{"type": "input_text", "text": text, "pad": JUNK}], "extra": JUNK},
        ]
    body: dict[str, Any] = {"model": MODEL, "max_output_tokens": 4, "input": items}
    if prev:
        body["previous_response_id"] = prev
    return c.post("/v1/responses", json=body)


def error(r: httpx.Response) -> dict[str, Any]:
    return dict(r.json()["error"])


def test_a_chain_holds_each_turn_once_without_what_the_prompt_drops_and_a_huge_one_is_refused_fast(
    serve: Any, spec: str
) -> None:
    cap = 40_000
    s = serve("--state-store-max-chain-bytes", str(cap), "--state-store-max-item-bytes", "100000")
    with httpx.Client(base_url=s.base_url, timeout=60) as c:
        # Four turns of 3 MiB each that the prompt drops: were it stored (or copied along), the chain would pass the
        # 40 kB cap at once.
        prev = None
        for i in range(4):
            r = turn(c, prev, f"turn {i}", junk=True)
            assert r.status_code == 200, r.text
            prev = r.json()["id"]
        items = c.get(f"/v1/responses/{prev}/input_items", params={"order": "asc"}).json()["data"]
        assert [i["type"] for i in items] == ["reasoning", "message"]
        assert items[0]["summary"] == [] and "encrypted_content" not in items[0]
        assert items[1]["content"] == [{"type": "input_text", "text": "turn 3"}] and "extra" not in items[1]
        if not spec.startswith("postgresql"):
            held = sum(p.stat().st_size for p in Path(spec).parent.glob("state.sqlite3*"))
            assert held < 2_000_000, held  # 12 MiB sent
        # The chain is whole: the model's prompt holds every turn (each adds its input to the next's usage).
        usage = [turn(c, prev, "again").json()["usage"]["input_tokens"]]
        # Small turns until the chain holds more than the cap: then a 400 naming the parameter, fast.
        for i in range(200):
            r = turn(c, prev, f"small turn {i}")
            if r.status_code != 200:
                break
            usage.append(r.json()["usage"]["input_tokens"])
            prev = r.json()["id"]
        assert usage == sorted(usage) and usage[-1] > usage[0], usage
        assert r.status_code == 400 and error(r)["param"] == "previous_response_id", r.text
        assert str(cap) in error(r)["message"]
        t0 = time.monotonic()
        r = turn(c, prev, "once more")
        assert r.status_code == 400 and time.monotonic() - t0 < 2.0
        # A conversation past the cap: refused by its size, before its items are read.
        conv = c.post("/v1/conversations", json={}).json()["id"]
        for _ in range(3):
            added = [{"role": "user", "content": "y" * 1000} for _ in range(20)]
            assert c.post(f"/v1/conversations/{conv}/items", json={"items": added}).status_code == 200
        r = c.post("/v1/responses", json={"model": MODEL, "input": "hi", "conversation": conv})
        assert r.status_code == 400 and error(r)["param"] == "conversation", r.text
        # An item past --state-store-max-item-bytes, as stored, is a 400 naming it.
        big = [{"role": "user", "content": "ok"}, {"role": "user", "content": "z" * 150_000}]
        r = c.post("/v1/responses", json={"model": MODEL, "input": big})
        assert r.status_code == 400 and error(r)["param"] == "input[1]", r.text
        r = c.post(f"/v1/conversations/{conv}/items", json={"items": big})
        assert r.status_code == 400 and error(r)["param"] == "items[1]", r.text


def test_an_owner_past_its_share_is_refused_and_another_owners_records_all_stay(
    serve: Any, spec: str, tmp_path: Path
) -> None:
    keyfile, (key_a, key_b) = keys(tmp_path, 2)
    # Each owner's share: half of 400 kB, the default split between 2 keys; on the PostgreSQL store other tests
    # share (whose records count in its total), set as such with no total.
    shares = ("--state-store-max-bytes", "400000")
    if spec.startswith("postgresql"):
        shares = ("--state-store-max-bytes", "0", "--state-store-max-bytes-per-owner", "200000")
    s = serve("--api-key-file", str(keyfile), *shares)
    a = httpx.Client(base_url=s.base_url, timeout=60, headers={"Authorization": f"Bearer {key_a}"})
    b = httpx.Client(base_url=s.base_url, timeout=60, headers={"Authorization": f"Bearer {key_b}"})
    ca = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=key_a, max_retries=0)
    cb = openai.OpenAI(base_url=f"{s.base_url}/v1", api_key=key_b, max_retries=0)
    with a, b:
        kept = b.post("/v1/responses", json={"model": MODEL, "input": "mine", "max_output_tokens": 4}).json()["id"]
        conv = b.post("/v1/conversations", json={"items": [{"role": "user", "content": "mine"}]}).json()["id"]
        f = cb.files.create(file=("b.jsonl", io.BytesIO(b"b's file\n")), purpose="user_data")
        # A fills its share: its first additions land, then every request that would store more is a 429.
        mine = a.post("/v1/conversations", json={}).json()["id"]
        statuses = []
        for _ in range(6):
            items = [{"role": "user", "content": "z" * 20_000} for _ in range(5)]
            r = a.post(f"/v1/conversations/{mine}/items", json={"items": items})
            statuses.append(r.status_code)
            if r.status_code != 200:
                break
        assert statuses[0] == 200 and statuses[-1] == 429, statuses
        assert error(r)["code"] == "storage_quota_exceeded" and error(r)["type"] == "insufficient_quota", r.text
        r = a.post("/v1/responses", json={"model": MODEL, "input": "more", "max_output_tokens": 4})
        assert r.status_code == 429 and error(r)["code"] == "storage_quota_exceeded", r.text
        r = a.post("/v1/responses", json={"model": MODEL, "input": "more", "max_output_tokens": 4, "store": False})
        assert r.status_code == 200, r.text
        time.sleep(1.5)  # as long as a sweep would have taken to evict
        # B's records all stay, and B still stores.
        assert b.get(f"/v1/responses/{kept}").status_code == 200
        assert b.get(f"/v1/conversations/{conv}").status_code == 200
        assert b.get(f"/v1/conversations/{conv}/items").json()["data"][0]["content"][0]["text"] == "mine"
        assert cb.files.content(f.id).read() == b"b's file\n"
        r = b.post("/v1/responses", json={"model": MODEL, "input": "still", "max_output_tokens": 4})
        assert r.status_code == 200, r.text
        # Neither reads the other's: another owner's id is a 404, and lists hold only one's own.
        assert a.get(f"/v1/responses/{kept}").status_code == 404
        assert a.get(f"/v1/responses/{kept}/input_items").status_code == 404
        assert a.delete(f"/v1/responses/{kept}").status_code == 404
        assert a.get(f"/v1/conversations/{conv}").status_code == 404
        assert a.post(f"/v1/conversations/{conv}/items", json={"items": []}).status_code == 404
        assert a.get(f"/v1/files/{f.id}").status_code == 404
        assert a.get(f"/v1/files/{f.id}/content").status_code == 404
        r = a.post("/v1/responses", json={"model": MODEL, "input": "x", "store": False, "previous_response_id": kept})
        # Another owner's response is not there for A: OpenAI's 400 previous_response_not_found, as for any id.
        assert r.status_code == 400 and error(r)["code"] == "previous_response_not_found", r.text
        assert error(r)["param"] == "previous_response_id", r.text
        assert f.id not in {x.id for x in ca.files.list()} and f.id in {x.id for x in cb.files.list()}
        # Deleting makes room again.
        assert a.delete(f"/v1/conversations/{mine}").status_code == 200
        deadline = time.monotonic() + 15  # an owner's measure is read again within 5 s
        while (r := a.post("/v1/conversations", json={})).status_code == 429:
            assert time.monotonic() < deadline, r.text
            time.sleep(0.5)
        assert r.status_code == 200, r.text


@pytest.fixture
def own_sqlite(tmp_path: Path) -> Iterator[Any]:
    """Servers on a SQLite store of their own (a files total counts every file of the store: not a shared one)."""
    started: list[Server] = []

    def make(*args: str) -> Server:
        s = start_server(*STATE_ARGS, "--state-store", str(tmp_path / "own.sqlite3"), *args)
        started.append(s)
        return s

    yield make
    for s in started:
        s.stop()


def test_a_batch_whose_output_would_pass_the_files_cap_stops_and_fails(own_sqlite: Any, tmp_path: Path) -> None:
    cap = 150_000
    s = own_sqlite("--files-dir", str(tmp_path / "files"), "--files-max-total-bytes", str(cap))
    c = s.client()
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 64},
        }
        for i in range(300)
    ]
    text = "\n".join(json.dumps(x) for x in lines).encode()
    f = c.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch")
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 180
    while (b := c.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled", "expired"):
        assert time.monotonic() < deadline, b
        time.sleep(0.2)
    assert b.status == "failed", b
    assert b.errors is not None and b.errors.data is not None
    assert b.errors.data[0].code == "file_storage_limit_exceeded", b.errors
    counts = b.request_counts
    assert counts is not None and 0 < counts.completed < 300, counts
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()] if b.output_file_id else []
    ids = [o["custom_id"] for o in out]
    assert len(ids) == len(set(ids)) == counts.completed
    assert sum(x.bytes for x in c.files.list()) <= cap
    # The room left is still the clients': an upload that fits lands.
    room = cap - sum(x.bytes for x in c.files.list())
    if room > 10:
        c.files.create(file=("small.bin", io.BytesIO(b"\1" * 10)), purpose="user_data")
