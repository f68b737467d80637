"""Bad input gets a clear 4xx in the OpenAI error envelope, before any SSE byte, and nothing in flight is lost."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import MODEL, Server

MSG = [{"role": "user", "content": "hi"}]


def envelope(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    for needle in ("Traceback", "/work/", "site-packages", '.py"', "panicked"):
        assert needle not in err["message"]
    return err


BAD_SCHEMA = {
    "type": "json_schema",
    "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "nope"}}}},
}
LOOKBEHIND = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(?<=a)b"}}}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
UNKNOWN_TOOL = {"type": "function", "function": {"name": "not_a_tool"}}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"messages": MSG}, 400, "model"),
        ({"model": "nope", "messages": MSG}, 404, "model"),
        ({"model": MODEL}, 400, "messages"),
        ({"model": MODEL, "messages": []}, 400, "messages"),
        ({"model": MODEL, "messages": MSG, "n": 0}, 400, "n"),
        ({"model": MODEL, "messages": MSG, "n": 129}, 400, "n"),
        ({"model": MODEL, "messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
        ({"model": MODEL, "messages": MSG, "response_format": {"type": "json_object"}}, 400, "response_format"),
        ({"model": MODEL, "messages": MSG, "tool_choice": "required"}, 400, "tool_choice"),
        # Structured output and forced tools: a malformed schema, one the engine's grammar cannot enforce (a
        # look-behind), a malformed regex, an unknown tool name, top_logprobs without logprobs.
        ({"model": MODEL, "messages": MSG, "response_format": BAD_SCHEMA}, 400, "response_format"),
        ({"model": MODEL, "messages": MSG, "response_format": LOOKBEHIND}, 400, "response_format"),
        (
            {"model": MODEL, "messages": MSG, "response_format": {"type": "regex", "regex": "[0-9"}},
            400,
            "response_format",
        ),
        (
            {"model": MODEL, "messages": MSG, "response_format": {"type": "json_schema"}},
            400,
            "response_format.json_schema",
        ),
        ({"model": MODEL, "messages": MSG, "tools": TOOLS, "tool_choice": UNKNOWN_TOOL}, 400, "tool_choice"),
        ({"model": MODEL, "messages": MSG, "top_logprobs": 2}, 400, "top_logprobs"),
        ({"model": MODEL, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "messages": MSG, "temperature": 7}, 400, None),
        ({"model": MODEL, "messages": MSG, "temperature": "hot"}, 400, None),
        ({"model": MODEL, "messages": MSG, "presence_penalty": 3}, 400, None),
        ({"model": MODEL, "messages": MSG, "frequency_penalty": -2.5}, 400, None),
        ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
        ({"model": MODEL, "messages": [{"role": "tool", "content": "x", "tool_call_id": "a"}]}, 400, None),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}],
            },
            400,
            "messages[0].content[0].type",
        ),
        (
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://127.0.0.1/y.png"}}]}
                ],
            },
            400,
            "messages[0].content[0].image_url.url",
        ),
    ],
)
def test_bad_requests(http: httpx.Client, body: dict, status: int, param: str | None, stream: bool) -> None:
    if stream:
        body = {**body, "stream": True}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == status, r.text
    err = envelope(r)
    if param:
        assert err["param"] == param


def test_sampler_controls_deepinfer_lacks_are_accepted_and_ignored(http: httpx.Client) -> None:
    """As DeepSeek's own API does (README): the answer is the one the same seed gives without them."""
    base = {"model": MODEL, "messages": MSG, "max_tokens": 12, "seed": 5, "thinking": {"type": "disabled"}}
    ignored = {
        "presence_penalty": 1.5,
        "frequency_penalty": -1,
        "repetition_penalty": 1.2,
        "min_p": 0.1,
        "logit_bias": {"5": 10},
        "user": "u-1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
    }
    plain = http.post("/v1/chat/completions", json=base)
    extra = http.post("/v1/chat/completions", json={**base, **ignored})
    assert plain.status_code == extra.status_code == 200, extra.text
    assert extra.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


def test_malformed_json_and_non_object(http: httpx.Client) -> None:
    for raw in (b"{not json", b"[1, 2]", b"", b"\xff\xfe"):
        r = http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400
        envelope(r)


def test_oversized_body_is_413(make_server) -> None:
    srv = make_server("--max-request-body-bytes", "4096")
    r = httpx.post(
        f"{srv.url}/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 10000}]}
    )
    assert r.status_code == 413
    envelope(r)


