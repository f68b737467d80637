"""Batches (issue 31): the OpenAI Batch API through the `openai` SDK, on both stores. Lines run through the one
request path in idle slots only; a client's request never waits or gets a 429 because of them; each custom_id
appears exactly once in the output or error file, across a SIGKILL and a replica's takeover."""

from __future__ import annotations

import io
import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from state_servers import STATE_ARGS

DONE = ("completed", "failed", "cancelled", "expired")


def chat_lines(n: int, **body: Any) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": 8, **body},
        }
        for i in range(n)
    ]


def submit(srv: Server, lines: list[dict[str, Any]], endpoint: str = "/v1/chat/completions") -> Any:
    c = srv.client()
    text = "\n".join(json.dumps(x) for x in lines).encode()
    f = c.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch")
    return c.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")  # type: ignore[arg-type]


def wait(srv: Server, bid: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (b := srv.client().batches.retrieve(bid)).status not in DONE:
        assert time.monotonic() < deadline, f"{bid} still {b.status}: {b.request_counts}"
        time.sleep(0.1)
    return b


def results(srv: Server, b: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    read = lambda fid: [json.loads(x) for x in srv.client().files.content(fid).text.splitlines()] if fid else []  # noqa: E731
    return read(b.output_file_id), read(b.error_file_id)


def test_a_batch_runs_every_line_once_keyed_by_custom_id(state_srv: Server) -> None:
    lines = chat_lines(30)
    lines.append({**lines[0], "custom_id": "bad", "body": {"model": "no-such-model", "messages": []}})
    b = submit(state_srv, lines)
    assert b.status == "validating" and b.endpoint == "/v1/chat/completions"
    done = wait(state_srv, b.id)
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (31, 30, 1)
    out, err = results(state_srv, done)
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(30))
    assert all(x["response"]["status_code"] == 200 and x["response"]["body"]["choices"] for x in out)
    assert [(x["custom_id"], x["response"]["status_code"]) for x in err] == [("bad", 404)]
    assert b.id in [x.id for x in state_srv.client().batches.list(limit=100).data]


def test_output_expires_after_sets_the_results_files_expiry(state_srv: Server) -> None:
    c = state_srv.client()
    text = "\n".join(json.dumps(x) for x in chat_lines(3)).encode()
    f = c.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch")
    b = c.batches.create(
        input_file_id=f.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        output_expires_after={"anchor": "created_at", "seconds": 3600},
    )
    done = wait(state_srv, b.id)
    assert done.status == "completed" and done.output_file_id, done
    out = c.files.retrieve(done.output_file_id)
    assert out.expires_at is not None and out.expires_at - out.created_at == 3600, out
    # Without it the results are kept until deleted (OpenAI's default).
    plain = wait(state_srv, submit(state_srv, chat_lines(2)).id)
    assert c.files.retrieve(plain.output_file_id).expires_at is None  # type: ignore[arg-type]
    for bad in ({"anchor": "created_at", "seconds": 60}, {"anchor": "last_active_at", "seconds": 3600}, "1h"):
        r = httpx.post(
            f"{state_srv.url}/v1/batches",
            json={"input_file_id": f.id, "endpoint": "/v1/chat/completions", "completion_window": "24h",
                  "output_expires_after": bad},
            timeout=30,
        )  # fmt: skip
        assert r.status_code == 400 and r.json()["error"]["param"] == "output_expires_after", r.text


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/responses"])
def test_completions_and_responses_lines(state_srv: Server, endpoint: str) -> None:
    body = (
        {"prompt": "Once upon", "max_tokens": 6}
        if endpoint == "/v1/completions"
        else {"input": "Hi", "max_output_tokens": 6}
    )
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": {"model": MODEL, **body}} for i in range(5)
    ]
    done = wait(state_srv, submit(state_srv, lines, endpoint).id)
    out, err = results(state_srv, done)
    assert done.status == "completed" and not err and sorted(x["custom_id"] for x in out) == [f"c{i}" for i in range(5)]
    kind = "text_completion" if endpoint == "/v1/completions" else "response"
    assert {x["response"]["body"]["object"] for x in out} == {kind}


def test_an_input_that_does_not_check_out_fails_the_batch_naming_its_lines(state_srv: Server) -> None:
    lines = chat_lines(3)
    lines[1]["url"] = "/v1/responses"
    lines[2]["custom_id"] = "r0"
    done = wait(state_srv, submit(state_srv, lines).id)
    assert done.status == "failed" and done.errors is not None
    assert [(e.line, e.code) for e in done.errors.data or []] == [(2, "mismatched_url"), (3, "duplicate_custom_id")]


