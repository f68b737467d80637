"""Chat Completions over real HTTP with the openai SDK: JSON and SSE, reasoning, tools, usage, stop, ignore_eos."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from conftest import MODEL, Server, sse_events

NO_THINK = {"thinking": {"type": "disabled"}}
EOS_TEXT = "<｜end▁of▁sentence｜>"
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


def test_models_lists_served_name_and_context(server: Server) -> None:
    models = server.client().models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].model_extra["max_model_len"] == 4096


def test_health_is_200_when_all_ranks_ready(http: httpx.Client) -> None:
    r = http.get("/health")
    assert r.status_code == 200, r.text


def test_non_stream_answer_with_exact_usage(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=400, extra_body=NO_THINK
    )
    choice = r.choices[0]
    assert r.object == "chat.completion"
    assert r.model == MODEL
    assert choice.message.role == "assistant"
    assert choice.message.content and EOS_TEXT not in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0
    assert 1 <= r.usage.completion_tokens < 400
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_stream_with_include_usage(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=400,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINK,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["stop"]
    assert text and EOS_TEXT not in text
    # OpenAI format: usage only on a last chunk with empty choices; null elsewhere.
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + chunks[-1].usage.completion_tokens
    assert len({c.id for c in chunks}) == 1


def test_stream_wire_format_and_no_usage_unless_asked(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Hi"}],
        "stream": True,
        "max_tokens": 20,
        **NO_THINK,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert all("usage" not in c for c in chunks)


def test_continuous_usage_stats_are_cumulative_and_exact(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Tell me a story"}]}],
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "max_completion_tokens": 64,
        "ignore_eos": True,
        **NO_THINK,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(e) for e in sse_events(r)[:-1]]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all(c["usage"] is not None for c in chunks)
    assert counts == sorted(counts) and counts[0] == 0
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 64
    prompt = chunks[-1]["usage"]["prompt_tokens"]
    assert all(c["usage"]["total_tokens"] == prompt + c["usage"]["completion_tokens"] for c in chunks)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 7, 300])
def test_ignore_eos_gives_exact_lengths(server: Server, stream: bool, n: int) -> None:
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "Go"}],
        max_tokens=n,
        extra_body={"ignore_eos": True, **NO_THINK},
    )
    client = server.client()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage = chunks[-1].usage
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert finish == ["length"]
    else:
        r = client.chat.completions.create(**kw)
        usage = r.usage
        assert r.choices[0].finish_reason == "length"
    assert usage.completion_tokens == n


def test_max_completion_tokens_wins_over_max_tokens(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Go"}],
        max_tokens=50,
        max_completion_tokens=5,
        extra_body={"ignore_eos": True, **NO_THINK},
    )
    assert r.usage.completion_tokens == 5


def test_reasoning_content_before_the_answer(server: Server) -> None:
    stream = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think first"}], max_tokens=600, stream=True, seed=3
    )
    kinds = []
    for c in stream:
        if not c.choices:
            continue
        d = c.choices[0].delta
        if getattr(d, "reasoning_content", None):
            kinds.append("r")
        if d.content:
            kinds.append("c")
    assert "r" in kinds and "c" in kinds
    assert kinds.index("c") > kinds.index("r") and "r" not in kinds[kinds.index("c") :]


def test_reasoning_counts_against_max_tokens(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Think"}], max_tokens=5, seed=1
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5
    assert r.choices[0].message.model_extra.get("reasoning_content")


def test_usage_counts_reasoning_tokens(server: Server) -> None:
    from tokenizers import Tokenizer

    from deepinfer_server.launcher import BUNDLED_TOKENIZER

    client = server.client()
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "Think it through"}], "max_tokens": 600, "seed": 4}
    r = client.chat.completions.create(**ask)  # type: ignore[call-overload]
    details = r.usage.completion_tokens_details
    assert details is not None and 0 < details.reasoning_tokens < r.usage.completion_tokens
    # The engine's tokens before </think>. Re-tokenizing the reasoning text (the library's way) gives the same, less
    # a leading newline token the parser drops from the text when the model generated one.
    reasoning = r.choices[0].message.model_extra["reasoning_content"]
    retokenized = len(Tokenizer.from_file(str(BUNDLED_TOKENIZER)).encode(reasoning, add_special_tokens=False).ids)
    assert details.reasoning_tokens - retokenized in (0, 1)
    last = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))[-1]
    assert last.usage is not None and last.usage.completion_tokens_details is not None
    assert last.usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    plain = client.chat.completions.create(**{**ask, "extra_body": NO_THINK})  # type: ignore[call-overload]
    assert plain.usage.completion_tokens_details is None


def test_same_prompt_and_seed_give_the_same_answer(server: Server) -> None:
    def ask(seed: int) -> str:
        r = server.client().chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Repeat"}], seed=seed, extra_body=NO_THINK
        )
        return r.choices[0].message.content or ""

    assert ask(7) == ask(7)
    assert any(ask(s) != ask(7) for s in (8, 9, 10))


def test_stop_sequence_ends_the_answer(server: Server) -> None:
    client = server.client()
    base = (
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Stop test"}], seed=11, extra_body=NO_THINK
        )
        .choices[0]
        .message.content
    )
    assert base and len(base.split()) > 4
    word = base.split()[3]
    for stream in (False, True):
        kw = dict(
            model=MODEL, messages=[{"role": "user", "content": "Stop test"}], seed=11, stop=[word], extra_body=NO_THINK
        )
        if stream:
            chunks = list(client.chat.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        else:
            r = client.chat.completions.create(**kw)
            text, finish = r.choices[0].message.content or "", [r.choices[0].finish_reason]
        assert word not in text
        assert base.startswith(text)
        assert finish == ["stop"]


def _tool_call_request(server: Server, stream: bool) -> tuple[list[dict], str]:
    client = server.client()
    kw = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        extra_body=NO_THINK,
    )
    if not stream:
        r = client.chat.completions.create(**kw)
        calls = [tc.model_dump() for tc in r.choices[0].message.tool_calls or []]
        return calls, r.choices[0].finish_reason
    calls: dict[int, dict] = {}
    finish = ""
    for c in client.chat.completions.create(stream=True, **kw):
        if not c.choices:
            continue
        finish = c.choices[0].finish_reason or finish
        for tc in c.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(
                tc.index, {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
            )
            slot["id"] = tc.id or slot["id"]
            if tc.function:
                slot["function"]["name"] += tc.function.name or ""
                slot["function"]["arguments"] += tc.function.arguments or ""
    return list(calls.values()), finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(server: Server, stream: bool) -> None:
    calls, finish = _tool_call_request(server, stream)
    assert finish == "tool_calls"
    assert len(calls) == 1
    call = calls[0]
    assert call["id"] and call["function"]["name"] == "get_weather"
    args = json.loads(call["function"]["arguments"])
    assert args == {"city": "Paris"}
    # Second turn: the tool result goes back and the model answers in text.
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": call["id"], "type": "function", "function": call["function"]}],
            },
            {"role": "tool", "tool_call_id": call["id"], "content": "sunny, 21 C"},
        ],
        tools=[WEATHER_TOOL],
        extra_body=NO_THINK,
    )
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_tool_choice_none_gives_text(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER_TOOL],
        tool_choice="none",
        extra_body=NO_THINK,
    )
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls


def test_developer_role_and_content_parts(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": " there"}]},
        ],
        max_tokens=10,
        extra_body=NO_THINK,
    )
    assert r.choices[0].message.content


def test_reasoning_effort_and_thinking_flag(server: Server) -> None:
    r = server.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], reasoning_effort="low", max_tokens=300, seed=5
    )
    assert r.choices[0].message.model_extra.get("reasoning_content")
    r = server.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=300,
        seed=5,
        extra_body={"thinking": {"type": "disabled"}, "reasoning_effort": "high"},
    )
    assert not r.choices[0].message.model_extra.get("reasoning_content")


def _reasoning(server: Server, extra: dict[str, object], stream: bool = False) -> str:
    """The reasoning_content the server sends for a request with `extra_body=extra` (JSON or streamed)."""
    kw = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 300, "seed": 5}
    if not stream:
        r = server.client().chat.completions.create(**kw, extra_body=extra)  # type: ignore[call-overload]
        return str(r.choices[0].message.model_extra.get("reasoning_content") or "")
    parts = []
    for chunk in server.client().chat.completions.create(**kw, stream=True, extra_body=extra):  # type: ignore[call-overload]
        for choice in chunk.choices:
            parts.append((choice.delta.model_extra or {}).get("reasoning_content") or "")
    return "".join(parts)


@pytest.mark.parametrize("key", ["thinking", "enable_thinking"])
def test_chat_template_kwargs_switch_thinking(server: Server, key: str) -> None:
    """vLLM/Qwen clients and gateways that rewrite bodies (smg) switch thinking through chat_template_kwargs."""
    assert _reasoning(server, {}), "thinking is on by default"
    for stream in (False, True):
        assert not _reasoning(server, {"chat_template_kwargs": {key: False}}, stream), (key, stream)
        assert _reasoning(server, {"chat_template_kwargs": {key: True}}, stream), (key, stream)


def test_top_level_thinking_wins_over_chat_template_kwargs(server: Server) -> None:
    off, on = {"type": "disabled"}, {"type": "enabled"}
    assert not _reasoning(server, {"thinking": off, "chat_template_kwargs": {"thinking": True}})
    assert not _reasoning(server, {"thinking": off, "chat_template_kwargs": {"enable_thinking": True}})
    assert _reasoning(server, {"thinking": on, "chat_template_kwargs": {"enable_thinking": False}})
    # `thinking` wins over `enable_thinking` inside the kwargs too
    assert not _reasoning(server, {"chat_template_kwargs": {"thinking": False, "enable_thinking": True}})
    with pytest.raises(openai.BadRequestError) as e:
        _reasoning(server, {"chat_template_kwargs": {"enable_thinking": "yes"}})
    assert e.value.body["param"] == "chat_template_kwargs.enable_thinking"  # type: ignore[index]


def test_models_retrieve_finds_each_served_name_even_with_a_slash(make_server) -> None:
    srv = make_server("--served-model-name", "deepseek-ai/DeepSeek-V4.1-Flash", "flash", "--max-model-len", "8192")
    client = srv.client()
    for name in ("deepseek-ai/DeepSeek-V4.1-Flash", "flash"):
        card = client.models.retrieve(name)
        assert (card.id, card.object, card.model_extra["max_model_len"]) == (name, "model", 8192)
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("other")
    assert e.value.body["code"] == "model_not_found"
