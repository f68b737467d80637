"""Anthropic's Message Batches (issue 31) through the `anthropic` SDK, on both stores: created, read while they
run, their results keyed by custom_id (succeeded or errored), cancelled, listed and deleted."""

from __future__ import annotations

import time
from typing import Any

import anthropic
import httpx
import pytest
from conftest import MODEL, Server


def client(srv: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)


def requests(n: int, **params: Any) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"m{i}",
            "params": {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": f"hi {i}"}], **params},
        }
        for i in range(n)
    ]


def wait(c: anthropic.Anthropic, bid: str, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while (b := c.messages.batches.retrieve(bid)).processing_status != "ended":
        assert time.monotonic() < deadline, b
        time.sleep(0.1)
    return b


def test_a_message_batch_runs_and_its_results_are_keyed_by_custom_id(state_srv: Server) -> None:
    c = client(state_srv)
    reqs = requests(12)
    reqs.append(
        {
            "custom_id": "bad",
            "params": {"model": "no-such-model", "max_tokens": 8, "messages": [{"role": "user", "content": "x"}]},
        }
    )
    b = c.messages.batches.create(requests=reqs)  # type: ignore[arg-type]
    assert b.id.startswith("msgbatch_") and b.processing_status == "in_progress" and b.type == "message_batch"
    done = wait(c, b.id)
    assert (done.request_counts.succeeded, done.request_counts.errored, done.request_counts.processing) == (12, 1, 0)
    assert done.ended_at is not None and done.results_url
    results = {r.custom_id: r.result for r in c.messages.batches.results(b.id)}
    assert sorted(results) == sorted([f"m{i}" for i in range(12)] + ["bad"])
    ok = results["m0"]
    assert ok.type == "succeeded" and ok.message.role == "assistant" and ok.message.content  # type: ignore[union-attr]
    assert results["bad"].type == "errored"
    assert b.id in [x.id for x in c.messages.batches.list(limit=100)]
    assert c.messages.batches.delete(b.id).id == b.id
    with pytest.raises(anthropic.NotFoundError):
        c.messages.batches.retrieve(b.id)


def test_bad_requests_are_a_400_in_anthropics_envelope(state_srv: Server) -> None:
    for body in (
        {"requests": []},
        {"requests": [{"custom_id": "a", "params": {}}] * 2},
        {"requests": [{"params": {}}]},
    ):
        r = httpx.post(f"{state_srv.url}/v1/messages/batches", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["type"] == "error", r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    # Anthropic's custom_id pattern, ^[a-zA-Z0-9_-]{1,64}$: a space, a dot, a slash, too long are refused
    for bad in ("a b", "a.b", "a/b", "é", "x" * 65):
        body = {"requests": [{"custom_id": bad, "params": {"model": MODEL, "max_tokens": 4, "messages": []}}]}
        r = httpx.post(f"{state_srv.url}/v1/messages/batches", json=body, timeout=30)
        assert r.status_code == 400 and "custom_id" in r.json()["error"]["message"], (bad, r.text)
    r = httpx.get(f"{state_srv.url}/v1/messages/batches/msgbatch_missing", timeout=30)
    assert r.status_code == 404 and r.json()["type"] == "error", r.text


def test_a_cancelled_message_batch_ends_with_its_requests_canceled(state_srv: Server) -> None:
    c = client(state_srv)
    b = c.messages.batches.create(requests=requests(400, max_tokens=64))  # type: ignore[arg-type]
    cancelled = c.messages.batches.cancel(b.id)
    assert cancelled.processing_status in ("canceling", "ended")
    done = wait(c, b.id)
    counts = done.request_counts
    # A fast engine may have run every line before the runner saw the cancel (it looks each second): then none is
    # canceled, but the counts and the results still agree line for line.
    assert counts.succeeded + counts.errored + counts.canceled == 400 and counts.processing == 0
    kinds = [r.result.type for r in c.messages.batches.results(b.id)]
    assert len(kinds) == 400 and kinds.count("canceled") == counts.canceled
    assert kinds.count("succeeded") == counts.succeeded


def test_each_api_lists_only_its_own_batches(state_srv: Server) -> None:
    c = client(state_srv)
    mine = c.messages.batches.create(requests=requests(1))  # type: ignore[arg-type]
    oai = state_srv.client()
    up = oai.files.create(
        file=(
            "in.jsonl",
            b'{"custom_id":"o","method":"POST","url":"/v1/chat/completions","body":{"model":"%s",'
            b'"max_tokens":4,"messages":[{"role":"user","content":"hi"}]}}\n' % MODEL.encode(),
        ),
        purpose="batch",
    )
    theirs = oai.batches.create(input_file_id=up.id, endpoint="/v1/chat/completions", completion_window="24h")
    listed = [x.id for x in c.messages.batches.list(limit=100)]
    assert mine.id in listed and all(i.startswith("msgbatch_") for i in listed), listed
    listed = [x.id for x in oai.batches.list(limit=100).data]
    assert theirs.id in listed and all(i.startswith("batch_") for i in listed), listed
    # a cursor from the other API names no batch of this one
    r = httpx.get(f"{state_srv.url}/v1/batches", params={"after": mine.id}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "after", r.text
    wait(c, mine.id)
