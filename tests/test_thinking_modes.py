"""Operator defaults over real HTTP: the default thinking mode (--default-thinking), served names that pin a mode
(--served-model-name NAME=thinking|no-thinking, as DeepSeek's deepseek-reasoner and deepseek-chat), every name in
/v1/models; and chat prefix completion (DeepSeek's `prefix: true` on the last assistant message)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anthropic
import httpx
from conftest import MODEL, Server

USER = [{"role": "user", "content": "Tell me something."}]


def ask(srv: Server, model: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": USER, "max_tokens": 60, "seed": 3, **extra}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    return dict(r.json()["choices"][0]["message"])


def thinks(message: dict[str, Any]) -> bool:
    return bool(message.get("reasoning_content"))


def test_default_thinking_off_and_pinned_names(make_server: Callable[..., Server]) -> None:
    srv = make_server(
        "--default-thinking",
        "off",
        "--served-model-name",
        MODEL,
        "deepseek-chat=no-thinking",
        "deepseek-reasoner=thinking",
    )
    models = httpx.get(f"{srv.url}/v1/models").json()["data"]
    assert [m["id"] for m in models] == [MODEL, "deepseek-chat", "deepseek-reasoner"]
    assert not thinks(ask(srv, MODEL)), "the operator's default: no thinking"
    assert thinks(ask(srv, MODEL, thinking={"type": "enabled"})), "a request still chooses for itself"
    assert thinks(ask(srv, "deepseek-reasoner")) and thinks(
        ask(srv, "deepseek-reasoner", thinking={"type": "disabled"})
    )
    assert not thinks(ask(srv, "deepseek-chat", thinking={"type": "enabled"}, reasoning_effort="high"))
    # Every door follows the pin.
    c = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
    m = c.messages.create(model="deepseek-reasoner", max_tokens=60, messages=[{"role": "user", "content": "hi"}])
    assert any(b.type == "thinking" for b in m.content)
    m = c.messages.create(
        model="deepseek-chat",
        max_tokens=60,
        messages=[{"role": "user", "content": "hi"}],
        thinking={"type": "enabled", "budget_tokens": 1024},
    )
    assert not any(b.type == "thinking" for b in m.content)
    r = srv.client().responses.create(
        model="deepseek-chat", input="hi", reasoning={"effort": "high"}, max_output_tokens=60
    )
    assert not any(o.type == "reasoning" for o in r.output)
    r = srv.client().responses.create(model="deepseek-reasoner", input="hi", max_output_tokens=60)
    assert any(o.type == "reasoning" for o in r.output)


def test_default_thinking_is_on(server: Server) -> None:
    assert thinks(ask(server, MODEL))


def test_prefix_completion_continues_the_assistant_message(http: httpx.Client) -> None:
    """The answer continues the prefix (DeepSeek returns only the continuation); with thinking on too, the prefix is
    the answer's start, not reasoning."""
    prefix = "Here is a short list:\n1."
    for thinking in ("disabled", "enabled"):
        msgs = [*USER, {"role": "assistant", "content": prefix, "prefix": True}]
        body = {"model": MODEL, "messages": msgs, "max_tokens": 40, "seed": 1, "thinking": {"type": thinking}}
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["content"] and not msg["content"].startswith(prefix)
        assert not msg.get("reasoning_content"), "a prefix continues the answer"
        prompt = http.post("/tokenize", json={"model": MODEL, "messages": msgs}).json()["tokens"]
        plain = http.post("/tokenize", json={"model": MODEL, "messages": USER}).json()["tokens"]
        assert len(prompt) > len(plain), "the prefix is in the prompt"
    bad = [{"role": "assistant", "content": "x", "prefix": True}, *USER]
    r = http.post("/v1/chat/completions", json={"model": MODEL, "messages": bad, "max_tokens": 5})
    assert r.status_code == 400, r.text