def test_a_batch_that_cannot_be_created_is_a_clear_4xx(state_srv: Server) -> None:
    c = state_srv.client()
    with pytest.raises(openai.NotFoundError) as e:
        c.batches.create(input_file_id="file_missing", endpoint="/v1/chat/completions", completion_window="24h")
    assert e.value.body["param"] == "input_file_id"  # type: ignore[index]
    other = c.files.create(file=("x.txt", io.BytesIO(b"{}\n")), purpose="user_data")
    for kw, param in (
        ({"input_file_id": other.id, "endpoint": "/v1/chat/completions"}, "input_file_id"),
        ({"input_file_id": other.id, "endpoint": "/v1/messages"}, "endpoint"),
        (
            {"input_file_id": other.id, "endpoint": "/v1/chat/completions", "completion_window": "1h"},
            "completion_window",
        ),
    ):
        r = httpx.post(f"{state_srv.url}/v1/batches", json={"completion_window": "24h", **kw}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.fixture(scope="module")
def paced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, Path]]:
    """Two slots, no wait queue, 20 ms a token, a SQLite file: a batch that takes seconds beside clients."""
    spec = tmp_path_factory.mktemp("paced") / "state.sqlite3"
    s = start_server(*PACED, "--state-store", str(spec))
    yield s, spec
    s.stop()


PACED = (*STATE_ARGS[:2], "--max-num-seqs", "2", "--sim-decode-step-ms", "20")
LONG = {"max_tokens": 40, "ignore_eos": True, "thinking": {"type": "disabled"}}


def test_clients_never_get_a_429_because_of_a_batch(paced: tuple[Server, Path]) -> None:
    """Two slots, no queue: without the batch lane a client would get 429s while a batch holds both slots. Lines
    give their slot up to any client's request and run again later; every line still appears once."""
    srv, _ = paced
    b = submit(srv, chat_lines(24, **LONG))
    statuses: list[int] = []

    def client() -> None:
        for _ in range(8):
            r = httpx.post(
                f"{srv.url}/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                timeout=60,
            )
            statuses.append(r.status_code)
            time.sleep(0.1)

    time.sleep(1.0)  # the batch holds both slots by now
    assert srv.client().batches.retrieve(b.id).status == "in_progress"
    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert statuses == [200] * 16, statuses
    done = wait(srv, b.id)
    out, err = results(srv, done)
    assert done.status == "completed" and not err
    assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(24))


def test_a_cancelled_batch_stops_and_keeps_what_it_made(paced: tuple[Server, Path]) -> None:
    srv, _ = paced
    b = submit(srv, chat_lines(60, **LONG))
    deadline = time.monotonic() + 30
    while srv.client().batches.retrieve(b.id).request_counts.completed < 2:  # type: ignore[union-attr]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert srv.client().batches.cancel(b.id).status == "cancelling"
    done = wait(srv, b.id)
    assert done.status == "cancelled" and done.cancelled_at
    out, _ = results(srv, done)
    assert 2 <= len(out) < 60 and len({x["custom_id"] for x in out}) == len(out)


def test_a_batch_resumes_after_sigkill_with_each_line_once(tmp_path: Path) -> None:
    spec = tmp_path / "state.sqlite3"
    a = start_server(*PACED, "--state-store", str(spec))
    try:
        b = submit(a, chat_lines(30, **LONG))
        deadline = time.monotonic() + 30
        while a.client().batches.retrieve(b.id).request_counts.completed < 4:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
    finally:
        a.stop()
    c = start_server(*PACED, "--state-store", str(spec))
    try:
        done = wait(c, b.id, timeout=180)  # after the dead replica's lease runs out
        out, err = results(c, done)
        assert done.status == "completed" and not err
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(30))
    finally:
        c.stop()


def test_a_replica_finishes_the_batch_of_one_that_was_killed(pg_url: str) -> None:
    a, b = start_server(*PACED, "--state-store", pg_url), start_server(*PACED, "--state-store", pg_url)
    try:
        made = submit(a, chat_lines(30, **LONG))
        deadline = time.monotonic() + 30
        while b.client().batches.retrieve(made.id).request_counts.completed < 4:  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        a.proc.send_signal(signal.SIGKILL)
        a.proc.wait()
        done = wait(b, made.id, timeout=180)
        out, err = results(b, done)
        assert done.status == "completed" and not err
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(30))
    finally:
        a.stop()
        b.stop()
