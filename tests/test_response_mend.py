"""The Responses door's lifecycle events and non-stream bodies are mended as text in Rust (`mend_response`); the
Python rules on parsed JSON (`doors/responses.py` `_mend`) are the oracle. Every event deepseek-recipe writes, over
requests whose client-chosen parts spell the members that are cut (metadata, instructions, tool schemas, formats),
must come out the same, in the same key order, as the parsed path gives."""

from __future__ import annotations

import json
from typing import Any

import pytest
from deepseek_recipe import (
    ConversionOptions,
    InferenceChunk,
    InferenceFinishReason,
    ModelVersion,
    PromptUsage,
    ResponsesRequest,
    ResponsesResponse,
    StreamProcessor,
)

from deepinfer_server._native import mend_response
from deepinfer_server.decoding import dumps
from deepinfer_server.doors.responses import _mend, _mend_response, _mend_response_event

MODEL = "m"
OPTIONS = ConversionOptions().with_model_alias(MODEL, ModelVersion.DeepseekV41Flash)
D = "｜DSML｜"
SCHEMA = {"type": "object", "properties": {"user": {"type": "string"}, "store": {"type": "boolean"}}}
BODIES: dict[str, dict[str, Any]] = {
    "plain": {},
    "user, store, sampling": {"user": "u-1", "store": True, "temperature": 0.3, "top_p": 0.9},
    "metadata that spells the members": {"metadata": {"store": "x", "user": "null", "usage": "u"}},
    "instructions that spell them": {"instructions": 'say "store":false, and "user":null, then \\ "usage":null,'},
    "json_schema format": {"text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA}}},
    "described format": {
        "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA, "description": "d"}}
    },
    "tools": {
        "tools": [
            {"type": "function", "name": "f", "parameters": SCHEMA},
            {"type": "function", "name": "g", "description": "uses store", "parameters": {"type": "object"}},
        ]
    },
    "reasoning": {"reasoning": {"effort": "high"}},
    "max_output_tokens": {"max_output_tokens": 64},
}
OUTPUTS = {
    "text": ["Hello ", "wörld 🎉 ", '"store":false,"user":null ', "中文"],
    "reasoning then text": ["Weighing it", "</think>", "The answer ", "is 42."],
    "tool call": [
        "</think>",
        f'\n\n<{D} calls>\n<{D} invoke name="f">\n<{D} parameter name="user" string="true">a',
        f"</{D} parameter>\n</{D} invoke>\n</{D} calls>",
    ],
}


def events(extra: dict[str, Any], texts: list[str], stream: bool) -> list[tuple[str | None, str]]:
    """(SSE event name, JSON) of each event deepseek-recipe writes for this request and output, or the whole
    response for a non-stream."""
    req = ResponsesRequest({"model": MODEL, "input": "hi", "stream": stream, **extra})
    echo = req.echo()
    conv = req.convert(OPTIONS)
    gen = ResponsesRequest.chunk_generator(conv, "resp_1", MODEL).with_echo(echo)
    proc = StreamProcessor(gen, conv.parsing_options)
    out = list(proc.push(InferenceChunk.ready(prompt_usage=PromptUsage(prompt_tokens=3))))
    for t in texts:
        out += proc.push(InferenceChunk.text(t, 1))
    out += proc.push(InferenceChunk.finish(InferenceFinishReason.Stop)) + proc.finish()
    if not stream:
        final = ResponsesResponse("resp_1", MODEL, 0, 3, 0)
        for ev in out:
            final.accumulate(ev)
        return [(None, final.to_json())]
    return [(ResponsesResponse.sse_event_name(ev), ev.to_json()) for ev in out]


@pytest.mark.parametrize("output", OUTPUTS)
@pytest.mark.parametrize("body", BODIES)
def test_text_mend_is_the_parsed_mend(body: str, output: str) -> None:
    checked = 0
    for stream in (True, False):
        for name, js in events(BODIES[body], OUTPUTS[output], stream):
            d = json.loads(js)
            response = d.get("response") if stream else d
            if not isinstance(response, dict):
                continue
            _mend(response)
            want = dumps(d)
            got = mend_response(js, stream)
            if got is None:  # only a function call's arguments send it to the parsed path
                assert output == "tool call" and '"arguments":' in js
            else:
                assert dumps(json.loads(got)) == want, (name, js)
                checked += 1
            # and the whole path, whichever way it goes
            mended = _mend_response_event(f"event: {name}\ndata: {js}").partition("\ndata: ")[2] if stream else None
            assert dumps(json.loads(mended if stream else _mend_response(js))) == want  # type: ignore[arg-type]
    assert checked > 0


def test_members_are_cut_from_the_response_only() -> None:
    (_, created), *_ = events(BODIES["instructions that spell them"] | {"user": "x"}, ["hi"], True)
    r = json.loads(mend_response(created, True) or "")["response"]
    for key in ("store", "moderation", "content_filters", "frequency_penalty", "presence_penalty", "usage"):
        assert key not in r
    assert r["user"] == "x" and r["instructions"] == BODIES["instructions that spell them"]["instructions"]
