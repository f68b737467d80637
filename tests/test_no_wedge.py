"""One request never wedges a replica (issue 39, point 1).

Requests that ask for different numbers of logprob alternatives, side by side and as batch lines, all get their
answers, each token with as many alternatives as its request asked for (the output thread once merged steps with
different counts and died, leaving /health at 200 in front of a dead pipeline). And a panic in any server thread,
caused here through the server's fail points, ends the process with /health 503 first, never a live socket in
front of a dead pipeline."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from state_servers import STATE_ARGS

NO_THINK = {"thinking": {"type": "disabled"}}
DONE = ("completed", "failed", "cancelled", "expired")


@pytest.fixture(scope="module")
def srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """DP 2 with a store, so that the same mixes run as batch lines."""
    state = tmp_path_factory.mktemp("wedge")
    s = start_server(*STATE_ARGS, "--dp", "2", "--state-store", str(state / "state.sqlite3"))
    yield s
    s.stop()


def chat_body(i: int, top: int | None, tokens: int = 50, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Tell me about item {i}."}],
        "max_tokens": tokens,
        "ignore_eos": True,
        "seed": i,
        **NO_THINK,
        **extra,
    }
    if top is not None:
        body |= {"logprobs": True, "top_logprobs": top}
    return body


def check_chat(d: dict[str, Any], top: int | None, n: int = 1) -> None:
    """n choices, numbered; every generated token has its entry, each with exactly the alternatives its request
    asked for."""
    choices = d["choices"]
    assert [c.get("index", 0) for c in choices] == list(range(n)), choices
    if top is None:
        assert all(c.get("logprobs") is None for c in choices)
        return
    entries = [e for c in choices for e in c["logprobs"]["content"]]
    assert len(entries) == d["usage"]["completion_tokens"]
    assert all(len(e["top_logprobs"]) == top for e in entries), [len(e["top_logprobs"]) for e in entries]


def stream_chat(http: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """A stream gathered into the shape of a non-stream answer (each choice's content logprobs, and usage)."""
    entries: dict[int, list[Any]] = {}
    usage: dict[str, Any] = {}
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                entries.setdefault(c["index"], []).extend((c.get("logprobs") or {}).get("content") or [])
    return {
        "choices": [
            {"index": i, "logprobs": {"content": e} if body.get("logprobs") else None}
            for i, e in sorted(entries.items())
        ],
        "usage": usage,
    }


# One request of a random mix: its door, stream or not, and what it asks for.
REQUEST = st.fixed_dictionaries(
    {
        "door": st.sampled_from(["chat", "completions"]),
        "stream": st.booleans(),
        "top": st.one_of(st.none(), st.integers(0, 20)),
        "prompt_logprobs": st.one_of(st.none(), st.just(True), st.integers(0, 20)),
        "n": st.sampled_from([1, 1, 1, 2]),
        "tokens": st.integers(1, 40),
    }
)


def send(http: httpx.Client, i: int, spec: dict[str, Any]) -> None:
    """Send one request of the mix and check its answer: a 200 with its logprobs whole, or the 400 it must be."""
    top, n = spec["top"], spec["n"]
    if spec["door"] == "chat":
        body = chat_body(i, top, tokens=spec["tokens"], n=n)
        path = "/v1/chat/completions"
    else:
        body = {"model": MODEL, "prompt": f"Item {i}:", "max_tokens": spec["tokens"], "ignore_eos": True, "n": n}
        if top is not None:
            body["logprobs"] = min(top, 5)
        path = "/v1/completions"
    if spec["prompt_logprobs"] is not None:
        body["prompt_logprobs"] = spec["prompt_logprobs"]
    if spec["door"] == "chat" and spec["stream"]:
        if spec["prompt_logprobs"] is not None:  # refused on a stream, as vLLM does
            r = http.post(path, json={**body, "stream": True})
            assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
            return
        check_chat(stream_chat(http, body), top, n)
        return
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    d = r.json()
    if spec["door"] == "chat":
        check_chat(d, top, n)
    elif top is not None:
        assert len(d["choices"]) == n
        assert sum(len(c["logprobs"]["tokens"]) for c in d["choices"]) == d["usage"]["completion_tokens"]


def batch_line(i: int, spec: dict[str, Any]) -> dict[str, Any]:
    body = chat_body(1000 + i, spec["top"], tokens=spec["tokens"])
    if spec["prompt_logprobs"] is not None:
        body["prompt_logprobs"] = spec["prompt_logprobs"]
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def test_any_mix_of_logprob_requests_and_batch_lines_is_answered(srv: Server) -> None:
    """Random mixes of logprobs, top_logprobs, n and prompt_logprobs, side by side and as batch lines."""

    @settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(mix=st.lists(REQUEST, min_size=4, max_size=12), lines=st.lists(REQUEST, min_size=1, max_size=6))
    def mix_is_answered(mix: list[dict[str, Any]], lines: list[dict[str, Any]]) -> None:
        run_mix(srv, mix, lines)

    mix_is_answered()


def run_mix(srv: Server, mix: list[dict[str, Any]], lines: list[dict[str, Any]]) -> None:
    c = srv.client()
    data = "\n".join(json.dumps(batch_line(i, s)) for i, s in enumerate(lines)).encode()
    f = c.files.create(file=("mix.jsonl", io.BytesIO(data)), purpose="batch")
    batch = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    with httpx.Client(base_url=srv.url, timeout=60) as http, ThreadPoolExecutor(len(mix)) as pool:
        list(pool.map(lambda a: send(http, *a), enumerate(mix)))
    deadline = time.monotonic() + 90
    while (b := c.batches.retrieve(batch.id)).status not in DONE:
        assert time.monotonic() < deadline, f"batch still {b.status}: {b.request_counts}"
        time.sleep(0.1)
    assert b.status == "completed" and b.output_file_id, b
    out = [json.loads(x) for x in c.files.content(b.output_file_id).text.splitlines()]
    assert sorted(o["custom_id"] for o in out) == sorted(f"c{i}" for i in range(len(lines)))
    for o in out:
        spec = lines[int(o["custom_id"][1:])]
        assert o["response"]["status_code"] == 200, o
        check_chat(o["response"]["body"], spec["top"])
    assert httpx.get(f"{srv.url}/health").status_code == 200


def watch_health(url: str, stop: threading.Event, seen: list[int]) -> None:
    """Poll /health until the process is gone, recording each status (0 for a refused connection)."""
    while not stop.is_set():
        try:
            seen.append(httpx.get(f"{url}/health", timeout=2).status_code)
        except httpx.HTTPError:
            seen.append(0)
        time.sleep(0.05)


@pytest.mark.parametrize("point", ["rank-out", "http"])
def test_a_panic_in_a_server_thread_ends_the_process_with_health_503_first(point: str) -> None:
    s = start_server(
        "--served-model-name",
        MODEL,
        "--exit-on-rank-failure",
        "1",
        env={"DEEPINFER_SERVER_FAIL_POINT": point},
    )
    ranks = s.rank_pids()
    assert ranks
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        stop, seen = threading.Event(), []  # type: ignore[var-annotated]
        watcher = threading.Thread(target=watch_health, args=(s.url, stop, seen), daemon=True)
        watcher.start()
        started = time.monotonic()
        try:
            r = httpx.post(f"{s.url}/v1/chat/completions", json=chat_body(1, None, tokens=20), timeout=30)
            # The output thread died: the request ends with the 503 the cleanup gives it, not never.
            assert r.status_code == 503, r.text
            assert "internal error" in r.json()["error"]["message"]
        except httpx.RemoteProtocolError:
            assert point == "http"  # the handler's task died with its connection: the client is told at once
        assert time.monotonic() - started < 10
        code = s.proc.wait(timeout=15)
        stop.set()
        watcher.join()
        assert code == 70, s.log()
        assert 503 in seen, seen  # health said so before the socket went
        assert seen.index(503) < len(seen) - 1 or seen[-1] == 503
        assert "panicked" in s.log() and f"fail point: {point}" in s.log()
        for pid in ranks:  # the ranks went with it
            deadline = time.monotonic() + 10
            while _alive(pid):
                assert time.monotonic() < deadline, f"rank {pid} outlived the server"
                time.sleep(0.1)
    finally:
        s.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:  # a zombie the reaper has yet to collect is gone for our purpose
            return f.read().split(") ")[-1][:1] != "Z"
    except FileNotFoundError:
        return False
