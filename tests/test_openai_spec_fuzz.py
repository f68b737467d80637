"""schemathesis over OpenAI's own published spec (tests/wire_schema.py), not the project's copy: requests that
OpenAI's schema allows, against a live server. The model is forced, max tokens capped, half of the chat requests
streamed. It must give no 5xx, and every response and SSE event must validate against OpenAI's response schemas.

A request the server refuses by design must match one entry of `BY_DESIGN`, which says why; the run prints each
reason that occurred once, with its count. A 4xx that matches none is a failure: either a defect, or a refusal
to be named here (and in the README)."""

from __future__ import annotations

import json
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import wire_schema
from conftest import MODEL, Server
from hypothesis import HealthCheck, given, settings

from test_fuzz import assert_healthy, small_server

Body = dict[str, Any]
Error = dict[str, Any]


def _parts(body: Body) -> Iterator[Body]:
    for m in body.get("messages") or []:
        if isinstance(m, dict) and isinstance(m.get("content"), list):
            yield from (p for p in m["content"] if isinstance(p, dict))


def _param(pattern: str) -> Callable[[Body, Error], bool]:
    rx = re.compile(pattern)
    return lambda body, err: bool(rx.fullmatch(str(err.get("param"))))


def _says(pattern: str) -> Callable[[Body, Error], bool]:
    rx = re.compile(pattern)
    return lambda body, err: bool(rx.search(str(err.get("message"))))


# (reason, test on the error object). First match wins.
BY_DESIGN: list[tuple[str, Callable[[Body, Error], bool]]] = [
    ("n > 1, best_of > 1: one choice per request", _param("n|best_of")),
    ("json_object output needs the word 'json' in the prompt (OpenAI's rule)", _says(r"must contain the word 'json'")),
    (
        "a chat field of the wrong type on a door whose published schema leaves it undeclared (the same field table)",
        _says(r"^Invalid '[\w.]+': expected "),
    ),
    (
        "logprobs: top_logprobs in [0, 20] and only with logprobs true (OpenAI's rule); Completions' logprobs in "
        "[0, 20], not with echo",
        _param("logprobs|top_logprobs|echo"),
    ),
    ("a forced tool choice needs tools, and a named one must be one of them (OpenAI's rule)", _param("tool_choice")),
    (
        "structured output: a malformed schema, or a grammar the engine cannot enforce",
        _param(r"(response_format|text\.format)(\.[\w.]+)?"),
    ),
    (
        "images: a URL the address guard refuses or that cannot be fetched, data that is not an image, over a limit",
        lambda body, err: (
            str(err.get("code")).startswith(("image", "invalid_image", "too_many_images"))
            or str(err.get("code")) == "unsupported_image_type"
        ),
    ),
    (
        "non-text content (audio, files): not served",
        _param(r"messages\[\d+\]\.content\[\d+\]\.type"),
    ),
    ("audio output, web search: not served", _param("audio|web_search_options|modalities")),
    ("the deprecated functions API: not served (use tools)", _param(r"functions|(messages\[\d+\]\.)?function_call")),
    ("the deprecated 'function' role: not served (use tool messages)", _param(r"messages\[\d+\]\.role")),
    (
        "a conversation OpenAI's API refuses too: tool calls without their results, tool results without calls, "
        "empty tool_calls, an assistant turn with neither content nor tool calls, duplicate tool_call_ids",
        _param(r"messages|messages\[\d+\](\.(tool_calls|content))?"),
    ),
    (
        "Responses: a custom tool inside a namespace (deepseek-recipe's rule)",
        _param(r"(input\[\d+\]\.)?tools\[\d+\](\.tools\[\d+\])+"),
    ),
    ("custom (non-function) tools: not served", _param(r"tools\[\d+\]\.type|messages\[\d+\]\.tool_calls\[\d+\]\.type")),
    (
        "Responses: custom tools other than deepseek-recipe's apply_patch",
        lambda body, err: err.get("param") == "tools" and "custom tool" in str(err.get("message")),
    ),
    ("logit_bias: keys must be token IDs and biases in [-100, 100], as OpenAI's API checks", _param("logit_bias")),
    ("stop: deepseek-recipe takes at most 16 strings, none empty", _param(r"stop(\[\d+\])?")),
    (
        "Completions: echo with logprobs beside a sampling temperature (the prompt's logprobs are the model's own "
        "distribution, and the engine samples with the same parameters)",
        lambda body, err: err.get("param") == "temperature" and "logprobs" in str(err.get("message")),
    ),
    ("the prompt leaves no room in --max-model-len", lambda body, err: err.get("code") == "context_length_exceeded"),
    (
        "Responses: a previous_response_id (400) or conversation (404) not stored; both at once; background, no store",
        _param(r"previous_response_id|conversation|store|background"),
    ),
    (
        "Responses: hosted tools (web search, file search, ...): only function tools run here",
        _param(r"tools\[\d+\]\.type"),
    ),
    (
        "Responses: an input OpenAI's API refuses too: empty, tool outputs without calls, calls without outputs, "
        "duplicate call ids",
        _param("input"),
    ),
    ("Responses: stored prompt templates", lambda body, err: err.get("param") == "prompt" and "input" in body),
    (
        "Completions: one prompt per request (no batches), token IDs within the vocabulary",
        lambda body, err: err.get("param") == "prompt" and "input" not in body,
    ),
    (
        "tool names must match ^[a-zA-Z0-9_-]+$, as OpenAI's API checks too",
        _param(r"(input\[\d+\]\.)?tools\[\d+\](\.function)?\.name"),
    ),
    (
        "Responses: input items of hosted tools, MCP or stored-item references; tool items without a call_id",
        _param(r"input\[\d+\]\.(type|call_id)"),
    ),
    (
        "Responses: file inputs (file_id, input_file): not served",
        lambda body, err: (
            bool(re.fullmatch(r"input\[\d+\].*", str(err.get("param"))))
            and any(w in str(err.get("message")) for w in ("input_", "file_id"))
        ),
    ),
    (
        "Responses: a tool call in the input without its output, as OpenAI's API refuses too",
        _says("No tool output found"),
    ),
]


