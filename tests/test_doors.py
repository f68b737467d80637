"""The Anthropic Messages and OpenAI Responses doors over real HTTP, through the SDKs users bring (`anthropic`,
`openai`, the Agents SDK). Every body and event they read is also checked by the wire fixture (conftest):
Messages against the anthropic SDK's own types, strictly; Responses against OpenAI's published schema."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from test_load_faults import metric

WEATHER_A = {
    "name": "get_weather",
    "description": "Weather for a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
WEATHER_R = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ASK = "What is the weather in Paris?"


def claude(srv: Server, key: str = "unused", **kw: Any) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.url, api_key=key, max_retries=0, **kw)


# ------------------------------------------------------------------------------------------------- Messages


def test_messages_create_and_count_tokens(server: Server) -> None:
    c = claude(server)
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "system": "Be brief"}
    m = c.messages.create(max_tokens=40, extra_body={"ignore_eos": True}, **body)  # the sim's EOS may come sooner
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 40
    assert m.content[0].type == "text", "Anthropic's API thinks only when asked (test_agents.py has the rest)"
    counted = c.messages.count_tokens(**body)
    assert counted.input_tokens == m.usage.input_tokens > 0
    off = c.messages.create(max_tokens=12, thinking={"type": "disabled"}, **body)
    assert [b.type for b in off.content] == ["text"] and off.content[0].text  # type: ignore[union-attr]
    budget = c.messages.create(max_tokens=60, thinking={"type": "enabled", "budget_tokens": 1024}, **body)
    assert budget.content[0].type == "thinking" and budget.content[0].thinking  # type: ignore[union-attr]


def test_messages_stream_text_and_final_message(server: Server) -> None:
    c = claude(server)
    with c.messages.stream(
        model=MODEL,
        max_tokens=30,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": "Tell me about rivers"}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text and final.content[0].text == text  # type: ignore[union-attr]
    assert final.stop_reason in ("max_tokens", "end_turn") and 0 < final.usage.output_tokens <= 30
    assert final.stop_reason == "end_turn" or final.usage.output_tokens == 30


def test_messages_tool_use_round_trip(server: Server) -> None:
    c = claude(server)
    history: list[Any] = [{"role": "user", "content": ASK}]
    m = c.messages.create(model=MODEL, max_tokens=200, tools=[WEATHER_A], messages=history)
    calls = [b for b in m.content if b.type == "tool_use"]
    assert m.stop_reason == "tool_use" and len(calls) == 1, m.content
    assert calls[0].name == "get_weather" and calls[0].input == {"city": "Paris"}
    history += [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id, "content": "18 C, sunny"}]},
    ]
    answer = c.messages.create(
        model=MODEL, max_tokens=40, tools=[WEATHER_A], messages=history, thinking={"type": "disabled"}
    )
    assert not [b for b in answer.content if b.type == "tool_use"], "the tool result is answered, not called again"
    assert any(b.type == "text" and b.text for b in answer.content)


def test_messages_claude_code_shaped_request(server: Server) -> None:
    """System blocks with cache_control, tools, a thinking budget, metadata and the beta header, as Claude Code
    sends them; streamed, as it reads them."""
    c = claude(server, default_headers={"anthropic-beta": "interleaved-thinking-2025-05-14"})
    with c.messages.stream(
        model=MODEL,
        max_tokens=300,
        system=[
            {"type": "text", "text": "You are Claude Code.", "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Be terse.", "cache_control": {"type": "ephemeral"}},
        ],
        tools=[{**WEATHER_A, "cache_control": {"type": "ephemeral"}}],
        thinking={"type": "enabled", "budget_tokens": 2048},
        metadata={"user_id": "user_abc"},
        extra_body={"temperature": 1, "top_k": 40},  # this SDK version has no temperature argument
        stop_sequences=["</answer>"],
        messages=[{"role": "user", "content": [{"type": "text", "text": ASK, "cache_control": {"type": "ephemeral"}}]}],
    ) as stream:
        final = stream.get_final_message()
    kinds = [b.type for b in final.content]
    assert kinds[0] == "thinking" and "tool_use" in kinds and final.stop_reason == "tool_use", kinds


@pytest.mark.parametrize("stream", [False, True])
def test_ignore_eos_gives_exact_lengths_on_every_door(server: Server, stream: bool) -> None:
    """vLLM's ignore_eos on Messages and Responses too: benchmark clients need answers of an exact length, and the
    usage counts every generated token (the EOS ones kept out of the text included)."""
    c = claude(server)
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 300}
    if stream:
        with c.messages.stream(**body, extra_body={"ignore_eos": True}) as s:
            m = s.get_final_message()
    else:
        m = c.messages.create(**body, extra_body={"ignore_eos": True})
    assert m.usage.output_tokens == 300 and m.stop_reason == "max_tokens"
    oa = server.client()
    ask: dict[str, Any] = {"model": MODEL, "input": "x", "max_output_tokens": 300, "extra_body": {"ignore_eos": True}}
    if stream:
        with oa.responses.stream(**ask) as s:
            events = list(s)
        usage = events[-1].response.usage  # type: ignore[union-attr]
    else:
        usage = oa.responses.create(**ask).usage
    assert usage is not None and usage.output_tokens == 300 and usage.total_tokens == usage.input_tokens + 300


def test_messages_stop_sequences(server: Server) -> None:
    c = claude(server)
    body: dict[str, Any] = {"model": MODEL, "thinking": {"type": "disabled"}, "extra_body": {"temperature": 0}}
    body["messages"] = [{"role": "user", "content": "Stop test"}]
    full = c.messages.create(max_tokens=40, **body).content[0].text  # type: ignore[union-attr]
    word = full.split()[3]
    cut = c.messages.create(max_tokens=40, stop_sequences=[word], **body)
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == word
    assert word not in cut.content[0].text  # type: ignore[union-attr]


def test_messages_errors_use_anthropic_envelope(server: Server, make_server: Any) -> None:
    c = claude(server)
    with pytest.raises(anthropic.NotFoundError) as nf:
        c.messages.create(model="nope", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert nf.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        c.messages.create(model=MODEL, max_tokens=5, messages=[])
    assert bad.value.body["type"] == "error"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as unknown:
        c.messages.create(
            model=MODEL,
            max_tokens=5,
            tools=[WEATHER_A],
            tool_choice={"type": "tool", "name": "not_a_tool"},
            messages=[{"role": "user", "content": "x"}],
        )
    assert "not_a_tool" in unknown.value.body["error"]["message"]  # type: ignore[index]
    keyed = make_server("--api-key", "k")
    with pytest.raises(anthropic.AuthenticationError) as auth:
        claude(keyed, key="wrong").messages.create(
            model=MODEL, max_tokens=5, messages=[{"role": "user", "content": "x"}]
        )
    assert auth.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    ok = claude(keyed, key="k").messages.create(model=MODEL, max_tokens=3, messages=[{"role": "user", "content": "x"}])
    assert ok.usage.output_tokens == 3, "x-api-key (the anthropic SDK's header) authenticates"


# ------------------------------------------------------------------------------------------------- Responses


def test_responses_create_and_stream(server: Server) -> None:
    c = server.client()
    r = c.responses.create(
        model=MODEL, input="Hello", instructions="Be brief", max_output_tokens=30, extra_body={"ignore_eos": True}
    )
    assert r.id.startswith("resp_") and r.status == "incomplete" and r.instructions == "Be brief"
    assert r.usage is not None and r.usage.output_tokens == 30 and r.usage.input_tokens > 0
    assert r.usage.output_tokens_details.reasoning_tokens > 0, "thinking is on by default and its tokens are counted"
    done = c.responses.create(model=MODEL, input="Hello", reasoning={"effort": "low"}, max_output_tokens=400)
    assert done.status == "completed" and done.output_text
    # ignore_eos: the sim's unseeded answer may otherwise end before 50 tokens (then "completed", not "incomplete").
    rivers = {"model": MODEL, "input": "Tell me about rivers", "max_output_tokens": 50}
    with c.responses.stream(**rivers, extra_body={"ignore_eos": True}) as stream:  # type: ignore[arg-type]
        kinds = [ev.type for ev in stream]
    assert kinds[0] == "response.created" and kinds[-1] == "response.incomplete", kinds
    assert "response.reasoning_text.delta" in kinds
    with c.responses.stream(model=MODEL, input="Hello", reasoning={"effort": "low"}, max_output_tokens=400) as stream:
        text = "".join(ev.delta for ev in stream if ev.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.status == "completed" and final.output_text == text and text
    assert final.usage is not None and final.usage.output_tokens > 0


def test_responses_function_call_round_trip(server: Server) -> None:
    c = server.client()
    r = c.responses.create(model=MODEL, input=ASK, tools=[WEATHER_R], max_output_tokens=300)  # type: ignore[list-item]
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", r.output
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    follow = [
        {"role": "user", "content": ASK},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "18 C, sunny"},
    ]
    answer = c.responses.create(model=MODEL, input=follow, tools=[WEATHER_R], max_output_tokens=300)  # type: ignore[arg-type,list-item]
    assert not [i for i in answer.output if i.type == "function_call"] and answer.output_text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"conversation": "conv_1", "previous_response_id": "resp_1"}, "conversation"),
        ({"background": True, "store": False}, "background"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ],
)
def test_responses_refuse_what_they_cannot_do_in_words(server: Server, extra: dict[str, Any], param: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        server.client().responses.create(model=MODEL, input="hi", **extra)
    assert e.value.body["param"] == param, e.value.body  # type: ignore[index]


# ------------------------------------------------------------------------------------------------- Agents SDK


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_agents_sdk_loop_with_a_function_tool(server: Server, api: str) -> None:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # the tracer would export to OpenAI's servers
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Weather for a city."""
        calls.append(city)
        return f"18 C and sunny in {city}"

    async def run() -> Any:
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
            model_cls = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
            model = model_cls(MODEL, client)
            agent = Agent(name="weather", instructions="Answer briefly.", tools=[get_weather], model=model)
            return await Runner.run(agent, ASK, max_turns=4)

    result = asyncio.run(run())
    assert calls == ["Paris"], "the agent called the tool once, with the model's arguments"
    assert isinstance(result.final_output, str) and result.final_output


