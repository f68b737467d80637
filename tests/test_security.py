"""API key, request ids, structured logs, and special-token spellings typed by users."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import MODEL, Server

MSG = [{"role": "user", "content": "hi"}]


def test_api_key_guards_the_api_but_not_health(make_server) -> None:
    srv: Server = make_server("--api-key", "s3cret-key")
    with httpx.Client(base_url=srv.url) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/metrics").status_code == 200
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "s3cret-key"},
            {"Authorization": "Bearer s3cret-ke"},
            {"Authorization": "Bearer s3cret-key2"},
        ):
            r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG}, headers=headers)
            assert r.status_code == 401, headers
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert c.get("/v1/models", headers=headers).status_code == 401
    with pytest.raises(openai.AuthenticationError):
        srv.client().chat.completions.create(model=MODEL, messages=MSG)
    ok = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="s3cret-key", max_retries=0)
    assert ok.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3).usage.completion_tokens >= 1


def test_api_key_from_the_environment(make_server) -> None:
    srv: Server = make_server(env={"DEEPINFER_SERVER_API_KEY": "from-env"})
    assert httpx.get(f"{srv.url}/v1/models").status_code == 401
    assert httpx.get(f"{srv.url}/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200


def test_request_id_is_echoed_or_generated(http: httpx.Client) -> None:
    r = http.post(
        "/v1/chat/completions",
        json={"model": MODEL, "messages": MSG, "max_tokens": 2},
        headers={"X-Request-Id": "my-trace-42"},
    )
    assert r.headers["x-request-id"] == "my-trace-42"
    r = http.post("/v1/chat/completions", json={"model": "nope", "messages": MSG})
    assert r.status_code == 404 and r.headers["x-request-id"].startswith("req-")
    bad = "x" * 500
    r = http.get("/health", headers={"X-Request-Id": bad})
    assert r.headers["x-request-id"] != bad


def test_json_request_logs(make_server) -> None:
    srv: Server = make_server("--log-format", "json")
    srv.client().chat.completions.create(
        model=MODEL,
        messages=MSG,
        max_tokens=4,
        extra_body={"ignore_eos": True},
        extra_headers={"X-Request-Id": "log-me"},
    )
    httpx.post(
        f"{srv.url}/v1/chat/completions", json={"model": "nope", "messages": MSG}, headers={"X-Request-Id": "refused-1"}
    )
    srv.stop()
    records = []
    for line in srv.log().splitlines():
        if line.startswith('{"timestamp"'):
            records.append(json.loads(line))
    done = [r for r in records if r.get("fields", {}).get("request_id") == "log-me"]
    assert done, srv.log()
    f = done[-1]["fields"]
    assert f["status"] == 200 and f["reason"] == "length" and f["output_tokens"] == 4
    assert f["prompt_tokens"] > 0 and f["ttft_ms"] >= 0 and f["rank"] == 0
    refused = [r for r in records if r.get("fields", {}).get("request_id") == "refused-1"]
    assert refused and refused[-1]["fields"]["status"] == 404


@pytest.mark.parametrize("spelling", ["<｜end▁of▁sentence｜>", "</think>", "<｜User｜>", "<｜Assistant｜>"])
def test_special_token_spellings_stay_plain_text(server: Server, spelling: str) -> None:
    client = server.client()
    plain = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=1,
        extra_body={"thinking": {"type": "disabled"}},
    ).usage.prompt_tokens
    typed = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x" + spelling}],
        max_tokens=5,
        extra_body={"thinking": {"type": "disabled"}},
    )
    # As a special token the spelling would add exactly one prompt token; as text it is several byte-level ones.
    assert typed.usage.prompt_tokens - plain > 1
    assert typed.choices[0].finish_reason in ("stop", "length")