def classify(body: Body, err: Error) -> str | None:
    return next((reason for reason, matches in BY_DESIGN if matches(body, err)), None)


@pytest.fixture(scope="module")
def spec_server() -> Iterator[Server]:
    yield from small_server(4096)


# CI replays one fixed set of examples, so a refusal the list above does not name yet cannot turn main red at random;
# DEEPINFER_SPEC_FUZZ_EXPLORE=1 draws new ones (run it when a door changes, and name what it finds).
FUZZ = settings(
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    max_examples=200,
    derandomize=not os.environ.get("DEEPINFER_SPEC_FUZZ_EXPLORE"),
)


OPERATIONS = [
    ("/chat/completions", "POST"),
    ("/completions", "POST"),
    ("/responses", "POST"),
    ("/models", "GET"),
    ("/models/{model}", "GET"),
]


@pytest.mark.parametrize(("path", "method"), OPERATIONS)
def test_openai_published_spec(spec_server: Server, path: str, method: str) -> None:
    import schemathesis
    from schemathesis.core.transport import STREAM_CUT_SHORT_ATTRIBUTE

    schema = schemathesis.openapi.from_dict(wire_schema.bounded_request_spec(MODEL, 16))
    op = schema[path][method]
    statuses: Counter[int] = Counter()
    refused: Counter[str] = Counter()
    example: dict[str, str] = {}
    problems: list[str] = []
    pick = random.Random(7)

    @FUZZ
    @given(case=op.as_strategy())
    def run(case: Any) -> None:
        body = case.body if isinstance(case.body, dict) else None
        if body is not None:
            body["stream"] = pick.random() < 0.5  # half the chat requests stream
            if not body["stream"]:
                body.pop("stream_options", None)
        resp = case.call(base_url=f"{spec_server.url}/v1", timeout=30)
        statuses[resp.status_code] += 1
        sent = case.formatted_path if hasattr(case, "formatted_path") else path
        where = f"{method} {sent} {json.dumps(body)[:400] if body else ''}"
        if resp.status_code >= 500:
            problems.append(f"{resp.status_code} for {where}: {resp.text[:300]}")
            return
        ctype = resp.headers.get("content-type") or ""
        ctype = ctype[0] if isinstance(ctype, list) else ctype  # schemathesis keeps every value of a header
        # schemathesis reads at most 20 events of a stream (an n > 1 stream has more) and says when it stopped.
        whole = not getattr(resp, STREAM_CUT_SHORT_ATTRIBUTE, False)
        found = wire_schema.check_response(f"/v1{sent}", resp.status_code, ctype, resp.content, whole)
        problems.extend(f"{where}: {v}" for v in found)
        if 400 <= resp.status_code < 500:
            err = resp.json().get("error", {})
            reason = "an unknown model name is a 404" if err.get("code") == "model_not_found" else None
            reason = reason or classify(body or {}, err)
            if reason is None:
                problems.append(f"unexpected {resp.status_code} for {where}: {resp.text[:300]}")
            else:
                refused[reason] += 1
                example.setdefault(reason, str(err.get("message"))[:160])

    run()
    print(f"\n{method} {path} against {wire_schema.SPEC_VERSION}: statuses {dict(sorted(statuses.items()))}")
    for reason, n in refused.most_common():
        print(f"  refused by design x{n}: {reason} (e.g. {example[reason]!r})")
    assert not problems, f"{len(problems)} problems:\n" + "\n".join(problems[:15])
    assert_healthy(spec_server)
