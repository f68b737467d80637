"""The lanes are fair (issue 39, point 4), over HTTP on the paced sim: batches share the batch lane's slots
round-robin, so a 1-line batch created behind a long batch starts as soon as one line's slot frees (OpenAI's
batches and Anthropic's message batches alike); background responses are capped per owner (API key) and in all,
with a 429 of their own, and a run that ends frees its place at once."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
from conftest import MODEL, Server

DONE = ("completed", "failed", "cancelled", "expired")
# 20 ms a decode step: a line of 50 tokens takes about 1 s.
PACED = ("--served-model-name", MODEL, "--state-store", "memory", "--sim-decode-step-ms", "20")


def line(i: int, tokens: int) -> dict[str, Any]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"line {i}"}], "max_tokens": tokens}
    return {"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": {**body, "ignore_eos": True}}


def submit(c: httpx.Client, lines: list[dict[str, Any]]) -> str:
    text = "\n".join(json.dumps(x) for x in lines).encode()
    f = c.post("/v1/files", files={"file": ("in.jsonl", io.BytesIO(text))}, data={"purpose": "batch"})
    body = {"input_file_id": f.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    return str(c.post("/v1/batches", json=body).json()["id"])


def until(c: httpx.Client, bid: str, states: tuple[str, ...], timeout: float = 120) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (b := c.get(f"/v1/batches/{bid}").json())["status"] not in states:
        assert time.monotonic() < deadline, b
        time.sleep(0.05)
    return b


def test_a_one_line_batch_behind_a_long_batch_starts_within_a_lines_time(make_server: Any) -> None:
    """4 slots; a batch of 48 lines of 1 s takes 12 s alone. A 1-line batch and a 1-request message batch created
    while it runs each end within a few seconds (first come, first served, they would wait for all 48 lines)."""
    s: Server = make_server(*PACED, "--max-num-seqs", "4")
    ac = anthropic.Anthropic(base_url=s.url, api_key="unused", max_retries=0)
    with httpx.Client(base_url=s.url, timeout=30) as c:
        big = submit(c, [line(i, 50) for i in range(48)])
        until(c, big, ("in_progress",))
        time.sleep(1.5)  # its first lines hold every slot
        t = time.monotonic()
        small = submit(c, [line(0, 5)])
        params = {"model": MODEL, "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}
        msg = ac.messages.batches.create(requests=[{"custom_id": "m0", "params": params}])  # type: ignore[list-item]
        done = until(c, small, DONE)
        small_s = time.monotonic() - t
        while ac.messages.batches.retrieve(msg.id).processing_status != "ended":
            assert time.monotonic() - t < 60
            time.sleep(0.05)
        msg_s = time.monotonic() - t
        left = c.get(f"/v1/batches/{big}").json()
        assert done["status"] == "completed" and done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
        assert [r.result.type for r in ac.messages.batches.results(msg.id)] == ["succeeded"]
        # A line of the big batch takes 1 s, the small ones' 0.1 s; a second for the runner's record of the counts.
        assert small_s < 6 and msg_s < 6, (small_s, msg_s)
        assert left["status"] == "in_progress" and left["request_counts"]["completed"] < 40, left
        assert until(c, big, DONE)["request_counts"] == {"total": 48, "completed": 48, "failed": 0}


def post(s: Server, key: str = "", tokens: int = 2000) -> httpx.Response:
    body = {"model": MODEL, "input": "Go on.", "max_output_tokens": tokens, "background": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(f"{s.url}/v1/responses", json=body, headers=headers, timeout=30)


def refused(r: httpx.Response, code: str) -> None:
    assert r.status_code == 429, r.text
    assert r.json()["error"]["type"] == "rate_limit_error" and r.json()["error"]["code"] == code, r.text
    assert r.headers["retry-after"].isdigit()


def test_background_runs_are_capped_per_api_key_and_in_all(make_server: Any, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("key-a\nkey-b\n")
    flags = ("--max-num-seqs", "1", "--max-background-runs", "6", "--max-background-runs-per-owner", "4")
    s: Server = make_server(*PACED, *flags, "--api-key-file", str(keys))
    a = [post(s, "key-a") for _ in range(4)]
    assert [r.status_code for r in a] == [200] * 4
    refused(post(s, "key-a"), "background_runs_per_owner_exceeded")
    # Key A's cap is its own: key B is taken, up to the bound on all runs.
    assert [post(s, "key-b").status_code for _ in range(2)] == [200, 200]
    full = post(s, "key-b")
    refused(full, "background_queue_full")
    assert "background" in full.json()["error"]["message"]
    # A cancelled run frees its place at once.
    h = {"Authorization": "Bearer key-a"}
    cancelled = httpx.post(f"{s.url}/v1/responses/{a[0].json()['id']}/cancel", headers=h, timeout=30)
    assert cancelled.json()["status"] == "cancelled"
    assert post(s, "key-b").status_code == 200


def test_a_run_that_ends_frees_its_place_at_once(make_server: Any) -> None:
    """One run at most: the next is refused while it runs, and taken the moment the first reads as ended. Without
    API keys everyone is one owner, whose cap is the bound on all runs (not the lower per-owner cap)."""
    s: Server = make_server(*PACED, "--max-background-runs", "1", "--max-background-runs-per-owner", "1")
    for _ in range(3):
        first = post(s, tokens=40)  # about 0.8 s
        assert first.status_code == 200, first.text
        refused(post(s), "background_queue_full")
        rid = first.json()["id"]
        deadline = time.monotonic() + 30
        while httpx.get(f"{s.url}/v1/responses/{rid}", timeout=30).json()["status"] in ("queued", "in_progress"):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        again = post(s, tokens=4)
        assert again.status_code == 200, again.text
        done = again.json()["id"]
        while httpx.get(f"{s.url}/v1/responses/{done}", timeout=30).json()["status"] in ("queued", "in_progress"):
            time.sleep(0.02)
    s2: Server = make_server(*PACED, "--max-background-runs", "2", "--max-background-runs-per-owner", "1")
    assert [post(s2).status_code for _ in range(2)] == [200, 200]
    refused(post(s2), "background_queue_full")


def test_a_runs_kept_stream_is_bounded_and_says_so(make_server: Any) -> None:
    """A budget of 1 MiB for 16 runs keeps each run's last 64 KiB: the start of a long run's stream is gone, and a
    replay from there is a clear 400, while its end and the stored Response are whole."""
    flags = ("--max-background-runs", "16", "--background-replay-bytes", str(1 << 20))
    s: Server = make_server(*PACED[:4], "--sim-decode-step-ms", "0", *flags)
    rid = post(s, tokens=3000).json()["id"]
    while (r := httpx.get(f"{s.url}/v1/responses/{rid}", timeout=30).json())["status"] in ("queued", "in_progress"):
        time.sleep(0.05)
    assert r["status"] == "incomplete" and r["usage"]["output_tokens"] == 3000  # it ran to max_output_tokens
    old = httpx.get(f"{s.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": "0"}, timeout=30)
    assert old.status_code == 400 and old.json()["error"]["param"] == "starting_after", old.text
    kept_from = int(old.json()["error"]["message"].split("sequence number ")[1].split()[0])
    tail = httpx.get(
        f"{s.url}/v1/responses/{rid}", params={"stream": "true", "starting_after": str(kept_from)}, timeout=30
    )
    assert tail.status_code == 200 and len(tail.content) <= 64 << 10
    assert tail.text.startswith("event: ") and "event: response.incomplete" in tail.text