# ------------------------------------------------------------------------------------------------- every door


@pytest.fixture
def slow(make_server: Any) -> Iterator[Server]:
    """One slot, 300 ms steps: a request holds the server for a while."""
    yield make_server("--dp", "1", "--max-num-seqs", "1", "--sim-decode-step-ms", "300")


DOORS = {
    "completions": ("/v1/completions", {"max_tokens": 2000, "prompt": "x", "ignore_eos": True}),
    "messages": ("/v1/messages", {"max_tokens": 2000, "messages": [{"role": "user", "content": "x"}]}),
    "responses": ("/v1/responses", {"max_output_tokens": 2000, "input": "x"}),
}


@pytest.mark.parametrize("door", sorted(DOORS))
def test_429_before_any_byte_and_disconnect_aborts(slow: Server, door: str) -> None:
    path, body = DOORS[door]
    body = {"model": MODEL, "stream": True, **body}
    host, port = slow.url.removeprefix("http://").split(":")
    raw = json.dumps(body).encode()
    # The first stream over a plain socket: it stays open, unread, until the test closes it.
    with socket.create_connection((host, int(port)), timeout=30) as s:
        head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
        head += "\r\n"
        s.sendall(head.encode() + raw)
        first = s.recv(65536)
        assert first.startswith(b"HTTP/1.1 200") and b"text/event-stream" in first, first[:200]
        busy = httpx.post(f"{slow.url}{path}", json=body, timeout=30)
        assert busy.status_code == 429 and busy.headers["retry-after"], busy.text
        assert busy.json()["error"]["type"] == "rate_limit_error"  # both envelopes name it so
    # The first stream's client is gone: its request is aborted on its rank and its slot frees.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and sum(metric(slow.url, "vllm:num_requests_running")) > 0:
        time.sleep(0.05)
    assert sum(metric(slow.url, "vllm:num_requests_running")) == 0
    assert sum(metric(slow.url, "deepinfer_aborted_requests_total", reason="client_disconnect")) == 1
    again = httpx.post(f"{slow.url}{path}", json={**body, "stream": False, **_short(door)}, timeout=30)
    assert again.status_code == 200


