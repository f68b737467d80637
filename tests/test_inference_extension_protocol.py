"""Conformance to the Gateway API Inference Extension's model-server protocol (docs/proposals/003-model-server-protocol
of kubernetes-sigs/gateway-api-inference-extension v1.6.0), against a running server: the metrics the endpoint picker
scrapes, with the names its default (vLLM) mapping reads in llm-d-router v0.10.0 (pkg/epp/.../extractor/metrics), their
types and their meaning; and the OpenAI Completions and Chat APIs, routed by the body's `model`.

| protocol name         | type  | metric this server exports    | meaning checked here                           |
|-----------------------|-------|-------------------------------|------------------------------------------------|
| TotalQueuedRequests   | gauge | vllm:num_requests_waiting     | admitted, not yet running: 0 with free slots   |
| TotalRunningRequests  | gauge | vllm:num_requests_running     | the requests being served right now            |
| KVCacheUtilization    | gauge | vllm:kv_cache_usage_perc      | a 0-1 fraction, growing with the tokens held   |

The picker reads one sample per family (the latest): each is one unlabelled series (besides `model_name`).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import httpx
import pytest
from conftest import MODEL, Server, start_server, wait_for
from prometheus_client.parser import text_string_to_metric_families

EPP_METRICS = {
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_running": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
}
SEQS = 4  # per rank


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server(
        "--dp", "2", "--max-num-seqs", str(SEQS), "--max-model-len", "8192", "--served-model-name", MODEL,
        "--sim-decode-step-ms", "20",
    )  # fmt: skip
    yield s
    s.stop()


def scrape(srv: Server) -> dict[str, tuple[str, list[tuple[dict[str, str], float]]]]:
    r = httpx.get(f"{srv.url}/metrics", timeout=5)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")  # Prometheus text format
    return {f.name: (f.type, [(s.labels, s.value) for s in f.samples]) for f in text_string_to_metric_families(r.text)}


def sample(srv: Server, name: str) -> float:
    kind, samples = scrape(srv)[name]
    assert kind == EPP_METRICS[name]
    assert len(samples) == 1, samples  # one series: the picker cannot mistake a rank's for the pod's
    labels, value = samples[0]
    assert labels == {"model_name": MODEL}
    return value


def hold_streams(srv: Server, n: int, prompt_words: int, stop: threading.Event) -> list[threading.Thread]:
    """`n` long streams that stay open until `stop`."""
    body = {
        "model": MODEL, "messages": [{"role": "user", "content": "word " * prompt_words}], "max_tokens": 2000,
        "ignore_eos": True, "stream": True, "thinking": {"type": "disabled"},
    }  # fmt: skip

    def hold() -> None:
        with (
            httpx.Client(timeout=60) as c,
            c.stream("POST", f"{srv.url}/v1/chat/completions", json=body) as r,
        ):
            assert r.status_code == 200
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    threads = [threading.Thread(target=hold) for _ in range(n)]
    for t in threads:
        t.start()
    return threads


def test_every_metric_the_endpoint_picker_scrapes_is_exported_with_its_type(srv: Server) -> None:
    families = scrape(srv)
    for name, kind in EPP_METRICS.items():
        assert name in families, name
        assert families[name][0] == kind, (name, families[name][0])
    assert sample(srv, "vllm:num_requests_running") == 0
    assert sample(srv, "vllm:num_requests_waiting") == 0
    assert sample(srv, "vllm:kv_cache_usage_perc") == 0


def test_running_queued_and_kv_use_mean_what_the_protocol_says(srv: Server) -> None:
    stop = threading.Event()
    threads = hold_streams(srv, 3, 1000, stop)
    try:
        wait_for("3 running requests", lambda: sample(srv, "vllm:num_requests_running") == 3)
        assert sample(srv, "vllm:num_requests_waiting") == 0  # free batch slots: nothing queues
        wait_for("KV use", lambda: sample(srv, "vllm:kv_cache_usage_perc") > 0)
        low = sample(srv, "vllm:kv_cache_usage_perc")
        threads += hold_streams(srv, 3, 1000, stop)
        wait_for("6 running requests", lambda: sample(srv, "vllm:num_requests_running") == 6)
        # KV use is a 0-1 fraction of the cache (the most-loaded rank's): more prompts held, more of it used
        wait_for("KV use to grow", lambda: sample(srv, "vllm:kv_cache_usage_perc") > low)
        high = sample(srv, "vllm:kv_cache_usage_perc")
        # the share of a rank's SEQS x --max-model-len token slots: at least one whole prompt (~2k tokens) on the
        # busiest rank, at most three prompts with all their output so far (a fraction, not a percentage)
        prompt = 2 * 1000 + 5
        assert prompt / (SEQS * 8192) <= low < high <= 3 * (prompt + 2000) / (SEQS * 8192), (low, high)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    wait_for("the gauges to return to 0", lambda: sample(srv, "vllm:num_requests_running") == 0)
    assert sample(srv, "vllm:kv_cache_usage_perc") == 0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_chat_and_completions_are_served_and_routed_by_model(srv: Server, path: str) -> None:
    body: dict[str, object] = {"model": MODEL, "max_tokens": 4, "ignore_eos": True}
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": "hello"}]
    else:
        body["prompt"] = "hello"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(path, json=body)
        assert r.status_code == 200, r.text
        got = r.json()
        assert got["object"] == ("chat.completion" if "chat" in path else "text_completion")
        assert got["model"] == MODEL and got["usage"]["completion_tokens"] == 4
        # the picker routes by `model`; a name the server does not serve is refused, not answered by another model
        r = c.post(path, json={**body, "model": "some-other-model"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # streamed too
        with c.stream("POST", path, json={**body, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            assert [line for line in s.iter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"
