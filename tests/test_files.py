"""Uploaded files (issue 31): `/v1/files` judged by the `openai` SDK on both stores (state_servers.py): an upload
streamed to disk under a size cap, list, retrieve, content, delete (gone from the table and the disk), expiry."""

from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import Server, start_server

from state_servers import STATE_ARGS

LINES = b"".join(
    b'{"custom_id": "r%d", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n' % i for i in range(50)
)


def files_dir(srv: Server) -> Path:
    """The server's --files-dir, as its config dict was logged... or the default beside its SQLite file."""
    args = list(map(str, srv.proc.args))  # type: ignore[arg-type]
    if "--files-dir" in args:
        return Path(args[args.index("--files-dir") + 1])
    store = args[args.index("--state-store") + 1]
    if store.startswith("postgres"):
        return Path(os.environ["XDG_STATE_HOME"]) / "deepinfer-server" / "files"
    return Path(store).parent / "files"


def test_a_file_is_uploaded_listed_read_and_deleted(state_srv: Server) -> None:
    c = state_srv.client()
    f = c.files.create(file=("batch.jsonl", io.BytesIO(LINES)), purpose="batch")
    assert f.id.startswith("file") and f.bytes == len(LINES) and f.filename == "batch.jsonl" and f.purpose == "batch"
    assert c.files.retrieve(f.id).model_dump() == f.model_dump()
    assert c.files.content(f.id).content == LINES
    assert f.id in [x.id for x in c.files.list(purpose="batch")]
    assert f.id not in [x.id for x in c.files.list(purpose="vision")]
    on_disk = files_dir(state_srv) / f.id
    assert on_disk.read_bytes() == LINES
    gone = c.files.delete(f.id)
    assert gone.deleted and gone.id == f.id
    assert not on_disk.exists()
    for call in (lambda: c.files.retrieve(f.id), lambda: c.files.content(f.id), lambda: c.files.delete(f.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_files_are_paged_newest_first(state_srv: Server) -> None:
    c = state_srv.client()
    made = [c.files.create(file=(f"f{i}.txt", io.BytesIO(b"x" * i)), purpose="user_data").id for i in range(1, 6)]
    page = c.files.list(purpose="user_data", limit=2)
    assert [f.id for f in page.data] == made[::-1][:2] and page.has_more
    walked = [f.id for f in c.files.list(purpose="user_data", limit=2, order="asc")]
    assert [i for i in walked if i in made] == made
    for i in made:
        c.files.delete(i)


@pytest.mark.parametrize(
    ("form", "param"),
    [
        ({"purpose": "batch"}, "file"),
        ({"purpose": "training"}, "purpose"),
        (
            {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "10"},
            "expires_after.seconds",
        ),
        ({"purpose": "batch", "expires_after[seconds]": "3600"}, "expires_after"),
        ({"purpose": "b" * 2000}, "purpose"),
    ],
)
def test_a_bad_upload_is_a_400_naming_the_field(state_srv: Server, form: dict[str, str], param: str) -> None:
    files = {} if param == "file" else {"file": ("a.jsonl", b"{}\n")}
    r = httpx.post(f"{state_srv.url}/v1/files", data=form, files=files or None, timeout=30)
    if param == "file":
        r = httpx.post(f"{state_srv.url}/v1/files", data=form, files={"other": ("x", b"1")}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(f"{state_srv.url}/v1/files", json={"purpose": "batch"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text


def test_an_upload_past_the_cap_is_a_413_and_leaves_nothing(tmp_path: Path) -> None:
    room = tmp_path / "files"
    s = start_server(*STATE_ARGS, "--state-store", "memory", "--files-dir", str(room), "--max-file-bytes", "1000000")
    try:
        with pytest.raises(openai.APIStatusError) as e:
            s.client().files.create(file=("big.bin", io.BytesIO(b"\0" * 3_000_000)), purpose="batch")
        assert e.value.status_code == 413
        f = s.client().files.create(file=("ok.bin", io.BytesIO(b"\1" * 1_000_000)), purpose="batch")
        assert f.bytes == 1_000_000 and sorted(p.name for p in room.iterdir()) == [f.id]
    finally:
        s.stop()


def test_uploads_past_the_files_total_are_a_413_and_a_batch_stops_before_its_results_pass_it(tmp_path: Path) -> None:
    """--files-max-total-bytes: what all files hold together. Two uploads at once that would pass it together do
    not both land; deleting makes room; a batch's results count too, and a batch stops before they pass it."""
    from concurrent.futures import ThreadPoolExecutor

    from test_batches import chat_lines, results, submit, wait

    room = tmp_path / "files"
    cap = 2_000_000
    args = ("--state-store", str(tmp_path / "s.sqlite3"), "--files-dir", str(room), "--files-max-total-bytes")
    s = start_server(*STATE_ARGS, *args, str(cap))
    try:
        c = s.client()
        first = c.files.create(file=("a.bin", io.BytesIO(b"\1" * 1_000_000)), purpose="user_data")

        def upload(i: int) -> Any:
            try:
                return c.files.create(file=(f"b{i}.bin", io.BytesIO(b"\2" * 700_000)), purpose="user_data")
            except openai.APIStatusError as e:
                return e

        with ThreadPoolExecutor(2) as pool:
            got = list(pool.map(upload, range(2)))
        refused = [g for g in got if isinstance(g, openai.APIStatusError)]
        assert len(refused) == 1, got  # 1,000,000 + 700,000 fits; another 700,000 does not
        e = refused[0]
        assert e.status_code == 413 and e.body["code"] == "file_storage_limit_exceeded", e.body  # type: ignore[index]
        assert str(cap) in e.message
        listed = {f.id for f in c.files.list()}
        on_disk = {p.name for p in room.iterdir()}
        assert listed == on_disk and sum(f.bytes for f in c.files.list()) <= cap, (listed, on_disk)
        c.files.delete(first.id)
        c.files.create(file=("c.bin", io.BytesIO(b"\3" * 1_000_000)), purpose="user_data")

        # Fill the room but for a batch's input. This test once asserted that the batch's output was written past
        # the total (every custom_id): issue 39 asks the opposite, since 1.2 MB of input made 181 MB of results and
        # a full disk gave everyone 500s. Its results now count, and it stops taking lines before they pass it,
        # ending `failed` with what ran.
        lines = chat_lines(40, max_tokens=64)
        text = "\n".join(json.dumps(x) for x in lines).encode()
        left = cap - sum(f.bytes for f in c.files.list())
        c.files.create(file=("fill.bin", io.BytesIO(b"\5" * (left - len(text) - 8000))), purpose="user_data")
        b = wait(s, submit(s, lines).id)
        assert b.status == "failed" and b.errors.data[0].code == "file_storage_limit_exceeded", b
        assert 0 < b.request_counts.completed < 40, b.request_counts
        out, errors = results(s, b)
        assert len({o["custom_id"] for o in out}) == len(out) == b.request_counts.completed and not errors
        assert sum(f.bytes for f in c.files.list()) <= cap
    finally:
        s.stop()


def test_a_file_past_its_expiry_is_gone_from_table_and_disk(tmp_path: Path) -> None:
    """expires_after is at least an hour: the file is made, the clock of the store is not ours to move, so the
    row's expiry is set in the past through the database and the server's sweep (at start) removes it."""
    import sqlite3

    spec, room = tmp_path / "state.sqlite3", tmp_path / "files"
    args: Any = (*STATE_ARGS, "--state-store", str(spec), "--files-dir", str(room))
    a = start_server(*args)
    try:
        f = a.client().files.create(
            file=("old.jsonl", io.BytesIO(b"{}\n")),
            purpose="batch",
            expires_after={"anchor": "created_at", "seconds": 3600},
        )
        assert f.expires_at == f.created_at + 3600
        keep = a.client().files.create(file=("keep.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    finally:
        a.stop()
    with sqlite3.connect(spec) as db:
        db.execute("UPDATE files SET expires_at = ? WHERE id = ?", (int(time.time()) - 1, f.id))
    b = start_server(*args)
    try:
        deadline = time.monotonic() + 10
        while (room / f.id).exists():
            assert time.monotonic() < deadline, "an expired file's content is still on disk"
            time.sleep(0.1)
        with pytest.raises(openai.NotFoundError):
            b.client().files.retrieve(f.id)
        assert b.client().files.content(keep.id).content == b"{}\n"
    finally:
        b.stop()


def test_with_the_state_store_off_files_are_refused() -> None:
    s = start_server(*STATE_ARGS, "--state-store", "off")
    try:
        with pytest.raises(openai.BadRequestError):
            s.client().files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="batch")
    finally:
        s.stop()