def _short(door: str) -> dict[str, int]:
    return {"max_output_tokens": 3} if door == "responses" else {"max_tokens": 3}


# ------------------------------------------------------------------------------------------------- Completions


def tokenize(srv: Server, **body: Any) -> list[int]:
    r = httpx.post(f"{srv.url}/tokenize", json=body, timeout=30)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert doc["count"] == len(doc["tokens"]) and doc["max_model_len"] > 0
    return list(doc["tokens"])


def test_completions_create_streamed_and_not(server: Server) -> None:
    c = server.client()
    r = c.completions.create(model=MODEL, prompt="def add(a, b):", max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.id.startswith("cmpl-") and r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 12 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tokenize(server, prompt="def add(a, b):"))
    chunks = list(
        c.completions.create(
            model=MODEL,
            prompt=["def add(a, b):"],
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    ids = c.completions.create(model=MODEL, prompt=[0, 5, 6, 7], max_tokens=3, echo=True)
    assert ids.usage is not None and ids.usage.prompt_tokens == 4
    assert ids.choices[0].text.startswith("<｜begin▁of▁sentence｜>"), "echo gives the prompt back first"


def test_completions_fill_in_the_middle(server: Server) -> None:
    c = server.client()
    prefix, suffix = "def add(a, b):\n    ", "\n    return total"
    for stream in (False, True):
        body: dict[str, Any] = {"model": MODEL, "prompt": prefix, "suffix": suffix, "max_tokens": 6}
        if stream:
            chunks = list(c.completions.create(**body, stream=True, stream_options={"include_usage": True}))
            usage = chunks[-1].usage
        else:
            usage = c.completions.create(**body).usage
        want = len(tokenize(server, prompt=prefix)) + len(tokenize(server, prompt=suffix, add_special_tokens=False)) + 3
        assert usage is not None and usage.prompt_tokens == want, "BOS, fim begin, prefix, fim hole, suffix, fim end"


def test_completions_stop_special_text_and_refusals(server: Server) -> None:
    c = server.client()
    body: dict[str, Any] = {"model": MODEL, "prompt": "Once", "max_tokens": 40, "temperature": 0}
    full = c.completions.create(**body).choices[0].text
    word = full.split()[2]
    cut = c.completions.create(**body, stop=[word])
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == full[: full.index(word)]
    special = c.completions.create(model=MODEL, prompt="<｜User｜>", max_tokens=1)
    assert special.usage is not None and special.usage.prompt_tokens == len(tokenize(server, prompt="<｜User｜>")) > 2
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt="x", max_tokens=3, logprobs=21)
    assert e.value.body["param"] == "logprobs"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=3)
    assert e.value.body["param"] == "prompt"  # type: ignore[index]


