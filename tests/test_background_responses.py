"""Background responses (issue 31): `background: true` answers at once with the queued Response, runs through
admission like any other request, is read back by `GET` (its stream too, from `starting_after`), and is stopped
by `cancel`; judged by the `openai` SDK. The plain paths run on both stores (state_servers.py); the slow ones on
a paced server of their own."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from pg_server import fresh_database
from state_servers import STATE_ARGS

LONG = {"ignore_eos": True}  # the sim answers until max_output_tokens


def create(srv: Server, **body: Any) -> Any:
    body = {"model": MODEL, "max_output_tokens": 16, "reasoning": {"effort": "none"}, **body}
    return srv.client().responses.create(**body)


def until_done(srv: Server, rid: str, timeout: float = 60) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        r = srv.client().responses.retrieve(rid)
        if r.status not in ("queued", "in_progress"):
            return r
        assert time.monotonic() < deadline, f"{rid} still {r.status}"
        time.sleep(0.05)


def until_running(srv: Server, rid: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while srv.client().responses.retrieve(rid).status != "in_progress":
        assert time.monotonic() < deadline, f"{rid} never ran"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def paced() -> Iterator[Server]:
    """One slot, 20 ms a token: a background response takes long enough to be seen queued, running, cancelled."""
    s = start_server(*STATE_ARGS[:2], "--max-num-seqs", "1", "--state-store", "memory", "--sim-decode-step-ms", "20")
    yield s
    s.stop()


def test_a_background_response_is_queued_then_read_back_finished(state_srv: Server) -> None:
    r = create(state_srv, input="Say something.", background=True)
    assert r.background and r.status in ("queued", "in_progress") and r.output == []
    done = until_done(state_srv, r.id)
    assert done.status in ("completed", "incomplete") and done.background and done.output
    assert done.id == r.id and done.usage is not None and done.usage.output_tokens > 0
    # Its input is kept like any stored response's.
    items = state_srv.client().responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["Say something."]  # type: ignore[union-attr]


def test_its_stream_is_read_again_from_any_sequence_number(state_srv: Server) -> None:
    c = state_srv.client()
    events = list(c.responses.create(model=MODEL, input="Count.", max_output_tokens=12, stream=True, background=True))
    assert events[0].type == "response.created" and events[0].response.background  # type: ignore[union-attr]
    assert events[-1].type in ("response.completed", "response.incomplete")
    rid = events[0].response.id  # type: ignore[union-attr]
    again = list(c.responses.retrieve(rid, stream=True, starting_after=2))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events[3:]]
    assert [e.sequence_number for e in again] == list(range(3, len(events)))
    final = c.responses.retrieve(rid)
    assert final.model_dump() == events[-1].response.model_dump()  # type: ignore[union-attr]


def test_what_cannot_run_in_the_background_is_a_clear_400(state_srv: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        create(state_srv, input="x", background=True, store=False)
    assert e.value.body["param"] == "background"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as ne:  # OpenAI's 400, as for a foreground request
        create(state_srv, input="x", background=True, previous_response_id="resp_missing")
    assert ne.value.body["param"] == "previous_response_id"  # type: ignore[index]
    assert ne.value.body["code"] == "previous_response_not_found"  # type: ignore[index]
    plain = create(state_srv, input="x")
    with pytest.raises(openai.BadRequestError):
        state_srv.client().responses.cancel(plain.id)
    r = httpx.get(f"{state_srv.url}/v1/responses/{plain.id}", params={"stream": "true"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream", r.text


def test_a_background_response_joins_its_conversation(state_srv: Server) -> None:
    c = state_srv.client()
    conv = c.conversations.create()
    r = create(state_srv, input="In the background.", background=True, conversation=conv.id)
    assert r.conversation is not None and r.conversation.id == conv.id
    done = until_done(state_srv, r.id)
    items = list(c.conversations.items.list(conv.id, order="asc"))
    assert [i.id for i in items][1:] == [o.id for o in done.output]


def test_background_responses_wait_for_a_slot_instead_of_a_429(paced: Server) -> None:
    """One slot and no wait queue to speak of: twelve background responses are all taken at once, run one after
    another, and finish; a plain request beside them still gets its answer (or its 429) as before."""
    rs = [create(paced, input=f"job {i}", background=True, max_output_tokens=4, extra_body=LONG) for i in range(12)]
    assert all(r.status == "queued" for r in rs)
    assert {until_done(paced, r.id, timeout=120).status for r in rs} <= {"completed", "incomplete"}


def test_a_running_background_response_is_cancelled(paced: Server) -> None:
    c = paced.client()
    r = create(paced, input="Go on and on.", background=True, max_output_tokens=2000, extra_body=LONG)
    until_running(paced, r.id)
    cancelled = c.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.id == r.id
    assert c.responses.retrieve(r.id).status == "cancelled"
    # Its slot is free again: the next request runs at once, and cancelling again answers the same.
    assert create(paced, input="next", max_output_tokens=4).status in ("completed", "incomplete")
    assert c.responses.cancel(r.id).status == "cancelled"
    # The replayed stream ends where it was stopped.
    events = list(c.responses.retrieve(r.id, stream=True))
    assert events and events[0].type == "response.created" and len(events) < 2000


def replica(store: str) -> Server:
    return start_server(*STATE_ARGS[:2], "--max-num-seqs", "2", "--state-store", store, "--sim-decode-step-ms", "20")


def test_a_replica_finishes_the_background_response_of_one_that_was_killed(pg_url: str) -> None:
    # A database of its own: what other tests' stopped servers left running in the shared one is not this test's.
    store = fresh_database(pg_url, "background_takeover")
    a, b = replica(store), replica(store)
    try:
        r = create(a, input="Run long.", background=True, max_output_tokens=100, extra_body=LONG)
        until_running(a, r.id)
        a.proc.kill()  # SIGKILL, mid-answer
        assert b.client().responses.retrieve(r.id).status in ("queued", "in_progress")
        a.proc.wait()
        done = until_done(b, r.id, timeout=90)  # once the dead replica's claim runs out (15 s)
        assert done.status in ("completed", "incomplete"), done
        assert done.usage is not None and done.usage.output_tokens == 100 and done.output
        assert "running again a background response whose replica stopped" in b.log()
    finally:
        a.stop()
        b.stop()


def test_a_background_response_is_cancelled_through_another_replica(pg_url: str) -> None:
    a, b = replica(pg_url), replica(pg_url)
    try:
        r = create(a, input="Go on and on.", background=True, max_output_tokens=2000, extra_body=LONG)
        until_running(a, r.id)
        t0 = time.monotonic()
        cancelled = b.client().responses.cancel(r.id)  # b does not run it: a does, and a stops it
        assert cancelled.status == "cancelled" and time.monotonic() - t0 < 6
        assert a.client().responses.retrieve(r.id).status == "cancelled"
        deadline = time.monotonic() + 10
        while httpx.get(f"{a.url}/get_load", timeout=5).json()["load"] != 0:  # its slot on a is free
            assert time.monotonic() < deadline, "the cancelled response still runs on its replica"
            time.sleep(0.1)
    finally:
        a.stop()
        b.stop()


def test_a_cancel_asked_of_a_replica_that_then_dies_is_not_lost_to_the_takeover(pg_url: str) -> None:
    """The cancel is written to the claim, but its replica stops before it reads it: the replica that takes the
    run over records it as cancelled and does not run it again."""
    store = fresh_database(pg_url, "background_cancel_takeover")
    a, b = replica(store), replica(store)
    try:
        r = create(a, input="Go on and on.", background=True, max_output_tokens=2000, extra_body=LONG)
        until_running(a, r.id)
        a.proc.send_signal(signal.SIGSTOP)  # alive to the store (its claim holds a while), deaf to the cancel
        asked = b.client().responses.cancel(r.id)
        assert asked.status in ("queued", "in_progress"), asked  # its replica has not answered within the wait
        a.proc.kill()
        a.proc.wait()
        done = until_done(b, r.id, timeout=60)  # once the claim runs out (15 s), b takes it over
        assert done.status == "cancelled", done
        assert "whose replica stopped was cancelled" in b.log()
        assert "running again a background response" not in b.log()
    finally:
        a.stop()
        b.stop()
