"""Conversations (issue 31): the Conversations API and `conversation` on a Responses request, judged by the `openai`
SDK and the Agents SDK's `OpenAIConversationsSession`, on both stores (the shared servers of state_servers.py)."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from state_servers import STATE_ARGS


def create(srv: Server, **body: Any) -> Any:
    body = {"model": MODEL, "max_output_tokens": 8, "reasoning": {"effort": "none"}, **body}
    return srv.client().responses.create(**body)


def texts(items: Any) -> list[str]:
    return [i.content[0].text for i in items]


def test_a_conversation_is_created_read_updated_and_deleted(state_srv: Server) -> None:
    c = state_srv.client()
    conv = c.conversations.create(items=[{"role": "user", "content": "hello"}], metadata={"topic": "greetings"})
    assert conv.id.startswith("conv_") and conv.object == "conversation" and conv.metadata == {"topic": "greetings"}
    assert c.conversations.retrieve(conv.id).model_dump() == conv.model_dump()
    updated = c.conversations.update(conv.id, metadata={"topic": "farewells"})
    assert updated.metadata == {"topic": "farewells"} and updated.created_at == conv.created_at
    items = c.conversations.items.list(conv.id)
    assert [(i.type, i.role) for i in items.data] == [("message", "user")]  # type: ignore[union-attr]
    assert texts(items.data) == ["hello"]
    gone = c.conversations.delete(conv.id)
    assert gone.deleted and gone.id == conv.id
    for call in (lambda: c.conversations.retrieve(conv.id), lambda: c.conversations.items.list(conv.id)):
        with pytest.raises(openai.NotFoundError):
            call()


def test_items_are_added_paged_read_and_deleted(state_srv: Server) -> None:
    c = state_srv.client()
    conv = c.conversations.create()
    added = c.conversations.items.create(conv.id, items=[{"role": "user", "content": f"line {i}"} for i in range(5)])
    assert texts(added.data) == [f"line {i}" for i in range(5)] and all(i.id for i in added.data)
    desc = c.conversations.items.list(conv.id, limit=2)
    assert texts(desc.data) == ["line 4", "line 3"] and desc.has_more
    rest = c.conversations.items.list(conv.id, limit=10, after=desc.data[-1].id)
    assert texts(rest.data) == ["line 2", "line 1", "line 0"] and not rest.has_more
    # The SDK's cursor walks every page.
    assert texts(c.conversations.items.list(conv.id, order="asc", limit=2)) == [f"line {i}" for i in range(5)]
    third = added.data[2]
    assert c.conversations.items.retrieve(third.id, conversation_id=conv.id).model_dump() == third.model_dump()
    assert c.conversations.items.delete(third.id, conversation_id=conv.id).id == conv.id
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.retrieve(third.id, conversation_id=conv.id)
    with pytest.raises(openai.NotFoundError):
        c.conversations.items.delete(third.id, conversation_id=conv.id)
    assert texts(c.conversations.items.list(conv.id, order="asc")) == ["line 0", "line 1", "line 3", "line 4"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/conversations", {"items": [{"role": "user", "content": "x"}] * 21}, "items"),
        ("/v1/conversations", {"items": [{"type": "web_search_call", "id": "ws_1"}]}, "items[0]"),
        ("/v1/conversations", {"items": [{"role": "user"}]}, "items[0]"),
        ("/v1/conversations", {"metadata": {"k": 1}}, "metadata"),
        ("/v1/conversations", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ("/v1/conversations", {"metadata": {"k": "v" * 513}}, "metadata"),
        ("/v1/conversations", {"itemz": []}, "itemz"),
        ("/v1/conversations/{id}/items", {}, "items"),
        ("/v1/conversations/{id}", {}, "metadata"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(state_srv: Server, path: str, body: Any, param: str) -> None:
    conv = state_srv.client().conversations.create()
    r = httpx.post(state_srv.url + path.format(id=conv.id), json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    r = httpx.post(
        f"{state_srv.url}/v1/conversations",
        content=b"{not json",
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    r = httpx.get(f"{state_srv.url}/v1/conversations/{conv.id}/items", params={"limit": 101}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "limit", r.text


def test_a_response_in_a_conversation_continues_it_and_adds_to_it(state_srv: Server) -> None:
    c = state_srv.client()
    conv = c.conversations.create(items=[{"role": "user", "content": "My name is Ada."}])
    first = create(state_srv, input="Say hello.", conversation=conv.id)
    assert first.conversation is not None and first.conversation.id == conv.id
    # Its input and output are in the conversation as soon as the client has the response.
    items = list(c.conversations.items.list(conv.id, order="asc"))
    assert [i.type for i in items][:2] == ["message", "message"]
    assert [i.id for i in items][2:] == [o.id for o in first.output]
    second = create(state_srv, input="What is my name?", conversation={"id": conv.id})
    # The same conversation sent whole: the same prompt.
    whole = [i.model_dump(exclude_none=True) for i in items] + [{"role": "user", "content": "What is my name?"}]
    alone = create(state_srv, input=whole, store=False)
    assert second.usage is not None and alone.usage is not None
    assert second.usage.input_tokens == alone.usage.input_tokens
    assert c.responses.retrieve(second.id).conversation.id == conv.id  # type: ignore[union-attr]
    # A streamed response names its conversation from its first event to its last, and adds to it too.
    events = list(
        c.responses.create(model=MODEL, input="More.", max_output_tokens=6, stream=True, conversation=conv.id)
    )
    whole_events = [e for e in events if hasattr(e, "response")]
    assert len(whole_events) >= 3 and all(e.response.conversation.id == conv.id for e in whole_events)  # type: ignore[union-attr]
    after = list(c.conversations.items.list(conv.id, order="asc"))
    assert len(after) == len(items) + 1 + len(second.output) + 1 + len(whole_events[-1].response.output)  # type: ignore[union-attr]


def test_a_conversation_request_that_cannot_be_served_is_a_clear_4xx(state_srv: Server) -> None:
    c = state_srv.client()
    with pytest.raises(openai.NotFoundError) as e:
        create(state_srv, input="x", conversation="conv_missing")
    assert e.value.body["param"] == "conversation"  # type: ignore[index]
    prev = create(state_srv, input="x")
    conv = c.conversations.create()
    with pytest.raises(openai.BadRequestError) as be:
        create(state_srv, input="x", conversation=conv.id, previous_response_id=prev.id)
    assert be.value.body["param"] == "conversation"  # type: ignore[index]
    # `store: false` keeps no response, but the conversation still gains the turn.
    r = create(state_srv, input="not stored", conversation=conv.id, store=False)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(r.id)
    assert texts(c.conversations.items.list(conv.id, order="asc"))[0] == "not stored"


def test_the_agents_sdk_keeps_a_session_in_a_conversation(state_srv: Server) -> None:
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled
    from agents.memory import OpenAIConversationsSession
    from openai import AsyncOpenAI
    from openai.types.shared import Reasoning

    set_tracing_disabled(True)

    async def run() -> tuple[Any, Any, list[Any], str]:
        async with AsyncOpenAI(base_url=f"{state_srv.url}/v1", api_key="unused", max_retries=0) as client:
            agent = Agent(
                name="a",
                instructions="Be brief.",
                model=OpenAIResponsesModel(MODEL, client),
                # No reasoning, and room to finish: the sim's answers are of random length.
                model_settings=ModelSettings(max_tokens=1000, reasoning=Reasoning(effort="none")),
            )
            session = OpenAIConversationsSession(openai_client=client)
            first = await Runner.run(agent, "Remember: blue.", session=session)
            second = await Runner.run(agent, "What did I ask you to remember?", session=session)
            items = await session.get_items()
            popped = await session.pop_item()
            assert popped is not None and popped not in await session.get_items()
            cid = session.session_id
            await session.clear_session()
            return first, second, items, cid

    first, second, items, cid = asyncio.run(run())
    said = [i for i in items if i.get("role") == "user"]
    assert [i["content"][0]["text"] for i in said] == ["Remember: blue.", "What did I ask you to remember?"]
    assert len(items) > 2 and second.context_wrapper.usage.input_tokens > first.context_wrapper.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        state_srv.client().conversations.retrieve(cid)


@pytest.mark.parametrize("state_srv", ["postgresql"], indirect=True)
def test_replicas_on_one_postgresql_store_share_conversations(pg_url: str, state_srv: Server) -> None:
    b = start_server(*STATE_ARGS, "--state-store", pg_url)
    try:
        conv = state_srv.client().conversations.create(items=[{"role": "user", "content": "on replica a"}])
        r = create(b, input="continued on replica b", conversation=conv.id)
        got = texts(state_srv.client().conversations.items.list(conv.id, order="asc"))
        assert got[:2] == ["on replica a", "continued on replica b"] and r.conversation.id == conv.id
    finally:
        b.stop()


def test_with_the_state_store_off_conversations_are_refused() -> None:
    s = start_server(*STATE_ARGS, "--state-store", "off")
    try:
        with pytest.raises(openai.BadRequestError):
            s.client().conversations.create()
        with pytest.raises(openai.BadRequestError) as e:
            create(s, input="x", conversation="conv_1")
        assert e.value.body["param"] == "conversation"  # type: ignore[index]
    finally:
        s.stop()
