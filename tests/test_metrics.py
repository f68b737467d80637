"""/metrics: Prometheus text with vLLM's names and correct types, and values that move as requests run."""

from __future__ import annotations

import threading
import time

import httpx
from conftest import MODEL, Server
from prometheus_client.parser import text_string_to_metric_families

EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "deepinfer_rejected_requests": "counter",
    "deepinfer_rank_requests": "gauge",
    "deepinfer_ring_used_bytes": "gauge",
    "deepinfer_rank_engine_requests": "gauge",
    "deepinfer_rank_heartbeat_age_seconds": "gauge",
}


def scrape(url: str) -> dict[str, dict]:
    r = httpx.get(f"{url}/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    out: dict[str, dict] = {}
    for fam in text_string_to_metric_families(r.text):
        out[fam.name] = {"type": fam.type, "samples": fam.samples}
    return out


def value(fams: dict, sample: str, **labels: str) -> float:
    name = sample
    for fam in fams.values():
        for s in fam["samples"]:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise KeyError(sample)


def test_metric_families_have_vllm_names_types_and_model_label(make_server) -> None:
    srv: Server = make_server("--dp", "2", "--sim-decode-step-ms", "2")
    fams = scrape(srv.url)
    for name, kind in EXPECTED_TYPES.items():
        assert name in fams, name
        assert fams[name]["type"] == kind, name
    assert value(fams, "vllm:num_requests_running", model_name=MODEL) == 0
    for rank in ("0", "1"):  # ranks report in at least once a second even when idle
        assert 0 <= value(fams, "deepinfer_rank_heartbeat_age_seconds", rank=rank) < 2.0
        assert value(fams, "deepinfer_rank_engine_requests", rank=rank) == 0


def test_values_move_as_requests_run(make_server) -> None:
    srv: Server = make_server("--dp", "2", "--max-num-seqs", "2", "--sim-decode-step-ms", "5")
    client = srv.client()
    before = scrape(srv.url)
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=20, extra_body={"ignore_eos": True}
    )
    after = scrape(srv.url)
    gen = "vllm:generation_tokens_total"
    assert value(after, gen, model_name=MODEL) - value(before, gen, model_name=MODEL) == 20
    prompt = "vllm:prompt_tokens_total"
    assert value(after, prompt, model_name=MODEL) - value(before, prompt, model_name=MODEL) == r.usage.prompt_tokens
    assert value(after, "vllm:request_success_total", model_name=MODEL, finished_reason="length") == 1
    assert value(after, "vllm:time_to_first_token_seconds_count", model_name=MODEL) == 1
    assert value(after, "vllm:inter_token_latency_seconds_count", model_name=MODEL) == 19
    assert value(after, "vllm:e2e_request_latency_seconds_count", model_name=MODEL) == 1

    # running requests show up while streams are open, and go back to 0 when they are dropped
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 3000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        streams = [c.send(c.build_request("POST", "/v1/chat/completions", json=body), stream=True) for _ in range(4)]
        time.sleep(0.2)
        during = scrape(srv.url)
        assert value(during, "vllm:num_requests_running", model_name=MODEL) == 4
        assert value(during, "vllm:kv_cache_usage_perc", model_name=MODEL) > 0
        r = c.post("/v1/chat/completions", json={**body, "stream": False})
        assert r.status_code == 429
        for s in streams:
            s.close()
    t0 = time.monotonic()
    while value(scrape(srv.url), "vllm:num_requests_running", model_name=MODEL) != 0:
        assert time.monotonic() - t0 < 1.0
        time.sleep(0.02)
    end = scrape(srv.url)
    assert value(end, "deepinfer_rejected_requests_total", reason="rate_limit_exceeded") == 1
    assert value(end, "deepinfer_aborted_requests_total", reason="client_disconnect") == 4


def test_health_answers_fast_while_saturated(make_server) -> None:
    srv: Server = make_server("--dp", "2", "--max-num-seqs", "32")
    stop = threading.Event()
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": 500,
        "ignore_eos": True,
        "stream": True,
    }

    def load() -> None:
        with httpx.Client(base_url=srv.url, timeout=30) as c:
            while not stop.is_set():
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for _ in r.iter_bytes():
                        pass

    threads = [threading.Thread(target=load) for _ in range(8)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    with httpx.Client(base_url=srv.url, timeout=5) as c:
        for _ in range(20):
            assert c.get("/health").status_code == 200
    stop.set()
    for t in threads:
        t.join(timeout=10)
