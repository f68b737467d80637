"""Structured outputs and forced tool calls over real HTTP, with real clients: the sim enforces each grammar token by
token (llguidance over its own tokenizer), so every answer is checked against the client's own schema, regex or
tool parameters, never against a fixed text. Thinking on: the reasoning stays free and the answer is constrained."""

from __future__ import annotations

import json
import re
from typing import Any, Literal

import anthropic
import httpx
import jsonschema
import pytest
from conftest import MODEL, Server, sse_events
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, Field

NO_THINK = {"thinking": {"type": "disabled"}}
THINK = {"thinking": {"type": "enabled"}}
ASK = [{"role": "user", "content": "Describe a person as JSON."}]

SHAPES: dict[str, dict[str, Any]] = {
    "nested objects": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "address": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "geo": {
                        "type": "object",
                        "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"],
                        "additionalProperties": False,
                    },
                },
                "required": ["city", "geo"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "arrays with bounds": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"type": "string"}, "minItems": 2, "maxItems": 4},
            "scores": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 3},
        },
        "required": ["tags", "scores"],
        "additionalProperties": False,
    },
    "enums": {
        "type": "object",
        "properties": {
            "color": {"type": "string", "enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "enum": [1, 2, 3]},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "size", "ok"],
        "additionalProperties": False,
    },
    "patterns": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
            "email": {"type": "string", "pattern": "^[a-z]{2,8}@[a-z]{2,8}\\.(com|org)$"},
        },
        "required": ["code", "email"],
        "additionalProperties": False,
    },
    "anyOf with null": {
        "type": "object",
        "properties": {
            "nickname": {"anyOf": [{"type": "string", "maxLength": 12}, {"type": "null"}]},
            "age": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 130}, {"type": "null"}]},
        },
        "required": ["nickname", "age"],
        "additionalProperties": False,
    },
    "refs and definitions": {
        "type": "object",
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


def chat(http: httpx.Client, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "messages": ASK, "max_tokens": 400, **extra}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return dict(r.json())


def json_schema(schema: dict[str, Any], strict: bool = True) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "strict": strict, "schema": schema}}


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("strict", [True, False])
def test_json_schema_shapes_validate(http: httpx.Client, shape: str, strict: bool) -> None:
    schema = SHAPES[shape]
    for seed in range(4):
        think = THINK if seed % 2 else NO_THINK
        d = chat(http, response_format=json_schema(schema, strict), seed=seed, **think)
        choice = d["choices"][0]
        assert choice["finish_reason"] == "stop", d
        jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        if think is THINK:
            reasoning = choice["message"].get("reasoning_content") or ""
            assert reasoning and not reasoning.lstrip().startswith("{"), "the reasoning stays free text"


def test_json_schema_streamed_validates_and_logprobs_spell_it(http: httpx.Client) -> None:
    schema = SHAPES["enums"]
    body = {
        "model": MODEL,
        "messages": ASK,
        "max_tokens": 300,
        "stream": True,
        "seed": 3,
        **THINK,
        "response_format": json_schema(schema),
        "logprobs": True,
        "top_logprobs": 3,
    }
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        events = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    jsonschema.validate(json.loads(content), schema)
    entries = [
        x for e in events if e["choices"] for x in ((e["choices"][0].get("logprobs") or {}).get("content") or [])
    ]
    assert "".join(x["token"] for x in entries) == content
    assert all(x["logprob"] <= 0 and len(x["top_logprobs"]) == 3 for x in entries)


def test_json_object_is_a_json_object(http: httpx.Client) -> None:
    for seed in range(4):
        d = chat(http, response_format={"type": "json_object"}, seed=seed, **(THINK if seed % 2 else NO_THINK))
        assert isinstance(json.loads(d["choices"][0]["message"]["content"]), dict)


def test_regex_matches_in_full(http: httpx.Client) -> None:
    pattern = r"(yes|no), because [a-z ]{5,20}\."
    for seed in range(4):
        d = chat(http, response_format={"type": "regex", "regex": pattern}, seed=seed, **NO_THINK)
        assert re.fullmatch(pattern, d["choices"][0]["message"]["content"]), d["choices"][0]["message"]


