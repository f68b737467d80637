"""Agent frameworks on their ordinary paths (issue 30), run as their users run them, over real HTTP: the Agents SDK's
`output_type` beside tools (strict by default) and a non-strict tool, on its Responses and Chat Completions models;
pydantic-ai's NativeOutput and PromptedOutput with a tool; Anthropic's structured outputs through `messages.parse`
and LangChain's ChatAnthropic; Anthropic client tools written as `"type": "custom"`. Each answer must be valid: a
tool call for the tools, or the schema. What the answer says is the sim's business.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest
from conftest import MODEL, Server, start_server
from pydantic import BaseModel

NO_THINK = {"thinking": {"type": "disabled"}}


class Weather(BaseModel):
    city: str
    summary: str


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server("--served-model-name", MODEL, "--max-num-seqs", "8", "--max-model-len", "8192")
    yield s
    s.stop()


# -- tools and structured output together --------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
CITY = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def tool(name: str, strict: bool, params: dict[str, Any] = CITY) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "strict": strict, "parameters": params}}


def chat(s: Server, **body: Any) -> dict[str, Any]:
    r = httpx.post(
        f"{s.url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "max_tokens": 400, **body},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return dict(r.json())


def messages(s: Server, content: str, **body: Any) -> httpx.Response:
    """A Messages request as it is on the wire (fields the anthropic SDK has no argument for)."""
    json_body = {"model": MODEL, "max_tokens": 400, "messages": [{"role": "user", "content": content}], **body}
    return httpx.post(f"{s.url}/v1/messages", json=json_body, timeout=60)


def answered_or_called(message: dict[str, Any], schema: dict[str, Any] | None, tools: dict[str, Any]) -> str:
    """'call' or 'answer'; fails unless the message is exactly one of a valid tool call or a valid answer."""
    calls = message.get("tool_calls") or []
    if calls:
        assert message["content"] is None, message  # OpenAI sends null beside tool calls, not ""
        for call in calls:
            params = tools[call["function"]["name"]]
            if params is not None:
                jsonschema.validate(json.loads(call["function"]["arguments"]), params)
        return "call"
    answer = json.loads(message["content"])
    if schema is not None:
        jsonschema.validate(answer, schema)
    else:
        assert isinstance(answer, dict)
    return "answer"


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_strict_tools_beside_a_json_schema_give_a_call_or_the_schema(srv: Server, thinking: str) -> None:
    """OpenAI accepts strict tools with `response_format` (deepseek-recipe refuses it; the Agents SDK sends it for
    every agent with tools and an output_type): the output is a valid call or a valid answer, never neither."""
    kinds = set()
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    tools = [tool("get_weather", True), tool("lookup", False)]
    for seed in range(4):
        d = chat(srv, tools=tools, response_format=rf, seed=seed, thinking={"type": thinking})
        kinds.add(answered_or_called(d["choices"][0]["message"], SCHEMA, {"get_weather": CITY, "lookup": None}))
    # After the tool's result, the sim answers: in the schema.
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]
    d = chat(srv, messages=history, tools=tools, response_format=rf, **NO_THINK)
    assert answered_or_called(d["choices"][0]["message"], SCHEMA, {"get_weather": CITY, "lookup": None}) == "answer"
    assert "call" in kinds


def test_a_forced_choice_beside_a_schema_is_only_the_call(srv: Server) -> None:
    rf = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}
    d = chat(srv, tools=[tool("get_weather", True)], tool_choice="required", response_format=rf, **NO_THINK)
    message = d["choices"][0]["message"]
    assert d["choices"][0]["finish_reason"] == "tool_calls", d
    assert answered_or_called(message, SCHEMA, {"get_weather": CITY}) == "call"


def test_strict_and_non_strict_tools_in_one_request(srv: Server) -> None:
    """A call to the strict tool is held to its schema; one to the non-strict tool is free; both are served."""
    strict_params = {
        "type": "object",
        "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["days"],
        "additionalProperties": False,
    }
    tools = [tool("forecast", True, strict_params), tool("lookup", False)]
    names = set()
    for seed in range(6):
        d = chat(srv, tools=tools, seed=seed, **NO_THINK)
        for call in d["choices"][0]["message"].get("tool_calls") or []:
            names.add(call["function"]["name"])
            if call["function"]["name"] == "forecast":
                jsonschema.validate(json.loads(call["function"]["arguments"]), strict_params)
    assert names, "no tool was called in six tries"


def test_responses_text_format_beside_strict_tools(srv: Server) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": CITY, "strict": True}]
    fmt = {"type": "json_schema", "name": "w", "schema": SCHEMA, "strict": True}
    r = httpx.post(
        f"{srv.url}/v1/responses",
        json={"model": MODEL, "input": "weather?", "tools": tools, "text": {"format": fmt}, "max_output_tokens": 400},
        timeout=60,
    )
    assert r.status_code == 200, r.text
    out = r.json()["output"]
    calls = [i for i in out if i["type"] == "function_call"]
    texts = [c["text"] for i in out if i["type"] == "message" for c in i["content"] if c["type"] == "output_text"]
    if calls:
        jsonschema.validate(json.loads(calls[0]["arguments"]), CITY)
    else:
        jsonschema.validate(json.loads(texts[0]), SCHEMA)


def test_a_regex_format_beside_tools_is_refused_naming_it(srv: Server) -> None:
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool("get_weather", True)],
            "response_format": {"type": "regex", "regex": "[a-z]+"},
        },
        timeout=60,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


# -- the Agents SDK ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("api", ["responses", "chat_completions"])
def test_agents_sdk_output_type_with_a_strict_and_a_non_strict_tool(srv: Server, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the weather of a city."""
        calls.append(f"get_weather {city}")
        return f"sunny in {city}"

    @function_tool(strict_mode=False)
    def lookup(term: str) -> str:
        """Look a term up."""
        calls.append(f"lookup {term}")
        return f"{term}: a word"

    client = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", max_retries=0)
    model = OpenAIResponsesModel(MODEL, client) if api == "responses" else OpenAIChatCompletionsModel(MODEL, client)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather, lookup],
        output_type=Weather,
        model=model,
        model_settings=ModelSettings(max_tokens=400),
    )

    async def run() -> Any:
        async with client:
            return await Runner.run(agent, "What is the weather in Paris?", max_turns=5)

    result = asyncio.run(run())
    assert isinstance(result.final_output, Weather)
    assert calls, "the agent never called a tool"