def test_prompt_longer_than_context_is_400(server: Server, http: httpx.Client) -> None:
    long = " ".join(["weather"] * 5000)
    for stream in (False, True):
        r = http.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": long}], "stream": stream},
        )
        assert r.status_code == 400
        assert "context length" in envelope(r)["message"]
    # the server still answers
    assert server.client().chat.completions.create(model=MODEL, messages=MSG, max_tokens=3).choices


def test_a_megabyte_prompt_is_refused_from_its_length(make_server) -> None:
    """Far past the context, the rendered length alone decides (no second of encoding): the same 400 envelope, with
    a lower bound on the tokens; the server, and a normal request beside it, carry on."""
    srv = make_server("--max-model-len", "4096", "--prompt-encoder", "fastokens")
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "weather " * 400_000}]}
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for stream in (False, True):
            r = http.post("/v1/chat/completions", json={**huge, "stream": stream})
            assert r.status_code == 400, r.text
            err = envelope(r)
            assert err["code"] == "context_length_exceeded" and "at least" in err["message"], err
        r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "max_tokens": 3})
        assert r.status_code == 200, r.text


def test_sdk_raises_typed_errors(server: Server) -> None:
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError):
        server.client().chat.completions.create(model=MODEL, messages=MSG, n=0)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    r = http.get("/v1/nothing")
    assert r.status_code == 404
    envelope(r)
    r = http.get("/v1/chat/completions")
    assert r.status_code == 405
    envelope(r)


def test_too_many_messages_is_400(http: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "x"}] * 4097
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": msgs})
    assert r.status_code == 400
    assert envelope(r)["param"] == "messages"


def test_oversized_headers_are_refused_and_the_server_carries_on(server: Server) -> None:
    url = f"{server.url}/v1/chat/completions"
    body = {"model": MODEL, "messages": MSG, "max_tokens": 4}
    for headers in ({"X-Big": "a" * 100_000}, {f"X-H{i}": "v" for i in range(150)}):
        r = httpx.post(url, json=body, headers=headers)
        assert r.status_code == 431
        assert envelope(r)["code"] == "request_header_fields_too_large"
    # Under the limits (64 KiB, 100 headers) a request is served.
    assert httpx.post(url, json=body, headers={"X-Big": "a" * 60_000}).status_code == 200
    assert httpx.post(url, json=body, headers={f"X-H{i}": "v" for i in range(80)}).status_code == 200
    # Far past them hyper refuses the head itself (bare 431), without reading it all.
    assert httpx.get(f"{server.url}/health", headers={"X-Big": "a" * 600_000}).status_code == 431
    assert httpx.get(f"{server.url}/health").status_code == 200
    metrics = httpx.get(f"{server.url}/metrics").text
    refused = [line for line in metrics.splitlines() if 'reason="request_header_fields_too_large"' in line]
    assert refused and float(refused[0].rsplit(" ", 1)[1]) >= 2  # counted with the other refusals


def test_refusals_before_the_handler_use_the_doors_envelope(make_server) -> None:
    """431 (head limits), 413 (body limit) and 401 (key) on the Messages door are in Anthropic's envelope, as its
    other refusals are; the OpenAI doors keep theirs."""
    srv = make_server("--max-request-body-bytes", "4096", "--api-key", "k")
    key = {"x-api-key": "k"}
    body = {"model": MODEL, "max_tokens": 4, "messages": MSG}
    big = {**body, "messages": [{"role": "user", "content": "x" * 10000}]}
    many = {**key, **{f"X-H{i}": "v" for i in range(150)}}
    for path, kw, status, kind in [
        ("/v1/messages", {"json": body, "headers": many}, 431, "invalid_request_error"),
        ("/v1/messages", {"json": big, "headers": key}, 413, "request_too_large"),
        ("/v1/messages/count_tokens", {"json": big, "headers": key}, 413, "request_too_large"),
        ("/v1/messages", {"json": body}, 401, "authentication_error"),
    ]:
        r = httpx.post(f"{srv.url}{path}", **kw)
        assert r.status_code == status, r.text
        doc = r.json()
        assert doc["type"] == "error" and doc["error"]["type"] == kind and doc["error"]["message"], doc
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=many)
    assert r.status_code == 431 and envelope(r)["code"] == "request_header_fields_too_large"
