"""The prompt's logprobs over HTTP: Completions' `echo` with `logprobs` (OpenAI's scoring idiom, what lm-eval's
loglikelihood tasks send, `max_tokens` 0 or 1), vLLM's `prompt_logprobs` on Chat and Completions, and what is
refused. The values travel from the rank (the sim computes them from its own distribution, as DeepInfer returns
them with the first token) through the ring; the test recomputes them from the prompt's token IDs."""

from __future__ import annotations

import json
import math
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, sse_events

from deepinfer_server.engine.sampling import prompt_logprobs as sim_prompt_logprobs


def tokenize(http: httpx.Client, prompt: str) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, "prompt": prompt})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def complete(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/completions", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def close(a: list[float | None], b: list[float | None]) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and math.isclose(x, y, abs_tol=1e-5))
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_scores_the_prompt(http: httpx.Client, max_tokens: int) -> None:
    """lm-eval's request: the prompt as token IDs, echo, logprobs 1, temperature 0, one token or none. The
    prompt's tokens come first, the first one's logprob null, then the generated token's (none for 0)."""
    ids = tokenize(http, "The quick brown fox jumps over the lazy dog")
    body = complete(http, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens, temperature=0)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    n = len(ids) + max_tokens
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [None, *sim_prompt_logprobs(ids, 1.0)]  # the model's own distribution: temperature 1
    assert close(lp["token_logprobs"][: len(ids)], want)
    for token, value, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
        assert value <= 0 and top[token] == value  # DeepInfer gives the prompt token alone, no alternatives
    text = choice["text"]
    assert "".join(lp["tokens"]) == text and "The quick brown fox jumps over the lazy dog" in text
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(n)]
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == max_tokens
    assert choice["finish_reason"] in (("length",) if max_tokens == 0 else ("length", "stop"))


def test_scores_are_the_models_and_differ_between_texts(http: httpx.Client) -> None:
    """The same text scores the same each time, whatever temperature the request names for its one token; a
    different continuation scores differently (what a multiple-choice task compares)."""
    ids = tokenize(http, "Water boils at one hundred degrees")
    other = tokenize(http, "Water boils at nine hundred degrees")
    a = complete(http, prompt=ids, echo=True, logprobs=0, max_tokens=0)["choices"][0]["logprobs"]
    b = complete(http, prompt=ids, echo=True, logprobs=0, max_tokens=1, temperature=0.2)["choices"][0]["logprobs"]
    c = complete(http, prompt=other, echo=True, logprobs=0, max_tokens=0)["choices"][0]["logprobs"]
    assert a["token_logprobs"] == b["token_logprobs"][: len(ids)]
    assert a["top_logprobs"][1] == {}  # logprobs 0: no alternatives
    assert sum(a["token_logprobs"][1:]) != sum(c["token_logprobs"][1:])


def test_text_prompt_echo_hides_the_bos(http: httpx.Client) -> None:
    """A text prompt: the server adds BOS, which the echoed text does not show; its entry is empty and null."""
    body = complete(http, prompt="Hello there", echo=True, logprobs=1, max_tokens=0)
    choice = body["choices"][0]
    lp = choice["logprobs"]
    assert choice["text"] == "Hello there" == "".join(lp["tokens"])
    assert lp["tokens"][0] == "" and lp["token_logprobs"][0] is None and lp["token_logprobs"][1] < 0


def test_streamed_echo_carries_the_prompts_logprobs(server: Server) -> None:
    with httpx.stream(
        "POST",
        f"{server.url}/v1/completions",
        json={"model": MODEL, "prompt": "One two three", "echo": True, "logprobs": 2, "max_tokens": 3, "stream": True},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        events = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    first = events[0]["choices"][0]
    assert first["text"] == "One two three" and first["logprobs"]["token_logprobs"][0] is None
    assert len(first["logprobs"]["tokens"]) == len(first["logprobs"]["token_logprobs"]) >= 3
    later = [t for e in events[1:] for t in e["choices"][0]["logprobs"]["tokens"]]
    assert 1 <= len(later) <= 3 and events[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    # The two most likely, and the sampled token if it is not one of them (vLLM's up to `logprobs` + 1).
    for e in events[1:]:
        lp = e["choices"][0]["logprobs"]
        assert all(
            len(top) <= 3 and top[t] == v
            for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)
        )


def test_vllm_prompt_logprobs_on_completions(http: httpx.Client) -> None:
    ids = tokenize(http, "Green tea")
    body = complete(http, prompt=ids, prompt_logprobs=0, max_tokens=2)
    plp = body["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for token, entry in zip(ids[1:], plp[1:], strict=True):
        ((key, info),) = entry.items()
        assert key == str(token) and info["rank"] is None and isinstance(info["decoded_token"], str)
    values = [None] + [next(iter(e.values()))["logprob"] for e in plp[1:]]
    assert close(values, [None, *sim_prompt_logprobs(ids, 1.0)])
    assert body["choices"][0]["logprobs"] is None  # not asked for


def test_vllm_prompt_logprobs_on_chat(server: Server) -> None:
    """With the openai client, as vLLM's users pass it: `extra_body`. The list covers the whole rendered prompt
    (its chat template included), one entry per prompt token."""
    client = server.client()
    resp = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Score me"}],
        max_tokens=1,
        extra_body={"prompt_logprobs": True},
    )
    plp = resp.model_extra["prompt_logprobs"] if resp.model_extra else None
    assert plp is not None and plp[0] is None and len(plp) == resp.usage.prompt_tokens  # type: ignore[union-attr]
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in plp[1:])
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    assert "prompt_logprobs" not in (plain.model_extra or {})


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        # Scoring at another temperature than the model's while generating more than one token.
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1, "temperature": 0}, "temperature"),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "top_p": 0.5, "max_tokens": 4}, "top_p"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "top_k": 3},
            "top_k",
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
        ),
        ("/v1/completions", {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ],
)
def test_what_cannot_be_scored_is_refused(http: httpx.Client, path: str, body: dict[str, Any], param: str) -> None:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_prompt_logprobs_with_an_image_are_refused(http: httpx.Client) -> None:
    png = (
        "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJ"
        "RU5ErkJggg=="
    )
    content = [{"type": "text", "text": "what is it"}, {"type": "image_url", "image_url": {"url": png}}]
    r = http.post(
        "/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": content}],
            "prompt_logprobs": 0,
            "max_tokens": 1,
        },
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "prompt_logprobs"


def test_max_tokens_zero_without_echo_generates_nothing(http: httpx.Client) -> None:
    body = complete(http, prompt="Nothing more", max_tokens=0)
    assert body["choices"][0]["text"] == "" and body["usage"]["completion_tokens"] == 0
    assert body["choices"][0]["finish_reason"] == "length"
