#!/usr/bin/env python3
"""End-to-end smoke test for a running DeepInfer-server (or any OpenAI-compatible Chat Completions server).

    python scripts/smoke.py --base-url http://localhost:8000 [--model NAME] [--api-key KEY] [--timeout S]
                            [--require-tool-call]

Standard library only. Steps (each printed as it passes):
  1. GET /health is 200.
  2. GET /v1/models lists a model (used when --model is not given) with max_model_len.
  3. Non-streaming chat, thinking disabled, max_tokens 64: a chat.completion with an assistant message and
     usage.total_tokens == prompt_tokens + completion_tokens, completion_tokens >= 1.
  4. Streaming chat with stream_options.include_usage: every `data:` line is JSON except the final exact
     `data: [DONE]`; content deltas are assembled; exactly one usage chunk and a finish_reason are seen.
  5. Tool call round with a get_weather(city) function tool and tool_choice "auto": each tool call has an id,
     type "function", the name and JSON arguments; a second request carrying the assistant tool_calls and a
     tool result must get a content reply. A reply without tool calls is a warning (a real model may answer
     directly) unless --require-tool-call is given.

On the first failure prints `SMOKE FAIL: <step>: <message>` to stderr and exits 1; otherwise prints `SMOKE OK`.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

USER_AGENT = "deepinfer-server-smoke/1"
THINKING_OFF = {"type": "disabled"}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "City name, e.g. Paris"}},
            "required": ["city"],
        },
    },
}


class SmokeFail(Exception):
    def __init__(self, step: str, message: str) -> None:
        super().__init__(f"{step}: {message}")
        self.step = step
        self.message = message


def passed(step: str, detail: str) -> None:
    print(f"PASS {step}: {detail}", flush=True)


def warn(step: str, detail: str) -> None:
    print(f"WARN {step}: {detail}", file=sys.stderr, flush=True)


def snippet(data: bytes | str, limit: int = 300) -> str:
    text = data.decode("utf-8", "replace") if isinstance(data, bytes) else data
    return text if len(text) <= limit else text[:limit] + "..."


class Client:
    def __init__(self, base_url: str, api_key: str | None, timeout: float) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout

    def _request(self, method: str, path: str, body: dict[str, Any] | None) -> urllib.request.Request:
        headers = {"User-Agent": USER_AGENT, "Accept": "application/json, text/event-stream"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return urllib.request.Request(self.base_url + path, data=data, headers=headers, method=method)

    def open(self, step: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """Send the request; return the open response (status 200) or raise SmokeFail."""
        req = self._request(method, path, body)
        try:
            resp = urllib.request.urlopen(req, timeout=self.timeout)
        except urllib.error.HTTPError as e:
            raise SmokeFail(step, f"{method} {path} returned HTTP {e.code}: {snippet(e.read())}") from e
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise SmokeFail(step, f"{method} {path} failed: {reason}") from e
        if resp.status != 200:
            body_text = snippet(resp.read())
            resp.close()
            raise SmokeFail(step, f"{method} {path} returned HTTP {resp.status}, expected 200: {body_text}")
        return resp

    def json(self, step: str, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        with self.open(step, method, path, body) as resp:
            try:
                raw = resp.read()
            except OSError as e:
                raise SmokeFail(step, f"reading the response of {method} {path} failed: {e}") from e
        try:
            return json.loads(raw)
        except ValueError as e:
            raise SmokeFail(step, f"{method} {path} did not return JSON: {snippet(raw)}") from e


def check_usage(step: str, usage: Any) -> str:
    if not isinstance(usage, dict):
        raise SmokeFail(step, f"usage missing or not an object: {usage!r}")
    fields = ("prompt_tokens", "completion_tokens", "total_tokens")
    for f in fields:
        v = usage.get(f)
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise SmokeFail(step, f"usage.{f} is not a non-negative integer: {usage!r}")
    p, c, t = (usage[f] for f in fields)
    if t != p + c:
        raise SmokeFail(step, f"usage.total_tokens {t} != prompt_tokens {p} + completion_tokens {c}")
    if c < 1:
        raise SmokeFail(step, f"usage.completion_tokens is {c}, expected >= 1")
    if p < 1:
        raise SmokeFail(step, f"usage.prompt_tokens is {p}, expected >= 1")
    return f"usage prompt={p} completion={c} total={t}"


def first_choice(step: str, resp: Any) -> dict[str, Any]:
    if not isinstance(resp, dict):
        raise SmokeFail(step, f"response is not an object: {snippet(json.dumps(resp))}")
    if "error" in resp and "choices" not in resp:
        raise SmokeFail(step, f"server returned an error: {snippet(json.dumps(resp['error']))}")
    if resp.get("object") != "chat.completion":
        raise SmokeFail(step, f"object is {resp.get('object')!r}, expected 'chat.completion'")
    choices = resp.get("choices")
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise SmokeFail(step, f"expected exactly one choice, got {snippet(json.dumps(choices))}")
    message = choices[0].get("message")
    if not isinstance(message, dict) or message.get("role") != "assistant":
        raise SmokeFail(step, f"choices[0].message is not an assistant message: {snippet(json.dumps(message))}")
    return choices[0]


def step_health(client: Client) -> None:
    step = "health"
    with client.open(step, "GET", "/health") as resp:
        resp.read()
    passed(step, "GET /health -> 200")


def step_models(client: Client, wanted: str | None) -> str:
    step = "models"
    resp = client.json(step, "GET", "/v1/models")
    data = resp.get("data") if isinstance(resp, dict) else None
    if not isinstance(data, list) or not data:
        raise SmokeFail(step, f"/v1/models lists no model: {snippet(json.dumps(resp))}")
    ids = [m.get("id") for m in data if isinstance(m, dict)]
    if wanted is None:
        entry = data[0]
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str) or not entry["id"]:
            raise SmokeFail(step, f"data[0] has no id: {snippet(json.dumps(entry))}")
    else:
        matches = [m for m in data if isinstance(m, dict) and m.get("id") == wanted]
        if not matches:
            raise SmokeFail(step, f"model {wanted!r} is not listed by /v1/models (listed: {ids})")
        entry = matches[0]
    mml = entry.get("max_model_len")
    if not isinstance(mml, int) or isinstance(mml, bool) or mml <= 0:
        raise SmokeFail(step, f"model {entry['id']!r} has no positive integer max_model_len: {mml!r}")
    passed(step, f"models {ids}; using {entry['id']!r} (max_model_len {mml})")
    return str(entry["id"])


def step_chat(client: Client, model: str) -> None:
    step = "chat"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Say hello in one short sentence."}],
        "thinking": THINKING_OFF,
        "max_tokens": 64,
        "stream": False,
    }
    resp = client.json(step, "POST", "/v1/chat/completions", body)
    choice = first_choice(step, resp)
    content = choice["message"].get("content")
    if not isinstance(content, str) or not content.strip():
        raise SmokeFail(step, f"message content is empty or missing: {snippet(json.dumps(choice['message']))}")
    if not choice.get("finish_reason"):
        raise SmokeFail(step, "choices[0].finish_reason is missing")
    usage = check_usage(step, resp.get("usage"))
    passed(step, f"chat.completion finish_reason={choice['finish_reason']} {usage}; content {content[:60]!r}")


def step_stream(client: Client, model: str) -> None:
    step = "stream"
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "Count from 1 to 5."}],
        "thinking": THINKING_OFF,
        "max_tokens": 64,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    chunks: list[dict[str, Any]] = []
    content_parts: list[str] = []
    finish_reasons: list[str] = []
    usage_chunks: list[dict[str, Any]] = []
    done = False
    with client.open(step, "POST", "/v1/chat/completions", body) as resp:
        ctype = resp.headers.get("Content-Type", "")
        if not ctype.startswith("text/event-stream"):
            raise SmokeFail(step, f"Content-Type is {ctype!r}, expected text/event-stream")
        lineno = 0
        while True:
            try:
                raw = resp.readline()
            except OSError as e:
                raise SmokeFail(step, f"reading the stream failed after {lineno} lines: {e}") from e
            if not raw:
                break
            lineno += 1
            line = raw.decode("utf-8", "replace").rstrip("\r\n")
            if not line or line.startswith(":"):
                continue  # event separator or SSE comment (keep-alive)
            if not line.startswith("data:"):
                continue  # other SSE fields (event:, id:, retry:) carry no payload here
            if done:
                raise SmokeFail(step, f"line {lineno}: data after 'data: [DONE]': {snippet(line)}")
            if line == "data: [DONE]":
                done = True
                continue
            payload = line[len("data:") :].strip()
            try:
                chunk = json.loads(payload)
            except ValueError as e:
                raise SmokeFail(step, f"line {lineno}: data line is not JSON: {snippet(line)}") from e
            if not isinstance(chunk, dict):
                raise SmokeFail(step, f"line {lineno}: chunk is not an object: {snippet(line)}")
            if "error" in chunk:
                raise SmokeFail(step, f"line {lineno}: error event in the stream: {snippet(json.dumps(chunk))}")
            if chunk.get("object") != "chat.completion.chunk":
                raise SmokeFail(step, f"line {lineno}: object is {chunk.get('object')!r}, not 'chat.completion.chunk'")
            chunks.append(chunk)
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                if isinstance(delta.get("content"), str):
                    content_parts.append(delta["content"])
                if choice.get("finish_reason"):
                    finish_reasons.append(choice["finish_reason"])
            if chunk.get("usage") is not None:
                usage_chunks.append(chunk)
    if not done:
        raise SmokeFail(step, "the stream ended without the final 'data: [DONE]' line")
    if not chunks:
        raise SmokeFail(step, "no data chunks before [DONE]")
    if len(finish_reasons) != 1:
        raise SmokeFail(step, f"expected exactly one finish_reason, saw {finish_reasons}")
    if len(usage_chunks) != 1:
        raise SmokeFail(step, f"expected exactly one usage chunk with include_usage, saw {len(usage_chunks)}")
    if usage_chunks[0] is not chunks[-1]:
        raise SmokeFail(step, "the usage chunk is not the last chunk before [DONE]")
    usage = check_usage(step, usage_chunks[0]["usage"])
    content = "".join(content_parts)
    if not content.strip():
        raise SmokeFail(step, "the assembled content of the stream is empty")
    passed(step, f"{len(chunks)} chunks + [DONE], finish_reason={finish_reasons[0]} {usage}; content {content[:60]!r}")


def step_tools(client: Client, model: str, require_tool_call: bool) -> None:
    step = "tools"
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "What is the weather in Paris right now? Use the get_weather tool."}
    ]
    body = {
        "model": model,
        "messages": messages,
        "tools": [WEATHER_TOOL],
        "tool_choice": "auto",
        "thinking": THINKING_OFF,
        "max_tokens": 256,
        "stream": False,
    }
    resp = client.json(step, "POST", "/v1/chat/completions", body)
    choice = first_choice(step, resp)
    message = choice["message"]
    tool_calls = message.get("tool_calls")
    if not tool_calls:
        text = message.get("content")
        if require_tool_call:
            raise SmokeFail(step, f"no tool_calls in the reply (--require-tool-call); content {text!r}")
        warn(step, f"the model answered without a tool call (allowed without --require-tool-call): {text!r}")
        if not isinstance(text, str) or not text.strip():
            raise SmokeFail(step, "the reply has neither tool_calls nor content")
        passed(step, "reply without tool call (warning above)")
        return
    if not isinstance(tool_calls, list):
        raise SmokeFail(step, f"tool_calls is not a list: {snippet(json.dumps(tool_calls))}")
    for i, call in enumerate(tool_calls):
        where = f"tool_calls[{i}]"
        if not isinstance(call, dict):
            raise SmokeFail(step, f"{where} is not an object")
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise SmokeFail(step, f"{where} has no id: {snippet(json.dumps(call))}")
        if call.get("type") != "function":
            raise SmokeFail(step, f"{where}.type is {call.get('type')!r}, expected 'function'")
        fn = call.get("function")
        if not isinstance(fn, dict) or fn.get("name") != "get_weather":
            raise SmokeFail(step, f"{where}.function.name is not 'get_weather': {snippet(json.dumps(fn))}")
        args = fn.get("arguments")
        if not isinstance(args, str):
            raise SmokeFail(step, f"{where}.function.arguments is not a JSON string: {args!r}")
        try:
            parsed = json.loads(args)
        except ValueError as e:
            raise SmokeFail(step, f"{where}.function.arguments is not valid JSON: {args!r}") from e
        if not isinstance(parsed, dict):
            raise SmokeFail(step, f"{where}.function.arguments is not a JSON object: {args!r}")
        if "city" not in parsed:
            warn(step, f"{where} arguments have no 'city': {args!r}")
    if choice.get("finish_reason") != "tool_calls":
        reason = choice.get("finish_reason")
        raise SmokeFail(step, f"finish_reason is {reason!r} with tool calls, expected 'tool_calls'")
    passed(step, f"{len(tool_calls)} tool call(s): " + ", ".join(c["function"]["arguments"] for c in tool_calls))

    step = "tools-result"
    messages.append({"role": "assistant", "content": message.get("content") or "", "tool_calls": tool_calls})
    for call in tool_calls:
        result = {"city": "Paris", "temperature_c": 18, "condition": "sunny"}
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": json.dumps(result)})
    body["messages"] = messages
    resp = client.json(step, "POST", "/v1/chat/completions", body)
    choice = first_choice(step, resp)
    content = choice["message"].get("content")
    if not isinstance(content, str) or not content.strip():
        raise SmokeFail(step, f"no content after the tool result: {snippet(json.dumps(choice['message']))}")
    passed(step, f"answer after the tool result: {content[:80]!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Smoke test a running DeepInfer-server.")
    ap.add_argument("--base-url", required=True, help="e.g. http://localhost:8000")
    ap.add_argument("--model", default=None, help="model name (default: the first one /v1/models lists)")
    ap.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per HTTP request (default 300)")
    ap.add_argument("--require-tool-call", action="store_true", help="fail if the model answers without a tool call")
    ns = ap.parse_args(argv)

    client = Client(ns.base_url, ns.api_key, ns.timeout)
    try:
        step_health(client)
        model = step_models(client, ns.model)
        step_chat(client, model)
        step_stream(client, model)
        step_tools(client, model, ns.require_tool_call)
    except SmokeFail as e:
        print(f"SMOKE FAIL: {e.step}: {e.message}", file=sys.stderr, flush=True)
        return 1
    print("SMOKE OK", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
