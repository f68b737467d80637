"""OpenAI's `n` on Chat Completions and Completions, over real HTTP with the openai SDK and httpx: n choices of one
prompt, each sampled as a request of its own (its own slot), as vLLM samples them: choice j of a seeded request is
what the same request with seed + j and n = 1 answers. One response id, choices numbered, usage counting the prompt
once; a stream's chunks renumbered, one usage chunk with the sum and one `[DONE]`."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, sse_events

NO_THINK = {"thinking": {"type": "disabled"}}
MSG = [{"role": "user", "content": "Name a river."}]


def test_chat_choices_are_the_seeded_singles(server: Server, http: httpx.Client) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": MSG, "max_tokens": 20, "seed": 11, "temperature": 1}
    r = server.client().chat.completions.create(n=3, extra_body=NO_THINK, **body)
    assert [c.index for c in r.choices] == [0, 1, 2]
    singles = [http.post("/v1/chat/completions", json={**body, **NO_THINK, "seed": 11 + j}).json() for j in range(3)]
    assert [c.message.content for c in r.choices] == [s["choices"][0]["message"]["content"] for s in singles]
    assert len({c.message.content for c in r.choices}) > 1, "the seeds should give different choices"
    assert r.usage is not None
    assert r.usage.prompt_tokens == singles[0]["usage"]["prompt_tokens"]
    assert r.usage.completion_tokens == sum(s["usage"]["completion_tokens"] for s in singles)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.id.startswith("chatcmpl-") and all(r.id != s["id"] for s in singles)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stream_of_choices_is_renumbered_with_one_usage_and_one_done(http: httpx.Client, path: str) -> None:
    common = {"model": MODEL, "max_tokens": 12, "ignore_eos": True, "seed": 3, "n": 4, "stream": True}
    body = {**common, "messages": MSG, **NO_THINK} if path.endswith("chat/completions") else {**common, "prompt": "A"}
    body["stream_options"] = {"include_usage": True}
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    chunks = [json.loads(e) for e in events[:-1]]
    assert len({c["id"] for c in chunks}) == 1
    usage = [c for c in chunks if not c["choices"]]
    assert len(usage) == 1 and usage is not chunks and chunks[-1] is usage[0]
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        for choice in c["choices"]:
            piece = choice["delta"].get("content") if "delta" in choice else choice["text"]
            texts[choice["index"]] = texts.get(choice["index"], "") + (piece or "")
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert sorted(texts) == [0, 1, 2, 3] and finishes == dict.fromkeys(range(4), "length")
    assert usage[0]["usage"]["completion_tokens"] == 4 * 12
    # Each choice is the seeded single's text.
    single = {**body, "n": 1, "stream": False, "seed": 3 + 2, "stream_options": None}
    one = http.post(path, json=single).json()["choices"][0]
    assert texts[2] == (one["message"]["content"] if "message" in one else one["text"])


def test_completions_choices_json(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 8, "n": 2, "logprobs": 1, "ignore_eos": True}
    d = http.post("/v1/completions", json=body).json()
    assert [c["index"] for c in d["choices"]] == [0, 1]
    assert all(len(c["logprobs"]["tokens"]) == 8 for c in d["choices"])
    assert d["usage"]["completion_tokens"] == 16 and d["object"] == "text_completion"


@pytest.mark.parametrize(
    ("n", "why"),
    [(0, "at least 1"), ("2", "at least 1"), (1.5, "at least 1"), (129, "at most 128")],
)
def test_a_bad_n_is_a_400_naming_it(http: httpx.Client, n: Any, why: str) -> None:
    for path, extra in [("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "A"})]:
        r = http.post(path, json={"model": MODEL, "n": n, **extra})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "n" and why in err["message"], err


def test_n_copies_of_a_large_body_are_bounded(make_server: Any) -> None:
    srv = make_server("--max-generate-fanout-bytes", "100000")
    big = "word " * 9_000  # 45 kB: two copies fit, three do not
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        ok = c.post("/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 1, "n": 1})
        assert ok.status_code == 200, ok.text
        r = c.post("/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 1, "n": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
        two = c.post("/v1/completions", json={"model": MODEL, "prompt": big, "max_tokens": 1, "n": 2})
        assert two.status_code == 200, two.text
