"""Stored responses (issue 31, first part): `store` on by default, `previous_response_id`, `GET`/`DELETE
/v1/responses/{id}`, `input_items`, judged by the `openai` SDK and the Agents SDK, on both stores: the embedded
SQLite file and a PostgreSQL server (started here) that replicas share."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from state_servers import STATE_ARGS as ARGS


@pytest.fixture
def srv(state_srv: Server) -> Server:
    return state_srv


def create(srv: Server, **body: Any) -> Any:
    body = {"model": MODEL, "max_output_tokens": 8, "reasoning": {"effort": "none"}, **body}
    return srv.client().responses.create(**body)


def test_a_response_is_stored_by_default_and_read_back_as_it_was_sent(srv: Server) -> None:
    r = create(srv, input="Name a city in France.")
    got = srv.client().responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()


def test_previous_response_id_continues_the_chain_without_its_instructions(srv: Server) -> None:
    c = srv.client()
    first = create(srv, input="My name is Ada.", instructions="Answer in one word. " * 20)
    second = create(srv, input="What is my name?", previous_response_id=first.id)
    # The same conversation sent whole, without the first request's instructions: the same prompt.
    whole = [
        {"role": "user", "content": "My name is Ada."},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "What is my name?"},
    ]
    alone = create(srv, input=whole, store=False)
    assert second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens == alone.usage.input_tokens
    assert second.previous_response_id == first.id
    assert c.responses.retrieve(second.id).model_dump() == second.model_dump()
    # Its input items are its own; the chain's are not repeated.
    items = c.responses.input_items.list(second.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]
    assert items.data[0].content[0].text == "What is my name?"  # type: ignore[union-attr]


def test_a_streamed_response_can_be_named_the_moment_its_stream_ends(srv: Server) -> None:
    c = srv.client()
    for _ in range(5):
        events = list(c.responses.create(model=MODEL, input="Count to three.", max_output_tokens=6, stream=True))
        final = events[-1].response  # type: ignore[union-attr]
        assert events[-1].type in ("response.completed", "response.incomplete")
        nxt = create(srv, input="Again.", previous_response_id=final.id)
        assert c.responses.retrieve(nxt.id).previous_response_id == final.id
    # A streamed continuation says what it continues from its first event to its last.
    events = list(
        c.responses.create(model=MODEL, input="More.", max_output_tokens=6, stream=True, previous_response_id=nxt.id)
    )
    whole = [e for e in events if hasattr(e, "response")]
    assert len(whole) >= 3 and all(e.response.previous_response_id == nxt.id for e in whole)  # type: ignore[union-attr]


def test_store_false_keeps_nothing_and_delete_removes(srv: Server) -> None:
    c = srv.client()
    kept, not_kept = create(srv, input="a"), create(srv, input="b", store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(not_kept.id)
    c.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(kept.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.delete(kept.id)
    # OpenAI's answer, which Codex-style clients key on: a 400 previous_response_not_found naming the param.
    with pytest.raises(openai.BadRequestError) as e:
        create(srv, input="c", previous_response_id=kept.id)
    assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert e.value.body["code"] == "previous_response_not_found"  # type: ignore[index]


def test_input_items_are_paginated_both_ways(srv: Server) -> None:
    c = srv.client()
    r = create(srv, input=[{"role": "user", "content": f"line {i}"} for i in range(5)])
    desc = c.responses.input_items.list(r.id, limit=2)
    texts = [i.content[0].text for i in desc.data]  # type: ignore[union-attr]
    assert texts == ["line 4", "line 3"] and desc.has_more
    rest = c.responses.input_items.list(r.id, limit=10, after=desc.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["line 2", "line 1", "line 0"] and not rest.has_more  # type: ignore[union-attr]
    asc = c.responses.input_items.list(r.id, order="asc")
    assert [i.content[0].text for i in asc.data] == [f"line {i}" for i in range(5)]  # type: ignore[union-attr]
    bad = httpx.get(f"{srv.url}/v1/responses/{r.id}/input_items", params={"limit": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"
    for url in (f"/v1/responses/{r.id}/input_items?limit=ten", f"/v1/responses/{r.id}?stream=maybe"):
        bad = httpx.get(f"{srv.url}{url}")
        assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error", bad.text


def test_the_agents_sdk_chains_turns_by_previous_response_id(srv: Server) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    client = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    agent = Agent(
        name="a",
        instructions="Be brief.",
        model=OpenAIResponsesModel(MODEL, client),
        model_settings=ModelSettings(max_tokens=400),
    )

    async def run() -> tuple[Any, Any]:
        async with client:
            first = await Runner.run(agent, "Remember: blue.")
            second = await Runner.run(
                agent, "What did I ask you to remember?", previous_response_id=first.last_response_id
            )
            return first, second

    first, second = asyncio.run(run())
    assert first.last_response_id and second.last_response_id
    stored = srv.client().responses.retrieve(second.last_response_id)
    assert stored.previous_response_id == first.last_response_id


def test_replicas_on_one_postgresql_store_see_each_others_responses(pg_url: str) -> None:
    a, b = start_server(*ARGS, "--state-store", pg_url), start_server(*ARGS, "--state-store", pg_url)
    try:
        r = create(a, input="Stored by replica a.")
        assert b.client().responses.retrieve(r.id).model_dump() == r.model_dump()
        nxt = create(b, input="Continued on replica b.", previous_response_id=r.id)
        assert a.client().responses.retrieve(nxt.id).previous_response_id == r.id
        b.client().responses.delete(r.id)
        with pytest.raises(openai.NotFoundError):
            a.client().responses.retrieve(r.id)
    finally:
        a.stop()
        b.stop()


def test_stored_responses_survive_a_restart(state: str) -> None:
    a = start_server(*ARGS, "--state-store", state)
    try:
        r = create(a, input="Keep me.")
    finally:
        a.stop()
    b = start_server(*ARGS, "--state-store", state)
    try:
        assert b.client().responses.retrieve(r.id).id == r.id
        nxt = create(b, input="Still there?", previous_response_id=r.id)
        assert nxt.status in ("completed", "incomplete")
    finally:
        b.stop()


def test_responses_and_batches_past_their_time_are_removed(tmp_path: Any) -> None:
    spec = str(tmp_path / "ttl.sqlite3")
    a = start_server(*ARGS, "--state-store", spec)
    try:
        old = create(a, input="Forget me.")
        line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions"}
        line["body"] = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
        f = a.client().files.create(file=("in.jsonl", json.dumps(line).encode()), purpose="batch")
        batch = a.client().batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        while a.client().batches.retrieve(batch.id).status != "completed":
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        a.stop()
    time.sleep(2.2)  # created_at is in whole seconds
    b = start_server(*ARGS, "--state-store", spec, "--response-store-ttl", "1")
    try:
        young = create(b, input="Keep me.")
        deadline = time.monotonic() + 10
        while True:  # removed at start, by a task of its own
            try:
                b.client().responses.retrieve(old.id)
            except openai.NotFoundError:
                break
            assert time.monotonic() < deadline, "a response past --response-store-ttl is still there"
            time.sleep(0.1)
        assert b.client().responses.retrieve(young.id).id == young.id
        with pytest.raises(openai.NotFoundError):
            b.client().batches.retrieve(batch.id)  # ended before the TTL: gone with its results
    finally:
        b.stop()


def test_with_storing_off_a_chain_is_refused_and_nothing_is_kept() -> None:
    s = start_server(*ARGS, "--disable-response-store")
    try:
        r = create(s, input="x")
        with pytest.raises(openai.NotFoundError):
            s.client().responses.retrieve(r.id)
        with pytest.raises(openai.BadRequestError) as e:
            create(s, input="y", previous_response_id=r.id)
        assert e.value.body["param"] == "previous_response_id"  # type: ignore[index]
    finally:
        s.stop()


def test_the_default_store_is_a_file_under_the_state_directory() -> None:
    s = start_server(*ARGS)
    try:
        r = create(s, input="where am I kept?")
        assert s.client().responses.retrieve(r.id).id == r.id
    finally:
        s.stop()
    assert os.path.isfile(os.path.join(os.environ["XDG_STATE_HOME"], "deepinfer-server", "state.sqlite3"))


def test_a_store_that_cannot_be_opened_stops_the_start_clearly(tmp_path: Any) -> None:
    (tmp_path / "dir.sqlite3").mkdir()
    bad = tmp_path / "file"
    bad.write_text("")
    for store, said in ((tmp_path / "dir.sqlite3", "is a directory"), (bad / "x.sqlite3", "cannot make the directory")):
        cmd = [sys.executable, "-m", "deepinfer_server", "--port", "0", *ARGS, "--state-store", str(store)]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert run.returncode != 0 and "--state-store" in run.stderr and said in run.stderr, run.stderr[-2000:]
    # A database that refuses: the start stops with the store named, its password cut.
    url = "postgresql://user:secret@127.0.0.1:1/db"
    cmd = [sys.executable, "-m", "deepinfer_server", "--port", "0", *ARGS, "--state-store", url]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode != 0 and "cannot open the state store" in out and "secret" not in out, out[-2000:]