# -- the openai SDK's parse, with a pydantic model ----------------------------------------------------------------


class Address(BaseModel):
    city: str
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    role: Literal["admin", "user", "guest"]
    emails: list[str] = Field(max_length=3)
    address: Address
    manager: str | None


@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_openai_parse_with_a_pydantic_model(server: Server, thinking: str) -> None:
    client = server.client()
    for seed in range(3):
        r = client.chat.completions.parse(
            model=MODEL,
            messages=ASK,
            response_format=Person,
            max_tokens=400,
            seed=seed,
            extra_body={"thinking": {"type": thinking}},
        )
        msg = r.choices[0].message
        assert isinstance(msg.parsed, Person), msg
        assert 0 <= msg.parsed.age <= 120 and re.fullmatch(r"[0-9]{5}", msg.parsed.address.zip_code)
        if thinking == "enabled":
            assert getattr(msg, "reasoning_content", None) or (msg.model_extra or {}).get("reasoning_content")


# -- forced and strict tool calls ---------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "hourly": {"type": "boolean"},
    },
    "required": ["city", "days", "unit", "hourly"],
    "additionalProperties": False,
}
SEARCH = {
    "type": "object",
    "properties": {
        "query": {"type": "string"},
        "limit": {"type": "integer"},
        "filters": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    },
    "required": ["query", "limit", "filters"],
    "additionalProperties": False,
}


def tools(strict: bool) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER, "strict": strict}},
        {"type": "function", "function": {"name": "search", "parameters": SEARCH, "strict": strict}},
    ]


PARAMS = {"get_weather": WEATHER, "search": SEARCH}


def check_calls(calls: list[dict[str, Any]], only: str | None = None) -> None:
    assert calls, "a forced choice always calls a tool"
    for call in calls:
        name = call["function"]["name"]
        assert name in PARAMS and (only is None or name == only)
        jsonschema.validate(json.loads(call["function"]["arguments"]), PARAMS[name])


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("thinking", ["enabled", "disabled"])
def test_tool_choice_required_and_named(http: httpx.Client, strict: bool, thinking: str) -> None:
    msgs = [{"role": "user", "content": "What should I do today?"}]
    for seed in range(3):
        for choice, only in (("required", None), ({"type": "function", "function": {"name": "search"}}, "search")):
            d = chat(
                http, messages=msgs, tools=tools(strict), tool_choice=choice, seed=seed, thinking={"type": thinking}
            )
            c = d["choices"][0]
            assert c["finish_reason"] == "tool_calls", c
            check_calls(c["message"]["tool_calls"], only)
    one = chat(http, messages=msgs, tools=tools(strict), tool_choice="required", parallel_tool_calls=False, seed=1)
    assert len(one["choices"][0]["message"]["tool_calls"]) == 1


def test_strict_tools_with_auto_hold_calls_to_their_schema(http: httpx.Client) -> None:
    """With "auto" the model may answer in text; when it calls a strict tool, the call matches the tool."""
    called = 0
    for seed in range(6):
        d = chat(http, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools(True), seed=seed)
        calls = d["choices"][0]["message"].get("tool_calls") or []
        if calls:
            called += 1
            check_calls(calls)
    assert called, "the sim calls a tool it is offered"


def test_anthropic_any_and_tool_are_forced(server: Server) -> None:
    c = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    weather = {"name": "get_weather", "description": "Weather.", "input_schema": WEATHER}
    search = {"name": "search", "description": "Search.", "input_schema": SEARCH}
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}):
        for choice, only in (({"type": "any"}, None), ({"type": "tool", "name": "search"}, "search")):
            m = c.messages.create(
                model=MODEL,
                max_tokens=600,
                tools=[weather, search],  # type: ignore[list-item]
                tool_choice=choice,  # type: ignore[arg-type]
                thinking=thinking,  # type: ignore[arg-type]
                messages=[{"role": "user", "content": "Help me."}],
            )
            uses = [b for b in m.content if b.type == "tool_use"]
            assert m.stop_reason == "tool_use" and uses, m
            for u in uses:
                assert only is None or u.name == only
                jsonschema.validate(u.input, PARAMS[u.name])


