"""vLLM's token-ID extensions over real HTTP (openai SDK with `extra_body`, and httpx): `return_token_ids` gives
the prompt's IDs and the generated ones, `return_tokens_as_token_ids` names logprob tokens `token_id:N`; JSON and
SSE, Chat and Completions. The IDs must be the engine's own, so they are checked against the server's own
encoding (`/tokenize`), its decoding (`/detokenize`) and a tool-using conversation rebuilt from them, as a
training client (prime-rl's verifiers, `tokens_from_wire`) rebuilds it."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, sse_events

NO_THINK = {"thinking": {"type": "disabled"}}
THINK = {"thinking": {"type": "enabled"}}
USER = [{"role": "user", "content": "Tell me something."}]
IDS = {"return_token_ids": True}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


def text_of(http: httpx.Client, ids: list[int]) -> str:
    r = http.post("/detokenize", json={"model": MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    return str(r.json()["prompt"])


def encoded(http: httpx.Client, **body: Any) -> list[int]:
    r = http.post("/tokenize", json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def post(http: httpx.Client, path: str, **body: Any) -> dict[str, Any]:
    r = http.post(path, json={"model": MODEL, **body})
    assert r.status_code == 200, r.text
    return dict(r.json())


def chunks(http: httpx.Client, path: str, **body: Any) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={"model": MODEL, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def eos_spelling(http: httpx.Client, ids: list[int], finish: str) -> str:
    """The EOS the engine ended with, as text ("" when the output ran to its length)."""
    return text_of(http, ids[-1:]) if finish == "stop" else ""


def test_chat_json_ids_are_the_prompt_and_the_output(server: Server, http: httpx.Client) -> None:
    """Through the SDK: the prompt's IDs are the server's encoding of the messages, the output's spell the answer
    and end with the EOS the engine made; with logprobs, one `logprobs.content` entry per ID (what
    `tokens_from_wire` reads)."""
    r = server.client().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, seed=4, logprobs=True, top_logprobs=2, extra_body=IDS | NO_THINK
    )
    extra = r.model_extra or {}
    choice = r.choices[0]
    ids = (choice.model_extra or {})["token_ids"]
    assert extra["prompt_token_ids"] == encoded(http, messages=USER, **NO_THINK)
    assert len(extra["prompt_token_ids"]) == r.usage.prompt_tokens
    assert choice.finish_reason == "stop"  # the sim's answer ends with the engine's EOS
    eos = eos_spelling(http, ids, "stop")
    assert eos and text_of(http, ids) == (choice.message.content or "") + eos
    assert len(ids) == r.usage.completion_tokens + 1  # usage leaves the EOS out; the IDs keep it, as vLLM's do
    content = choice.logprobs.content if choice.logprobs else None
    assert content is not None and len(content) == len(ids)
    assert b"".join(bytes(e.bytes or []) for e in content).decode() == text_of(http, ids)
    assert all(len(e.top_logprobs) == 2 and e.logprob <= 0 for e in content)
    plain = server.client().chat.completions.create(
        model=MODEL, messages=USER, max_tokens=200, seed=4, extra_body=NO_THINK
    )
    assert "token_ids" not in (plain.choices[0].model_extra or {}) and "prompt_token_ids" not in (
        plain.model_extra or {}
    )
    assert plain.choices[0].message.content == choice.message.content


def test_chat_thinking_ids_include_the_reasoning(http: httpx.Client) -> None:
    """Thinking on: the IDs are the reasoning, `</think>` and the answer, as the engine made them."""
    d = post(http, "/v1/chat/completions", messages=USER, max_tokens=400, seed=2, logprobs=True, **IDS, **THINK)
    choice = d["choices"][0]
    message, ids = choice["message"], choice["token_ids"]
    assert message["reasoning_content"] and message["content"]
    assert d["prompt_token_ids"] == encoded(http, messages=USER, **THINK)
    whole = text_of(http, ids)
    assert whole == message["reasoning_content"] + "</think>" + message["content"] + eos_spelling(
        http, ids, choice["finish_reason"]
    )
    reasoning = d["usage"]["completion_tokens_details"]["reasoning_tokens"]
    assert text_of(http, ids[reasoning : reasoning + 1]) == "</think>"  # one special token, where it was made
    # vLLM's logprobs: one entry per generated token, the reasoning's and `</think>`'s too.
    assert len(choice["logprobs"]["content"]) == len(ids)
    assert "reasoning_content" not in choice["logprobs"]


def test_chat_stream_ids_add_up_to_the_response(http: httpx.Client) -> None:
    """A stream: the prompt's IDs on the first chunk only, each chunk's own IDs (with as many logprob entries,
    named `token_id:N`), adding up to the response's."""
    body: dict[str, Any] = {"messages": USER, "max_tokens": 300, "seed": 9, "logprobs": True, "top_logprobs": 1}
    body |= {**IDS, "return_tokens_as_token_ids": True, **THINK}
    whole = post(http, "/v1/chat/completions", **body)
    got = chunks(http, "/v1/chat/completions", stream_options={"include_usage": True}, **body)
    assert got[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c for c in got[1:])
    ids: list[int] = []
    for c in got:
        for choice in c["choices"]:
            mine = choice["token_ids"]
            entries = (choice["logprobs"] or {}).get("content") or []
            assert [e["token"] for e in entries] == [f"token_id:{t}" for t in mine]
            ids += mine
    assert got[-1]["choices"] == [] and got[-1]["usage"]  # the usage chunk carries no IDs
    assert ids == whole["choices"][0]["token_ids"]
    tokens = [e["token"] for e in whole["choices"][0]["logprobs"]["content"]]
    assert tokens == [f"token_id:{t}" for t in ids]
    alts = whole["choices"][0]["logprobs"]["content"][0]["top_logprobs"]
    assert len(alts) == 1 and alts[0]["token"].startswith("token_id:")