# -- pydantic-ai -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["native", "prompted"])
@pytest.mark.parametrize("api", ["chat", "responses"])
def test_pydantic_ai_output_with_a_tool(srv: Server, mode: str, api: str) -> None:
    """NativeOutput sends the schema (json_schema); PromptedOutput only json_object beside its strict tool. Every
    answer must be a valid tool call or a JSON object in the format asked for; with NativeOutput the run ends in the
    schema. (PromptedOutput's object has the sim's words for keys, so pydantic-ai may retry and give up: the sim's
    business, not the server's.)"""
    from pydantic_ai import Agent, NativeOutput, PromptedOutput
    from pydantic_ai.exceptions import UnexpectedModelBehavior
    from pydantic_ai.models.openai import OpenAIChatModel, OpenAIResponsesModel
    from pydantic_ai.providers.openai import OpenAIProvider

    bodies: list[dict[str, Any]] = []

    async def seen(response: httpx.Response) -> None:
        await response.aread()
        bodies.append(response.json())

    from openai import AsyncOpenAI

    http = httpx.AsyncClient(event_hooks={"response": [seen]}, timeout=60)
    client = AsyncOpenAI(base_url=f"{srv.url}/v1", api_key="unused", http_client=http, max_retries=0)
    provider = OpenAIProvider(openai_client=client)
    model = (OpenAIChatModel if api == "chat" else OpenAIResponsesModel)(MODEL, provider=provider)
    output = NativeOutput(Weather) if mode == "native" else PromptedOutput(Weather)
    agent = Agent(model, output_type=output)

    @agent.tool_plain
    def population(city: str) -> int:
        """Population of a city."""
        return 1000

    async def run() -> None:
        async with http:  # its connections closed inside the run's event loop
            try:
                result = await agent.run("Weather in Paris?", model_settings={"max_tokens": 400})
                assert isinstance(result.output, Weather)
            except UnexpectedModelBehavior:
                assert mode == "prompted", "NativeOutput's answer is held to the schema: it cannot fail validation"

    asyncio.run(run())
    assert bodies
    for body in bodies:
        if api == "chat":
            message = body["choices"][0]["message"]
            answered_or_called(message, Weather.model_json_schema() if mode == "native" else None, {"population": None})
        else:
            items = body["output"]
            if not any(i["type"] == "function_call" for i in items):
                text = next(c["text"] for i in items if i["type"] == "message" for c in i["content"])
                assert isinstance(json.loads(text), dict)


# -- Anthropic ---------------------------------------------------------------------------------------------------------