def test_responses_text_format_and_tool_choice(server: Server) -> None:
    client = server.client()
    schema = SHAPES["enums"]
    r = client.responses.create(
        model=MODEL,
        input="Pick a color.",
        text={"format": {"type": "json_schema", "name": "pick", "schema": schema, "strict": True}},
        max_output_tokens=400,
    )
    jsonschema.validate(json.loads(r.output_text), schema)
    r = client.responses.create(
        model=MODEL,
        input="Help me.",
        tools=[{"type": "function", "name": "search", "parameters": SEARCH, "strict": True}],
        tool_choice="required",
        max_output_tokens=400,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and all(c.name == "search" for c in calls)
    for call in calls:
        jsonschema.validate(json.loads(call.arguments), SEARCH)


# -- LangChain ----------------------------------------------------------------------------------------------------


class Movie(BaseModel):
    """A movie."""

    title: str
    year: int = Field(ge=1900, le=2030)
    genre: Literal["drama", "comedy", "horror"]


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_langchain_with_structured_output(server: Server, method: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=f"{server.url}/v1", api_key="unused", max_retries=0, max_tokens=400, seed=4)  # type: ignore[arg-type]
    prompt = "Name a movie. Answer in JSON with title, year and genre."
    if method == "json_mode":
        out = llm.with_structured_output(Movie.model_json_schema(), method="json_mode").invoke(prompt)
        assert isinstance(out, dict)
    else:
        movie = llm.with_structured_output(Movie, method=method).invoke(prompt)  # type: ignore[arg-type]
        assert isinstance(movie, Movie) and 1900 <= movie.year <= 2030


# -- a property: the sim's output validates for generated small schemas -------------------------------------------

_leaf = st.one_of(
    st.just({"type": "string"}),
    st.builds(
        lambda lo, extra: {"type": "string", "minLength": lo, "maxLength": lo + extra},
        st.integers(0, 3),
        st.integers(0, 6),
    ),
    st.just({"type": "integer"}),
    st.builds(
        lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
        st.integers(-50, 50),
        st.integers(0, 100),
    ),
    st.just({"type": "number"}),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.lists(st.sampled_from(["a", "b", "c", "dd", "e f"]), min_size=1, max_size=4, unique=True).map(
        lambda v: {"type": "string", "enum": v}
    ),
    st.sampled_from(["^[a-z]{2,5}$", "^[0-9]{3}$", "^(x|y)+$"]).map(lambda p: {"type": "string", "pattern": p}),
)


def _objects(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    names = st.lists(st.sampled_from(["a", "b", "c", "d", "e"]), min_size=1, max_size=3, unique=True)

    def build(keys: list[str], values: list[dict[str, Any]], n_required: int) -> dict[str, Any]:
        props = dict(zip(keys, values, strict=False))
        return {
            "type": "object",
            "properties": props,
            "required": list(props)[:n_required],
            "additionalProperties": False,
        }

    return st.one_of(
        st.builds(build, names, st.lists(children, min_size=3, max_size=3), st.integers(0, 3)),
        st.builds(
            lambda it, lo, extra: {"type": "array", "items": it, "minItems": lo, "maxItems": lo + extra},
            children,
            st.integers(0, 2),
            st.integers(0, 2),
        ),
        st.builds(lambda a, b: {"anyOf": [a, b]}, children, children),
    )


SCHEMAS = st.recursive(_leaf, _objects, max_leaves=6)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=SCHEMAS, seed=st.integers(0, 2**16))
def test_generated_schemas_validate(http: httpx.Client, schema: dict[str, Any], seed: int) -> None:
    d = chat(http, response_format=json_schema(schema, strict=False), seed=seed, max_tokens=600, **NO_THINK)
    choice = d["choices"][0]
    assert choice["finish_reason"] == "stop", (schema, choice)
    jsonschema.validate(json.loads(choice["message"]["content"]), schema)
