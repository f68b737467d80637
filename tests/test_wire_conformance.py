"""Wire conformance to OpenAI's published schema and log safety, over HTTP.

Every response these tests (and all others) read is also validated by conftest's `wire_conformance` fixture;
the tests here pin the defects that fixture found, and check that the fixture itself bites."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import conftest
import httpx
import pytest
import wire_schema
from conftest import MODEL, Server

MSG = [{"role": "user", "content": "What is the weather in Paris?"}]
NO_THINK = {"thinking": {"type": "disabled"}}
WEATHER = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


def chat(http: httpx.Client, **body: Any) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, **body})


def events(resp: httpx.Response) -> list[dict[str, Any]]:
    return [json.loads(e) for e in conftest.sse_events(resp) if e != "[DONE]"]


# ------------------------------------------------------------------------------------- the fixture itself


def test_the_validator_catches_each_defect_it_guards() -> None:
    good = {
        "id": "x",
        "object": "chat.completion",
        "created": 1,
        "model": MODEL,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "hi", "refusal": None, "reasoning_content": "r"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2, "prompt_cache_hit_tokens": 0},
        "system_fingerprint": "fp_1",
    }
    assert wire_schema.violations("CreateChatCompletionResponse", good) == []
    no_refusal = json.loads(json.dumps(good))
    del no_refusal["choices"][0]["message"]["refusal"]
    null_fingerprint = {**good, "system_fingerprint": None}
    extra_key = {**good, "backend": "sim"}
    for bad in (no_refusal, null_fingerprint, extra_key):
        assert wire_schema.violations("CreateChatCompletionResponse", bad), bad
    assert wire_schema.violations("ErrorResponse", {"error": {"message": "m", "type": "t", "code": None}})
    sse = b'data: {"id":"x"}\n\n'
    assert wire_schema.check_sse(sse, "CreateChatCompletionStreamResponse", complete=True)  # no [DONE], no fields


def test_every_response_is_checked(server: Server, http: httpx.Client) -> None:
    before = len(conftest.WIRE_CHECKED)
    client = server.client()
    client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3)
    list(client.chat.completions.create(model=MODEL, messages=MSG, max_tokens=3, stream=True))
    client.models.list()
    chat(http, max_tokens=0)
    assert len(conftest.WIRE_CHECKED) - before == 4, "the SDK's calls and a raw httpx call all pass the validator"


def test_spec_is_the_pinned_published_one() -> None:
    spec = wire_schema.reduced_spec()
    assert spec["info"]["title"] == "OpenAI API" and spec["info"]["version"] == "2.3.0"
    assert set(spec["paths"]) == set(wire_schema.SERVED)
    assert "CreateChatCompletionStreamResponse" in spec["components"]["schemas"]


# ------------------------------------------------------------------------------------- defects 1 and 2


def test_message_has_refusal_and_fingerprint_is_a_string(http: httpx.Client) -> None:
    fingerprints = set()
    for body in ({"max_tokens": 4}, {"max_tokens": 40, "tools": WEATHER, **NO_THINK}):
        d = chat(http, **body).json()
        message = d["choices"][0]["message"]
        assert "refusal" in message and message["refusal"] is None
        assert all("index" not in call for call in message.get("tool_calls") or [])
        fingerprints.add(d["system_fingerprint"])
    with http.stream("POST", "/v1/chat/completions", json={"model": MODEL, "messages": MSG, "stream": True}) as r:
        chunks = events(r)
    fingerprints |= {c["system_fingerprint"] for c in chunks}
    assert len(fingerprints) == 1 and next(iter(fingerprints)).startswith("fp_"), fingerprints


# ------------------------------------------------------------------------------------- defect 4


def test_cut_off_tool_call_arguments_hold_no_markup(http: httpx.Client) -> None:
    full = json.loads(chat(http, max_tokens=80, tools=WEATHER, **NO_THINK).text)
    whole = full["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"]
    assert json.loads(whole) == {"city": "Paris"}
    for n in range(18, 40):
        d = chat(http, max_tokens=n, tools=WEATHER, **NO_THINK).json()
        calls = d["choices"][0]["message"].get("tool_calls") or []
        args = calls[0]["function"]["arguments"] if calls else ""
        assert whole.startswith(args), f"max_tokens {n}: {args!r} is not a prefix of {whole!r}"
        body = {"model": MODEL, "messages": MSG, "max_tokens": n, "tools": WEATHER, "stream": True, **NO_THINK}
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            streamed = "".join(
                call["function"].get("arguments") or ""
                for c in events(r)
                for choice in c["choices"]
                for call in choice["delta"].get("tool_calls") or []
            )
        assert streamed == args, f"max_tokens {n}: streamed {streamed!r}, whole {args!r}"


# ------------------------------------------------------------------------------------- defects 5, 6 and 7


def test_values_the_spec_allows_are_served(http: httpx.Client) -> None:
    def answer(**body: Any) -> str:
        r = chat(http, **NO_THINK, **body)
        assert r.status_code == 200, (body, r.text)
        return str(r.json()["choices"][0]["message"]["content"])

    assert answer(seed=-1, max_tokens=8) == answer(seed=-1, max_tokens=8)
    assert answer(seed=-(2**63), max_tokens=8)
    assert answer(seed=1e3, max_tokens=8) == answer(seed=1000, max_tokens=8)
    r = chat(http, max_tokens=5.0, n=1.0, top_k=4.0, ignore_eos=True, **NO_THINK)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 5
    assert chat(http, max_completion_tokens=1e1, ignore_eos=True, **NO_THINK).json()["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"temperature": 3}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"seed": 1.5}, "seed"),
        ({"seed": "x"}, "seed"),
        ({"seed": 2**63}, "seed"),
        ({"stop": [str(i) for i in range(17)]}, "stop"),
        ({"stop": 5}, "stop"),
        ({"stop": [""]}, "stop[0]"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"logit_bias": 2.4e135}, "logit_bias"),
        ({"logit_bias": {"12": 500}}, "logit_bias"),
        ({"user": 5}, "user"),
        ({"metadata": {"a": 1}}, "metadata"),
        ({"store": "yes"}, "store"),
        ({"service_tier": 5}, "service_tier"),
        ({"parallel_tool_calls": "x"}, "parallel_tool_calls"),
        ({"reasoning_effort": "bogus"}, "reasoning_effort"),
        ({"thinking": {"type": "x"}}, "thinking.type"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ],
)
def test_each_400_names_its_field(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    r = chat(http, **body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for internal in ("u64", "f32", "invalid type:", "expected struct"):
        assert internal not in err["message"], err


def test_refusals_before_the_body_keep_the_connection_usable(make_server: Any) -> None:
    """A 401 or 404 decided before the body is read used to close the connection unannounced."""
    srv = make_server("--api-key", "k")
    host, port = srv.url.removeprefix("http://").split(":")
    body = json.dumps({"model": MODEL, "messages": MSG}).encode()
    for path in ("/v1/chat/completions", "/nope"):
        with socket.create_connection((host, int(port)), timeout=10) as s:
            s.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode())
            time.sleep(0.05)  # the body arrives after the head: hyper has not read it when the refusal is made
            s.sendall(body)
            first = s.recv(65536)
            assert first.split(b"\r\n")[0] in (b"HTTP/1.1 401 Unauthorized", b"HTTP/1.1 404 Not Found"), first
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200"), f"the connection after {path}'s refusal"


# ------------------------------------------------------------------------------------- defect 3: log safety

FORGED = "request finished request_id=forged rank=0 status=200"


def forge(srv: Server) -> None:
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        # (HTTP itself keeps line breaks out of headers: request ids and user agents cannot carry them)
        for end in ("\n", "\r\n", "\u2028", "\x1b[2K\r"):
            r = c.post("/v1/chat/completions", json={"model": f"{MODEL}{end}{FORGED}", "messages": MSG})
            assert r.status_code == 404
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "stop": [f"x\n{FORGED}"]})
        assert r.status_code == 200
        r = c.post("/v1/chat/completions", json={"model": MODEL, "messages": MSG, "temperature": f"\n{FORGED}"})
        assert r.status_code == 400


def test_client_values_cannot_forge_text_log_lines(make_server: Any) -> None:
    srv = make_server()
    forge(srv)
    srv.stop()
    lines = srv.log().splitlines()
    assert not [ln for ln in lines if ln.startswith(FORGED) or ln.startswith("forged")], "a forged line"
    assert any("\\nrequest finished request_id=forged" in ln for ln in lines), "the model name, escaped"


def test_json_log_is_one_object_per_line_whatever_clients_send(make_server: Any) -> None:
    srv = make_server("--log-format", "json")
    forge(srv)
    srv.stop()
    lines = [ln for ln in srv.log().split("\n") if ln.strip()]  # JSON Lines: U+2028 is no line break
    bad = []
    for ln in lines:
        try:
            assert isinstance(json.loads(ln), dict)
        except (ValueError, AssertionError):
            bad.append(ln)
    assert not bad, f"{len(bad)} of {len(lines)} lines are not JSON objects: {bad[:5]}"
    assert any(FORGED in json.dumps(json.loads(ln)) for ln in lines), "the refusal was logged"
