"""The worker metadata gateways read (smg, vllm-router, sglang-router), over real HTTP against a running server:
/version, /v1/loads and /loads, /get_load, /server_info and /model_info (and their get_* aliases), and
POST /v1/chat/completions/render. The shapes follow the gateways' own parsers (see rust/http/worker.rs)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import httpx
import pytest
from conftest import MODEL, Server, start_server

import deepinfer_server

CHAT = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me about the sea."}],
    "thinking": {"type": "disabled"},
}
LONG = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}


def hold_streams(srv: Server, n: int) -> tuple[list[threading.Thread], threading.Event]:
    """Start `n` long streams and wait until each has produced a token; they run until `stop` is set."""
    stop, started = threading.Event(), threading.Semaphore(0)

    def one() -> None:
        with (
            httpx.Client(base_url=srv.url, timeout=60) as c,
            c.stream("POST", "/v1/chat/completions", json=LONG) as r,
        ):
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: a dropped iterator closes the response
            for line in lines:
                if '"content":"' in line and '"content":""' not in line:
                    started.release()
                    break
            stop.wait(30)  # the stream is closed (and aborted) on exit

    threads = [threading.Thread(target=one, daemon=True) for _ in range(n)]
    for t in threads:
        t.start()
    for _ in range(n):
        assert started.acquire(timeout=20)
    return threads, stop


def wait_for(pred: Callable[[], bool], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


@pytest.fixture(scope="module")
def busy_server() -> Iterator[Server]:
    srv = start_server(
        "--served-model-name", MODEL, "--dp", "2", "--max-num-seqs", "2", "--max-model-len", "4096",
        "--sim-decode-step-ms", "10",
    )  # fmt: skip
    yield srv
    srv.stop()


def test_version(busy_server: Server) -> None:
    r = httpx.get(f"{busy_server.url}/version")
    assert r.status_code == 200 and r.json() == {"version": deepinfer_server.__version__}


def test_loads_per_rank_follow_the_running_requests(busy_server: Server) -> None:
    url = busy_server.url
    idle = httpx.get(f"{url}/v1/loads").json()
    assert idle["dp_rank_count"] == 2 and [e["dp_rank"] for e in idle["loads"]] == [0, 1]
    for e in idle["loads"]:
        assert (e["num_running_reqs"], e["num_waiting_reqs"], e["num_total_reqs"]) == (0, 0, 0)
        assert e["max_total_num_tokens"] == 2 * 4096  # the sim's KV: max-num-seqs x max-model-len slots
        assert e["max_running_requests"] == 2
    assert httpx.get(f"{url}/get_load").json() == {"load": 0}

    threads, stop = hold_streams(busy_server, 3)
    try:
        busy = httpx.get(f"{url}/v1/loads").json()
        per_rank = sorted(e["num_total_reqs"] for e in busy["loads"])
        assert per_rank == [1, 2], busy  # least-loaded dispatch spreads 3 requests 2 + 1
        assert sum(e["num_running_reqs"] for e in busy["loads"]) == 3
        wait_for(lambda: all(e["token_usage"] > 0 for e in httpx.get(f"{url}/v1/loads").json()["loads"]))
        for e in httpx.get(f"{url}/v1/loads").json()["loads"]:
            assert 0 < e["num_used_tokens"] <= e["max_total_num_tokens"]
            assert e["num_used_tokens"] == round(e["token_usage"] * e["max_total_num_tokens"])
        assert httpx.get(f"{url}/get_load").json() == {"load": 3}
        # SGLang's other spelling, as smg asks for it, filtered by a served model
        alias = httpx.get(f"{url}/loads", params={"model": MODEL, "include": "core,queues"}).json()
        assert sorted(e["num_total_reqs"] for e in alias["loads"]) == [1, 2]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    wait_for(lambda: httpx.get(f"{url}/get_load").json() == {"load": 0})
    r = httpx.get(f"{url}/v1/loads", params={"model": "nope"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_server_and_model_info_and_their_aliases(busy_server: Server) -> None:
    url = busy_server.url
    for path in ("/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        info = httpx.get(f"{url}{path}").json()
        assert info["served_model_name"] == MODEL and info["served_model_names"] == [MODEL]
        assert info["model_path"] == MODEL  # no MODEL directory: the served name
        assert (info["max_running_requests"], info["context_length"], info["dp_size"]) == (4, 4096, 2)
        assert info["version"] == deepinfer_server.__version__
    server = httpx.get(f"{url}/server_info").json()
    assert (server["engine"], server["max_num_seqs"], server["max_total_tokens"]) == ("sim", 2, 2 * 2 * 4096)
    model = httpx.get(f"{url}/model_info").json()
    assert model["is_generation"] is True and model["has_image_understanding"] is True


def test_render_gives_the_prompt_ids_a_chat_request_runs_with(busy_server: Server) -> None:
    url = busy_server.url
    r = httpx.post(f"{url}/v1/chat/completions/render", json={**CHAT, "max_tokens": 7}, headers={"x-request-id": "r1"})
    assert r.status_code == 200, r.text
    rendered = r.json()
    ids = rendered["token_ids"]
    assert ids and all(isinstance(t, int) for t in ids)
    assert rendered["request_id"] == "r1" and rendered["model"] == MODEL and rendered["stream"] is False
    assert rendered["sampling_params"]["max_tokens"] == 7
    # the same body, run for real, has exactly that many prompt tokens
    done = httpx.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 7}, timeout=30).json()
    assert done["usage"]["prompt_tokens"] == len(ids)
    # thinking changes the rendered prompt (the template's thinking marker), and so does the conversation
    thinking = httpx.post(f"{url}/v1/chat/completions/render", json={**CHAT, "thinking": {"type": "enabled"}}).json()
    assert thinking["token_ids"] != ids
    longer = {**CHAT, "messages": [*CHAT["messages"], {"role": "assistant", "content": "It is wide."},
                                   {"role": "user", "content": "And deep?"}]}  # fmt: skip
    assert len(httpx.post(f"{url}/v1/chat/completions/render", json=longer).json()["token_ids"]) > len(ids)
    # refusals are the chat route's, in the OpenAI envelope
    for body, status, code in [
        ({**CHAT, "model": "nope"}, 404, "model_not_found"),
        ({"model": MODEL, "messages": []}, 400, "invalid_request_error"),
        ({**CHAT, "n": 3}, 400, "invalid_request_error"),
    ]:
        r = httpx.post(f"{url}/v1/chat/completions/render", json=body)
        assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert httpx.get(f"{url}/get_load").json() == {"load": 0}, "rendering takes no slot"


def test_render_reports_the_priority_the_request_sent(busy_server: Server) -> None:
    """vLLM's render echoes the request's `priority` (its extension, on every door), 0 when it sent none."""
    url = f"{busy_server.url}/v1/chat/completions/render"
    assert httpx.post(url, json={**CHAT, "priority": -3}).json()["priority"] == -3
    assert httpx.post(url, json=CHAT).json()["priority"] == 0


def test_api_key_guards_the_metadata_but_not_version_and_get_load(make_server) -> None:
    srv = make_server("--api-key", "sekret")
    ok = {"Authorization": "Bearer sekret"}
    for path in ("/version", "/get_load", "/health", "/metrics"):
        assert httpx.get(f"{srv.url}{path}").status_code == 200, path
    for path in ("/v1/loads", "/loads", "/server_info", "/get_server_info", "/model_info", "/get_model_info"):
        r = httpx.get(f"{srv.url}{path}")
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", path
        assert httpx.get(f"{srv.url}{path}", headers=ok).status_code == 200, path
    render = f"{srv.url}/v1/chat/completions/render"
    assert httpx.post(render, json=CHAT).status_code == 401
    assert httpx.post(render, json=CHAT, headers=ok).status_code == 200


def test_openapi_lists_the_worker_routes(busy_server: Server) -> None:
    doc = httpx.get(f"{busy_server.url}/openapi.json").json()
    for path in ("/version", "/v1/loads", "/loads", "/get_load", "/server_info", "/get_server_info"):
        assert "get" in doc["paths"][path], path
    assert "post" in doc["paths"]["/v1/chat/completions/render"]