def test_tokens_as_ids_alone_names_the_tokens(http: httpx.Client) -> None:
    """`return_tokens_as_token_ids` without `return_token_ids`: the names change, no ID lists appear."""
    d = post(
        http,
        "/v1/chat/completions",
        messages=USER,
        max_tokens=40,
        seed=1,
        logprobs=True,
        return_tokens_as_token_ids=True,
        **NO_THINK,
    )
    assert "prompt_token_ids" not in d and "token_ids" not in d["choices"][0]
    entries = d["choices"][0]["logprobs"]["content"]
    assert entries and all(e["token"].startswith("token_id:") for e in entries)
    ids = [int(e["token"].split(":")[1]) for e in entries]
    assert text_of(http, ids).startswith(d["choices"][0]["message"]["content"])


def test_completions_ids_json_and_stream(server: Server, http: httpx.Client) -> None:
    """Completions: both ID lists in the choice (the prompt's on a stream's first chunk), legacy logprob tokens
    named `token_id:N`."""
    body: dict[str, Any] = {"prompt": "The cafe", "max_tokens": 12, "seed": 5, "logprobs": 2}
    r = server.client().completions.create(model=MODEL, extra_body={**IDS, "return_tokens_as_token_ids": True}, **body)
    choice = r.choices[0]
    extra = choice.model_extra or {}
    ids = extra["token_ids"]
    assert extra["prompt_token_ids"] == encoded(http, prompt="The cafe")
    assert len(ids) == 12 and text_of(http, ids) == choice.text
    assert choice.logprobs is not None and choice.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs or [] for k in top)
    got = chunks(http, "/v1/completions", **body, **IDS)
    assert got[0]["choices"][0]["prompt_token_ids"] == extra["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in got[1:])
    assert [t for c in got for t in c["choices"][0]["token_ids"]] == ids
    assert "".join(c["choices"][0]["text"] for c in got) == choice.text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_logprobs_cover_every_id_the_eos_included(http: httpx.Client, stream: bool) -> None:
    """An output that ends with the engine's EOS: one logprob entry per ID in `token_ids`, the EOS's last and
    without text (vLLM's), as a rollout reads them; the text is the same as without the IDs."""
    body: dict[str, Any] = {"prompt": "The cafe", "max_tokens": 2000, "seed": 3, "logprobs": 1, **IDS}
    if stream:
        got = [c["choices"][0] for c in chunks(http, "/v1/completions", **body) if c["choices"]]
        ids = [t for c in got for t in c.get("token_ids") or []]
        tokens = [t for c in got if c.get("logprobs") for t in c["logprobs"]["tokens"]]
        text, finish = "".join(c["text"] for c in got), got[-1]["finish_reason"]
    else:
        choice = post(http, "/v1/completions", **body)["choices"][0]
        ids, tokens, text, finish = (
            choice["token_ids"],
            choice["logprobs"]["tokens"],
            choice["text"],
            choice["finish_reason"],
        )
    assert finish == "stop" and eos_spelling(http, ids, finish) != "", ids[-3:]
    assert len(tokens) == len(ids) and tokens[-1] == ""
    without = post(http, "/v1/completions", **{**body, "return_token_ids": False})["choices"][0]
    assert text == without["text"] and len(without["logprobs"]["tokens"]) == len(ids) - 1


def _stop_within(http: httpx.Client, path: str, text: str, ids: list[int]) -> tuple[str, int]:
    """A stop string that begins inside the output (not at its start), and the index of the token completing it."""
    for k in range(len(ids) // 2, len(ids)):
        word = text_of(http, ids[k : k + 1])
        if len(word.strip()) > 2 and word.strip().isalpha() and text.find(word) == len(text_of(http, ids[:k])):
            return word, k
    pytest.fail(f"no whole-word token to stop at in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_a_stop_string_ends_the_ids_at_its_token(http: httpx.Client, path: str, stream: bool) -> None:
    """vLLM's rule: the IDs run through the token that completed the stop string; the text stops before it."""
    chat = path == "/v1/chat/completions"
    body: dict[str, Any] = {"max_tokens": 60, "seed": 6, "ignore_eos": True, **IDS}
    body |= {"messages": USER, **NO_THINK} if chat else {"prompt": "Tell me"}
    free = post(http, path, **body)["choices"][0]
    text = free["message"]["content"] if chat else free["text"]
    stop, k = _stop_within(http, path, text, free["token_ids"])
    if stream:
        got = chunks(http, path, stop=[stop], **body)
        ids = [t for c in got for ch in c["choices"] for t in ch.get("token_ids") or []]
        parts = [ch["delta"].get("content") or "" if chat else ch["text"] for c in got for ch in c["choices"]]
        cut, finish = "".join(parts), [ch["finish_reason"] for c in got for ch in c["choices"]][-1]
    else:
        choice = post(http, path, stop=[stop], **body)["choices"][0]
        ids, cut, finish = choice["token_ids"], choice["message"]["content"] if chat else choice["text"], "stop"
        assert choice["finish_reason"] == "stop"
    assert finish == "stop"
    assert cut == text[: text.find(stop)]
    assert ids == free["token_ids"][: k + 1]


@pytest.mark.parametrize("thinking", [NO_THINK, THINK])
def test_tool_round_trip_rebuilds_the_conversation(http: httpx.Client, thinking: dict[str, Any]) -> None:
    """A tool call, its result, the next turn: the previous prompt's IDs and the call's IDs, followed by the next
    turn's encoding, are the server's encoding of the whole conversation, token for token."""
    tools = [WEATHER]
    first = post(
        http,
        "/v1/chat/completions",
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        max_tokens=300,
        seed=3,
        **IDS,
        **thinking,
    )
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    calls = message["tool_calls"]
    assistant: dict[str, Any] = {"role": "assistant", "content": message["content"], "tool_calls": calls}
    if message.get("reasoning_content"):
        assistant["reasoning_content"] = message["reasoning_content"]
    history = [
        {"role": "user", "content": "What is the weather in Paris?"},
        assistant,
        {"role": "tool", "tool_call_id": calls[0]["id"], "content": "sunny, 21 C"},
    ]
    so_far = first["prompt_token_ids"] + choice["token_ids"]
    streamed = chunks(
        http, "/v1/chat/completions", messages=history[:1], tools=tools, max_tokens=300, seed=3, **IDS, **thinking
    )
    assert streamed[0]["prompt_token_ids"] == first["prompt_token_ids"]
    assert [t for c in streamed for ch in c["choices"] for t in ch["token_ids"]] == choice["token_ids"]
    markup = text_of(http, choice["token_ids"])
    assert "get_weather" in markup and "Paris" in markup  # the DSML call itself, not its parsed form
    second = post(http, "/v1/chat/completions", messages=history, tools=tools, max_tokens=20, seed=1, **IDS, **thinking)
    whole = encoded(http, messages=history, tools=tools, **thinking)
    assert second["prompt_token_ids"] == whole
    next_turn = whole[len(so_far) :]
    assert so_far + next_turn == whole and whole[: len(so_far)] == so_far
    assert "sunny, 21 C" in text_of(http, next_turn)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("field", ["return_token_ids", "return_tokens_as_token_ids"])
@pytest.mark.parametrize("value", ["yes", 1, [True], {"on": True}])
def test_a_switch_that_is_not_a_boolean_is_refused(http: httpx.Client, path: str, field: str, value: Any) -> None:
    body: dict[str, Any] = {"messages": USER} if path == "/v1/chat/completions" else {"prompt": "x"}
    r = http.post(path, json={"model": MODEL, field: value, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and field in err["message"] and err["type"] == "invalid_request_error"
    ok = http.post(path, json={"model": MODEL, field: None, "max_tokens": 2, **body})
    assert ok.status_code == 200 and "token_ids" not in ok.json()["choices"][0]