@pytest.mark.parametrize("prompt", ["regex", "strict", "json_schema", "json_object"])
def test_completions_whose_prompt_spells_a_grammar_mark_are_served(server: Server, prompt: str) -> None:
    """The front end checks a body that spells a grammar's mark (`"regex"`, `"strict"` ...) for its grammar before
    admission. A Completions request has no grammar: such a prompt must not be read as a chat body (it was refused
    with "missing field `messages`")."""
    r = server.client().completions.create(model=MODEL, prompt=prompt, max_tokens=3, extra_body={"ignore_eos": True})
    assert r.usage is not None and r.usage.completion_tokens == 3


def test_completions_without_fim_tokens_refuse_a_suffix(tmp_path: Any) -> None:
    from deepinfer_server.launcher import BUNDLED_TOKENIZER

    doc = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    doc["added_tokens"] = [t for t in doc["added_tokens"] if "fim" not in t["content"]]
    (tmp_path / "tokenizer.json").write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
    srv = start_server(str(tmp_path), "--served-model-name", MODEL, "--dp", "1")  # MODEL first: the name takes 1+
    try:
        with pytest.raises(openai.BadRequestError) as e:
            srv.client().completions.create(model=MODEL, prompt="a", suffix="b", max_tokens=3)
        assert e.value.body["param"] == "suffix" and "FIM" in e.value.body["message"]  # type: ignore[index]
        assert srv.client().completions.create(model=MODEL, prompt="a", max_tokens=3).usage is not None
    finally:
        srv.stop()


def test_tokenize_counts_what_the_request_reports(server: Server) -> None:
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello there"}]
    r = server.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=1)  # type: ignore[arg-type]
    assert r.usage is not None and len(tokenize(server, messages=messages)) == r.usage.prompt_tokens
    ids = tokenize(server, prompt="hello world")
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}, timeout=30).json()["prompt"]
    assert back == "<｜begin▁of▁sentence｜>hello world"
    bad = httpx.post(f"{server.url}/detokenize", json={"tokens": [10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


# ------------------------------------------------------------------------------------------------- every door

GENERATE = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}),
    "completions": ("/v1/completions", {"prompt": "x", "max_tokens": 3}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": "x", "max_output_tokens": 3}),
}


@pytest.mark.parametrize("door", sorted(GENERATE))
def test_401_and_404_per_door(make_server: Any, door: str) -> None:
    srv = make_server("--api-key", "k", "--dp", "1")
    path, body = GENERATE[door]
    anthropic_door = door == "messages"
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        r = c.post(path, json={"model": MODEL, **body})
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["type"] == ("authentication_error" if anthropic_door else "invalid_request_error")
        auth = {"x-api-key": "k"} if anthropic_door else {"Authorization": "Bearer k"}
        r = c.post(path, json={"model": "nope", **body}, headers=auth)
        assert r.status_code == 404
        assert r.json()["error"]["type"] == ("not_found_error" if anthropic_door else "invalid_request_error")
        assert c.post(path, json={"model": MODEL, **body}, headers=auth).status_code == 200


def test_responses_cut_off_function_call_holds_no_markup(server: Server) -> None:
    """As on chat: a call cut off by max_output_tokens has only model-generated text in its arguments."""
    c = server.client()
    ask: dict[str, Any] = {"model": MODEL, "input": ASK, "tools": [WEATHER_R], "reasoning": {"effort": "none"}}
    whole = next(i for i in c.responses.create(**ask, max_output_tokens=200).output if i.type == "function_call")
    for n in range(24, 40):
        r = c.responses.create(**ask, max_output_tokens=n)
        args = next((i.arguments for i in r.output if i.type == "function_call"), "")
        assert whole.arguments.startswith(args), f"max_output_tokens {n}: {args!r}"
        with c.responses.stream(**ask, max_output_tokens=n) as stream:
            events = list(stream)
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
        assert deltas == args and done in ([], [args]), f"max_output_tokens {n}: {deltas!r} {done!r} {args!r}"