def test_the_anthropic_quickstart_gets_text_first(srv: Server) -> None:
    """Anthropic's API thinks only when asked: `content[0].text` is the quickstart's first line."""
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    msg = client.messages.create(model=MODEL, max_tokens=50, messages=[{"role": "user", "content": "Hello"}])
    assert msg.content[0].type == "text" and msg.content[0].text
    asked = client.messages.create(
        model=MODEL,
        max_tokens=300,
        messages=[{"role": "user", "content": "Hello"}],
        thinking={"type": "enabled", "budget_tokens": 100},
    )
    assert asked.content[0].type == "thinking"
    adaptive = messages(srv, "Hi", max_tokens=300, thinking={"type": "adaptive"})
    assert adaptive.status_code == 200 and adaptive.json()["content"][0]["type"] == "thinking", adaptive.text


def test_a_served_name_that_pins_thinking_on_still_thinks_on_messages(make_server: Any) -> None:
    s: Server = make_server("--served-model-name", "deepseek-reasoner=thinking")
    client = anthropic.Anthropic(base_url=s.url, api_key="x", max_retries=0)
    msg = client.messages.create(
        model="deepseek-reasoner", max_tokens=300, messages=[{"role": "user", "content": "Hello"}]
    )
    assert msg.content[0].type == "thinking"


def test_anthropic_messages_parse_and_output_config(srv: Server) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    parsed = client.messages.parse(
        model=MODEL, max_tokens=400, messages=[{"role": "user", "content": "Weather in Oslo?"}], output_format=Weather
    )
    assert isinstance(parsed.parsed_output, Weather)
    # The deprecated beta field is enforced the same way.
    r = messages(srv, "Weather?", output_format={"type": "json_schema", "schema": SCHEMA})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["content"][0]["text"]), SCHEMA)


def test_langchain_chat_anthropic_with_structured_output(srv: Server) -> None:
    from langchain_anthropic import ChatAnthropic

    llm = ChatAnthropic(model=MODEL, base_url=srv.url, api_key="x", max_tokens=400)  # type: ignore[call-arg]
    out = llm.with_structured_output(Weather, method="json_schema").invoke("Weather in Oslo?")
    assert isinstance(out, Weather)


@pytest.mark.parametrize(
    ("schema", "said"),
    [
        ({"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}, "'minimum'"),
        ({"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}}, "'maxLength'"),
        ({"type": "object", "additionalProperties": True}, "'additionalProperties'"),
        (
            {"$defs": {"n": {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}}}, "$ref": "#/$defs/n"},
            "recursive",
        ),
    ],
)
def test_anthropic_schema_limits_are_refused_in_its_envelope(srv: Server, schema: dict[str, Any], said: str) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL,
            max_tokens=50,
            messages=[{"role": "user", "content": "hi"}],
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )
    body = e.value.body
    assert isinstance(body, dict) and body["type"] == "error", body
    assert body["error"]["type"] == "invalid_request_error" and said in body["error"]["message"], body


def test_anthropic_custom_tools_are_client_tools_and_server_tools_are_named(srv: Server) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    custom = {
        "type": "custom",
        "name": "get_weather",
        "input_schema": CITY,
    }
    msg = client.messages.create(
        model=MODEL,
        max_tokens=300,
        messages=[{"role": "user", "content": "weather?"}],
        tools=[custom],  # type: ignore[list-item]
        tool_choice={"type": "any"},
    )
    uses = [b for b in msg.content if b.type == "tool_use"]
    assert uses and uses[0].name == "get_weather"
    jsonschema.validate(uses[0].input, CITY)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model=MODEL,
            max_tokens=50,
            messages=[{"role": "user", "content": "hi"}],
            tools=[custom, {"type": "web_search_20250305", "name": "web_search"}],  # type: ignore[list-item]
        )
    message = e.value.body["error"]["message"]  # type: ignore[index]
    assert "web_search_20250305" in message and "get_weather" not in message, message


def test_anthropic_output_format_beside_tools(srv: Server) -> None:
    r = messages(
        srv,
        "weather?",
        tools=[{"name": "get_weather", "input_schema": CITY, "strict": True}],
        output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
    )
    assert r.status_code == 200, r.text
    blocks = r.json()["content"]
    uses = [b for b in blocks if b["type"] == "tool_use"]
    if uses:
        jsonschema.validate(uses[0]["input"], CITY)
    else:
        jsonschema.validate(json.loads(next(b["text"] for b in blocks if b["type"] == "text")), SCHEMA)
