"""The control routes RL rollout frameworks drive (issue 42, points 3 and 4), over real HTTP with the openai SDK
and httpx against the sim: SGLang's `/abort_request`, `/pause_generation` and `/continue_generation`, vLLM's
`/pause`, `/resume` and `/is_paused`, and the weight version."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, start_server

# One rank, two slots, no wait queue: a third request past capacity would be a 429 were it not paused.
ARGS = ("--served-model-name", MODEL, "--dp", "1", "--max-num-seqs", "2", "--sim-decode-step-ms", "20")
LONG = {"max_tokens": 3000}
CHAT: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}]}
NO_THINKING = {"thinking": {"type": "disabled"}, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server(*ARGS)
    yield s
    s.stop()


@pytest.fixture
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        yield c
    c = httpx.Client(base_url=srv.url, timeout=30)
    c.post("/continue_generation")  # a failed test leaves the shared server running
    c.close()


class Stream:
    """A chat stream read on a thread: its chunks with when each came."""

    def __init__(self, srv: Server, rid: str, body: dict[str, Any] | None = None) -> None:
        self.chunks: list[tuple[float, dict[str, Any]]] = []
        self.first = threading.Event()
        self.ended = threading.Event()
        self.rid = rid
        client = srv.client(timeout=60)
        body = body or {**CHAT, **LONG}

        def read() -> None:
            stream = client.chat.completions.create(
                **body,
                stream=True,
                stream_options={"include_usage": True},
                extra_headers={"X-Request-Id": rid},
                extra_body=NO_THINKING,
            )
            for chunk in stream:
                self.chunks.append((time.monotonic(), chunk.model_dump()))
                if self.text():
                    self.first.set()
            self.ended.set()

        self.thread = threading.Thread(target=read, daemon=True)
        self.thread.start()

    def text(self) -> str:
        return "".join((c["choices"][0]["delta"].get("content") or "") for _, c in self.chunks if c["choices"])

    def finish_reason(self) -> str | None:
        reasons = [c["choices"][0]["finish_reason"] for _, c in self.chunks if c["choices"]]
        return next((r for r in reasons if r), None)

    def usage(self) -> dict[str, Any]:
        return next(c["usage"] for _, c in self.chunks if c.get("usage"))


def abort(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/abort_request", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_abort_by_rid_mid_stream_ends_it_with_abort_and_the_tokens_it_had(srv: Server, http: httpx.Client) -> None:
    s = Stream(srv, "rollout-7")
    assert s.first.wait(30)
    answer = abort(http, rid="rollout-7")
    assert answer["aborted"] == 1 and answer["success"] is True
    assert s.ended.wait(5), "the stream ends at once"
    assert s.finish_reason() == "abort"
    usage = s.usage()
    assert 0 < usage["completion_tokens"] < LONG["max_tokens"]
    assert s.text(), "the partial text it had"
    assert http.get("/get_load").json()["load"] == 0, "its slot is free"


def test_abort_ends_a_completions_request_with_its_partial_text(srv: Server, http: httpx.Client) -> None:
    client = srv.client(timeout=60)
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            client.completions.create,
            model=MODEL,
            prompt="Once upon a time",
            extra_headers={"X-Request-Id": "cmpl-rid"},
            extra_body={"ignore_eos": True},
            max_tokens=3000,
        )
        deadline = time.monotonic() + 30
        while http.get("/get_load").json()["load"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # some tokens
        assert abort(http, rid="cmpl-rid")["aborted"] == 1
        done = job.result(timeout=5)
    assert done.choices[0].finish_reason == "abort"
    assert done.choices[0].text and 0 < done.usage.completion_tokens < 3000


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/messages", {"model": MODEL, "max_tokens": 3000, "messages": [{"role": "user", "content": "Hi"}]}),
        ("/v1/responses", {"model": MODEL, "max_output_tokens": 3000, "input": "Hi"}),
    ],
)
def test_abort_ends_a_stream_on_the_other_doors(
    srv: Server, http: httpx.Client, path: str, body: dict[str, Any]
) -> None:
    rid = f"door-{path}"
    body = {**body, "stream": True, "ignore_eos": True}
    with (
        httpx.Client(base_url=srv.url, timeout=30) as c,
        c.stream("POST", path, json=body, headers={"X-Request-Id": rid}) as r,
    ):
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if "delta" in line:
                break
        t = time.monotonic()
        assert abort(http, rid=rid)["aborted"] == 1
        rest = list(lines)
        assert time.monotonic() - t < 5
    tail = "\n".join(rest)
    assert "message_stop" in tail or "response.incomplete" in tail, tail[-500:]


def test_abort_all_ends_every_clients_request(srv: Server, http: httpx.Client) -> None:
    streams = [Stream(srv, f"all-{i}") for i in range(2)]
    for s in streams:
        assert s.first.wait(30)
    assert abort(http, abort_all=True)["aborted"] == 2
    for s in streams:
        assert s.ended.wait(5) and s.finish_reason() == "abort"


def test_abort_by_rid_reaches_every_sample_of_a_generate_request_and_only_those(
    srv: Server, http: httpx.Client
) -> None:
    # `/generate` with n = 2 runs its samples as `RID_0` and `RID_1`; SGLang's abort of RID reaches both.
    params = {"max_new_tokens": 3000, "ignore_eos": True}
    body = {"text": "Tell me a story.", "rid": "gen-n", "sampling_params": {**params, "n": 2}}
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(http.post, "/generate", json=body)
        time.sleep(0.5)  # both samples are on the rank
        assert abort(http, rid="gen-n")["aborted"] == 2
        out = answer.result(timeout=10).json()
    assert [o["meta_info"]["id"] for o in out] == ["gen-n_0", "gen-n_1"]
    for o in out:
        assert o["meta_info"]["finish_reason"]["type"] == "abort" and 0 < o["meta_info"]["completion_tokens"] < 3000
    # A request whose id only starts with the same characters is another request, and keeps running.
    other = Stream(srv, "gen-n1")
    assert other.first.wait(30)
    assert abort(http, rid="gen-n")["aborted"] == 0 and not other.ended.is_set()
    assert abort(http, rid="gen-n1")["aborted"] == 1 and other.ended.wait(5)


def test_an_unknown_rid_is_a_clean_no_op_and_the_answer_says_so(http: httpx.Client) -> None:
    answer = abort(http, rid="nobody-has-this-id")
    assert answer["aborted"] == 0 and "nothing to abort" in answer["message"]
    r = http.post("/abort_request", json={})
    assert r.status_code == 400 and r.json()["error"]["param"] == "rid"
    r = http.post("/abort_request", json={"rid": 7})
    assert r.status_code == 400


def test_pause_in_place_freezes_running_requests_and_new_ones_wait_until_continue(
    srv: Server, http: httpx.Client
) -> None:
    running = Stream(srv, "frozen-1", {**CHAT, "max_tokens": 150})
    assert running.first.wait(30)
    r = http.post("/pause_generation", json={"mode": "in_place"})
    assert r.status_code == 200 and r.json()["status"] == "ok"
    time.sleep(0.5)  # what was already on its way out
    seen = len(running.chunks)
    client = srv.client(timeout=60)
    with ThreadPoolExecutor(3) as pool:
        # Three new requests on a server with two slots and no queue: paused, they wait (no 429, no 503).
        jobs = [
            pool.submit(client.chat.completions.create, **CHAT, max_tokens=5, extra_body=NO_THINKING) for _ in range(3)
        ]
        time.sleep(1.0)
        assert len(running.chunks) == seen, "frozen: no token while paused"
        assert not any(j.done() for j in jobs), [j.exception() for j in jobs if j.done()]
        assert http.get("/health").status_code == 200
        assert http.get("/is_paused").json() == {"is_paused": True}
        loads = http.get("/v1/loads").json()
        assert loads["paused"] is True and loads["loads"][0]["paused"] is True
        assert loads["loads"][0]["num_waiting_reqs"] == 3
        assert http.get("/get_load").json() == {"load": 4}, "the frozen request and the three waiting"
        r = http.post("/continue_generation")
        assert r.status_code == 200 and r.json()["status"] == "ok"
        for j in jobs:
            assert j.result(timeout=30).choices[0].finish_reason == "length"
    assert running.ended.wait(30) and running.finish_reason() == "length"
    assert running.usage()["completion_tokens"] == 150, "frozen, not lost: it went on where it stopped"


def test_pause_abort_ends_running_requests_and_new_ones_wait(srv: Server, http: httpx.Client) -> None:
    running = Stream(srv, "paused-abort")
    assert running.first.wait(30)
    r = http.post("/pause_generation", json={})  # SGLang's default mode: abort
    assert r.status_code == 200
    assert running.ended.wait(5) and running.finish_reason() == "abort"
    client = srv.client(timeout=60)
    with ThreadPoolExecutor(1) as pool:
        job = pool.submit(client.chat.completions.create, **CHAT, max_tokens=5, extra_body=NO_THINKING)
        time.sleep(0.5)
        assert not job.done()
        http.post("/continue_generation")
        assert job.result(timeout=30).choices[0].finish_reason == "length"
    r = http.post("/pause_generation", json={"mode": "sideways"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "mode"


def test_vllm_pause_resume_and_is_paused(srv: Server, http: httpx.Client) -> None:
    assert http.get("/is_paused").json() == {"is_paused": False}
    assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
    assert http.get("/is_paused").json() == {"is_paused": True}
    assert http.post("/resume").json() == {"status": "resumed"}
    assert http.get("/is_paused").json() == {"is_paused": False}
    # wait_for_inflight_requests: the answer comes once the running request has finished, and it finished whole.
    short = Stream(srv, "drained", {**CHAT, "max_tokens": 40})
    assert short.first.wait(30)
    r = http.post("/pause", params={"wait_for_inflight_requests": "true"})
    assert r.json() == {"status": "paused"}
    assert short.ended.wait(1) and short.finish_reason() == "length"
    http.post("/resume")
    # The default mode aborts.
    running = Stream(srv, "vllm-abort")
    assert running.first.wait(30)
    http.post("/pause")
    assert running.ended.wait(5) and running.finish_reason() == "abort"
    http.post("/resume")
    assert http.post("/pause", params={"mode": "nope"}).status_code == 400


def test_weight_version(srv: Server, http: httpx.Client) -> None:
    assert http.get("/get_weight_version").json() == {"weight_version": "default"}
    r = http.post("/update_weight_version", json={"new_version": "step-12", "abort_all_requests": False})
    assert r.status_code == 200 and r.json()["success"] is True
    assert http.get("/get_weight_version").json() == {"weight_version": "step-12"}
    assert http.get("/server_info").json()["weight_version"] == "step-12"
    assert http.post("/update_weight_version", json={"new_version": ""}).status_code == 400


def test_every_control_route_needs_the_api_key() -> None:
    s = start_server(*ARGS, "--api-key", "sekrit")
    try:
        routes = [
            ("POST", "/abort_request", {"abort_all": True}),
            ("POST", "/pause_generation", {"mode": "in_place"}),
            ("POST", "/continue_generation", None),
            ("POST", "/pause", None),
            ("POST", "/resume", None),
            ("GET", "/is_paused", None),
            ("GET", "/get_weight_version", None),
            ("POST", "/update_weight_version", {"new_version": "x"}),
        ]
        with httpx.Client(base_url=s.url, timeout=30) as c:
            for method, path, body in routes:
                r = c.request(method, path, json=body)
                assert r.status_code == 401, (path, r.text)
                keyed = c.request(method, path, json=body, headers={"Authorization": "Bearer sekrit"})
                assert keyed.status_code == 200, (path, keyed.text)
            assert c.get("/health").status_code == 200
    finally:
        s.stop()


def test_an_aborted_waiting_request_is_refused_in_its_doors_envelope(srv: Server, http: httpx.Client) -> None:
    http.post("/pause_generation", json={"mode": "in_place"})
    with httpx.Client(base_url=srv.url, timeout=30) as c, ThreadPoolExecutor(1) as pool:
        job = pool.submit(
            c.post, "/v1/chat/completions", json={**CHAT, "max_tokens": 5}, headers={"X-Request-Id": "queued-1"}
        )
        deadline = time.monotonic() + 10
        while http.get("/v1/loads").json()["loads"][0]["num_waiting_reqs"] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert abort(http, rid="queued-1")["aborted"] == 1
        r = job.result(timeout=5)
    http.post("/continue_generation")
    assert r.status_code == 400 and json.loads(r.text)["error"]["code"] == "request_aborted"


def test_a_frozen_request_can_be_aborted(srv: Server, http: httpx.Client) -> None:
    s = Stream(srv, "frozen-then-aborted")
    assert s.first.wait(30)
    http.post("/pause_generation", json={"mode": "in_place"})
    t = time.monotonic()
    assert abort(http, rid="frozen-then-aborted")["aborted"] == 1
    assert s.ended.wait(10) and s.finish_reason() == "abort"
    # When its last chunk came (the wire check of the whole stream, on the client's side, comes after).
    assert s.chunks[-1][0] - t < 1, "ended at once, paused or not"
    http.post("/continue_generation")
    assert http.get("/get_load").json() == {"load": 0}


def test_sigterm_ends_a_pause_and_the_drain_lets_its_requests_finish() -> None:
    s = start_server(*ARGS)
    try:
        running = Stream(s, "drained-on-sigterm", {**CHAT, "max_tokens": 60})
        assert running.first.wait(30)
        assert httpx.post(f"{s.url}/pause_generation", json={"mode": "in_place"}).status_code == 200
        time.sleep(0.3)
        code = s.stop()  # SIGTERM: the drain resumes generation and waits for the frozen request
        assert running.ended.wait(10) and running.finish_reason() == "length"
        assert code == 0, s.log()[-2000:]
    finally:
        s.stop()
