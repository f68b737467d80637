"""LangChain on its ordinary paths against every door it speaks: `ChatOpenAI` on Chat Completions and (with
`use_responses_api`) on Responses, `ChatAnthropic` on Messages. Each invokes, streams, and round-trips a tool call
(the sim answers a prompt that offers tools with a well-formed call of one of them)."""

from __future__ import annotations

from typing import Any

import pytest
from conftest import MODEL, Server
from langchain_anthropic import ChatAnthropic
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"Sunny in {city}, 21 C."


def openai_chat(server: Server, **kw: Any) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{server.url}/v1", api_key="unused", model=MODEL, max_retries=0, **kw)  # type: ignore[arg-type]


def anthropic_chat(server: Server, max_tokens: int) -> ChatAnthropic:
    return ChatAnthropic(base_url=server.url, api_key="unused", model=MODEL, max_retries=0, max_tokens=max_tokens)  # type: ignore[arg-type, call-arg]


# Thinking is on (the server's default): the budget leaves room for the reasoning before the answer or the call.
MODELS = {
    "chat": lambda s, n: openai_chat(s, max_tokens=n),
    "responses": lambda s, n: openai_chat(s, use_responses_api=True, max_tokens=n),
    "messages": anthropic_chat,
}


@pytest.mark.parametrize("door", MODELS)
def test_invoke_and_stream(server: Server, door: str) -> None:
    llm = MODELS[door](server, 512)
    reply = llm.invoke([HumanMessage("Tell me about the weather in Paris.")])
    assert isinstance(reply, AIMessage)
    assert reply.text.strip(), reply
    usage = reply.usage_metadata
    assert usage is not None and usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    chunks = list(llm.stream("Tell me about the weather in Paris."))
    assert len(chunks) > 1
    assert "".join(c.text for c in chunks).strip()


@pytest.mark.parametrize("door", MODELS)
def test_a_tool_call_round_trip(server: Server, door: str) -> None:
    llm = MODELS[door](server, 1024).bind_tools([get_weather])
    ask = HumanMessage("What is the weather in Paris? Use the tool.")
    first = llm.invoke([ask])
    assert isinstance(first, AIMessage) and first.tool_calls, first
    (call,) = first.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str), call
    result = ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"])
    # With the tool's result in the last turn, the model answers in words.
    second = llm.invoke([ask, first, result])
    assert isinstance(second, AIMessage) and not second.tool_calls and second.text.strip(), second
