"""Logprobs over real HTTP on every door that has them: chat (`logprobs` + `top_logprobs`, JSON and SSE, reasoning
and answer), Completions (integer `logprobs`), Responses (`top_logprobs`); the sim samples from the distribution it
reports, so the numbers are checked for what they must be, not for what they are."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, sse_events

NO_THINK = {"thinking": {"type": "disabled"}}
USER = [{"role": "user", "content": "Tell me something."}]


def check_entries(entries: list[Any], text: str, top: int) -> None:
    """One entry per token, spelling `text` exactly (strings and bytes), each a logprob of a sorted top list."""
    assert "".join(e["token"] for e in entries) == text
    assert b"".join(bytes(e["bytes"]) for e in entries) == text.encode()
    for e in entries:
        assert e["logprob"] <= 0
        alts = e["top_logprobs"]
        assert len(alts) == top
        values = [a["logprob"] for a in alts]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        if top and e["logprob"] >= values[0]:  # the argmax was sampled: it heads the list
            assert any(a["bytes"] == e["bytes"] and a["logprob"] == e["logprob"] for a in alts), e


def chat(http: httpx.Client, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": USER, "max_tokens": 60, "seed": 11, **NO_THINK, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_chat_logprobs_spell_the_answer_and_are_deterministic(server: Server) -> None:
    client = server.client()
    kw: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 80, "seed": 5, "extra_body": NO_THINK}
    r = client.chat.completions.create(logprobs=True, top_logprobs=5, **kw)
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    entries = [e.model_dump() for e in choice.logprobs.content]
    assert len(entries) == r.usage.completion_tokens
    check_entries(entries, choice.message.content or "", 5)
    again = client.chat.completions.create(logprobs=True, top_logprobs=5, **kw)
    assert [e.model_dump() for e in again.choices[0].logprobs.content] == entries  # same seed, same draw
    plain = client.chat.completions.create(**kw)
    assert plain.choices[0].logprobs is None
    only = client.chat.completions.create(logprobs=True, **kw).choices[0].logprobs
    assert only is not None and all(e.top_logprobs == [] for e in only.content)


def test_chat_logprobs_split_characters(http: httpx.Client) -> None:
    """Accented characters are two byte tokens in the sim's vocabulary: the token that completes one spells it."""
    for seed in range(80):
        d = chat(http, logprobs=True, top_logprobs=2, seed=seed, max_tokens=200, ignore_eos=True)
        text = d["choices"][0]["message"]["content"]
        if "é" in text:
            entries = d["choices"][0]["logprobs"]["content"]
            check_entries(entries, text, 2)
            split = [e for e in entries if e["token"] == "" and e["bytes"]]
            assert split, "the accented characters came as partial tokens"
            assert any(e["token"] in ("é", "ï", "è", "û", "ü") and len(e["bytes"]) == 1 for e in entries)
            return
    pytest.fail("no seed gave an answer with an accented character")


def test_chat_logprobs_stream_with_reasoning(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=USER,
        max_tokens=300,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        logprobs=True,
        top_logprobs=3,
    )
    reasoning, content, lp_reasoning, lp_content, usage = "", "", [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            reasoning += extra.get("reasoning_content") or ""
            content += ch.delta.content or ""
            if ch.logprobs is not None:
                lp_content += [e.model_dump() for e in ch.logprobs.content or []]
                lp_reasoning += (ch.logprobs.model_extra or {}).get("reasoning_content") or []
    assert reasoning and content and usage is not None
    check_entries(lp_reasoning, reasoning, 3)
    check_entries(lp_content, content, 3)
    # Every generated token has an entry but the </think> that ends the reasoning.
    assert len(lp_reasoning) + len(lp_content) + 1 == usage.completion_tokens


def completion_entries(lp: dict[str, Any], text: str, top: int) -> None:
    tokens = lp["tokens"]
    assert "".join(tokens) == text
    assert lp["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    assert len(lp["token_logprobs"]) == len(tokens) == len(lp["top_logprobs"])
    for token, value, alts in zip(tokens, lp["token_logprobs"], lp["top_logprobs"], strict=True):
        assert value <= 0 and all(v <= 0 for v in alts.values())
        # The `top` most likely, and the sampled token with its own logprob (vLLM's up to `logprobs` + 1).
        assert alts[token] == value and 1 <= len(alts) <= top + 1


def test_completions_logprobs(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "seed": 2, "logprobs": 3}
    d = http.post("/v1/completions", json=body).json()
    choice = d["choices"][0]
    completion_entries(choice["logprobs"], choice["text"], 3)
    assert len(choice["logprobs"]["tokens"]) == d["usage"]["completion_tokens"]
    r = http.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    merged: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for k in merged:
            merged[k] += ((e["choices"] or [{}])[0].get("logprobs") or {}).get(k, [])
    assert text == choice["text"]  # same seed, same text
    completion_entries(merged, text, 3)
    assert http.post("/v1/completions", json={**body, "logprobs": None}).json()["choices"][0]["logprobs"] is None


def test_completions_logprobs_stop_at_a_stop_string(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 60, "seed": 2, "logprobs": 1}
    full = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    words = full.split()
    stop = words[len(words) // 2]
    d = http.post("/v1/completions", json={**body, "stop": [stop]}).json()
    choice = d["choices"][0]
    assert stop not in choice["text"] and choice["finish_reason"] == "stop"
    tokens = choice["logprobs"]["tokens"]
    # Tokens up to the cut: their text covers what went out, and none starts past it.
    assert "".join(tokens).startswith(choice["text"])
    assert all(off < len(choice["text"]) or off == 0 for off in choice["logprobs"]["text_offset"])


def test_responses_top_logprobs(http: httpx.Client) -> None:
    body = {"model": MODEL, "input": "hi", "top_logprobs": 2, "max_output_tokens": 60, "reasoning": {"effort": "none"}}
    d = http.post("/v1/responses", json=body).json()
    parts = [p for item in d["output"] if item["type"] == "message" for p in item["content"]]
    assert parts
    for p in parts:
        check_entries(p["logprobs"], p["text"], 2)
    r = http.post("/v1/responses", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    entries = [x for e in deltas for x in e["logprobs"]]
    assert "".join(x["token"] for x in entries) == "".join(e["delta"] for e in deltas)  # these carry no bytes
    assert all(x["logprob"] <= 0 and len(x["top_logprobs"]) == 2 for x in entries)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ("/v1/completions", {"logprobs": 21}, "logprobs"),
        # Scoring the prompt (echo with logprobs) at temperature 0 while generating 5 tokens.
        ("/v1/completions", {"logprobs": 2, "echo": True, "temperature": 0}, "temperature"),
        ("/v1/responses", {"top_logprobs": 21}, "top_logprobs"),
    ],
)
def test_bad_logprobs_name_the_field(http: httpx.Client, path: str, extra: dict[str, Any], param: str) -> None:
    base: dict[str, Any] = {"model": MODEL, "max_tokens": 5}
    if path == "/v1/chat/completions":
        base["messages"] = USER
    elif path == "/v1/completions":
        base["prompt"] = "x"
    else:
        base = {"model": MODEL, "input": "x"}
    r = http.post(path, json={**base, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
