"""The output codec against deepseek-recipe's own token path, which serves as the oracle.

The server detokenizes itself and feeds the StreamProcessor text (python/deepinfer_server/decoding.py says why):
by byte table for a byte-level tokenizer, else with `tokenizers.DecodeStream`; both are tested. These tests push the
same token IDs, in the same batches, through the library's tokenizer-attached processor and through `ChatDecoder`,
and require the same reasoning, content, tool calls, finish reason and usage.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from deepseek_recipe import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeepseekV41Encoding,
    InferenceChunk,
    InferenceFinishReason,
    PromptUsage,
    StreamProcessor,
)
from deepseek_recipe import Tokenizer as RecipeTokenizer
from tokenizers import Tokenizer

from deepinfer_server import _native
from deepinfer_server._native import PrepareInput
from deepinfer_server.codec import (
    CHAT,
    FINISHED,
    MESSAGES,
    RESPONSES,
    RUNNING,
    STOPPED_EARLY,
    Codec,
    Prepared,
    with_param,
)
from deepinfer_server.doors.chat import ChatDecoder
from deepinfer_server.grammar import SCHEMA_NAMES
from deepinfer_server.launcher import BUNDLED_TOKENIZER
from deepinfer_server.refusals import Refusal

MODEL = "deepseek-v4.1-flash"
# The oracle's side: deepseek-recipe's tokenizer and encoding (the codec keeps neither once fastokens is verified).
RECIPE_TOKENIZER = RecipeTokenizer.from_file(str(BUNDLED_TOKENIZER))
ORACLE = DeepseekV41Encoding().with_tokenizer(RECIPE_TOKENIZER)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city", "days"],
            },
        },
    }
]
D = "｜DSML｜"
TOOL_CALL = (
    f'\n\n<{D} calls>\n<{D} invoke name="get_weather">\n<{D} parameter name="city" string="true">Paris</{D} parameter>'
    f'\n<{D} parameter name="days" string="false">3</{D} parameter>\n</{D} invoke>\n</{D} calls>'
)
# (request extras, generated text): thinking on and off, tool calls, non-ASCII split across byte-level tokens.
CASES = {
    "reasoning then answer": ({}, "Let me weigh it: 6 times 7.</think>The answer is 42, as 🎉 usual."),
    "reasoning cut by length": ({}, "Still thinking about the café and 中文 text"),
    "no thinking": ({"thinking": {"type": "disabled"}}, "Hello 🎉 wörld 中文, plain content.\n\nTwo lines."),
    "tool call after reasoning": ({"tools": TOOLS}, "I should call the tool.</think>" + TOOL_CALL),
    "tool call without thinking": ({"tools": TOOLS, "thinking": {"type": "disabled"}}, TOOL_CALL),
}


@pytest.fixture(scope="module", params=["byte table", "DecodeStream"])
def codec(request: pytest.FixtureRequest) -> Codec:
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 16384)
    assert codec.vocab.token_bytes is not None  # the bundled tokenizer is byte-level, as DeepSeek's
    if request.param == "DecodeStream":  # what a tokenizer with any other decoder gets
        codec.vocab.token_bytes, codec.vocab.detokenizer = None, Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    return codec


def test_the_byte_table_decodes_as_the_tokenizer_does() -> None:
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 16384)
    table, tokenizer = codec.vocab.token_bytes, Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    assert table is not None and codec.vocab.detokenizer is None  # the table replaces the tokenizer object
    rng = random.Random(7)
    for _ in range(500):  # any IDs, special tokens and broken UTF-8 included
        ids = [rng.randrange(len(table)) for _ in range(rng.randint(1, 40))]
        assert b"".join(table[i] for i in ids).decode("utf-8", "replace") == tokenizer.decode(ids, False)


def body(stream: bool, extra: dict[str, Any]) -> bytes:
    req: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "What is 6 times 7?"}], **extra}
    if stream:
        req |= {"stream": True, "stream_options": {"include_usage": True}}
    return json.dumps(req).encode()


def batches(ids: list[int], size: int) -> list[list[int]]:
    return [ids[k : k + size] for k in range(0, len(ids), size)]


def prepare(codec: Codec, raw: bytes) -> Prepared:
    prepared = codec.prepare(
        PrepareInput(door=CHAT, body=raw, response_id="chatcmpl-test", model=MODEL, include_usage=True)
    )
    assert isinstance(prepared, Prepared), prepared
    return prepared


def oracle(codec: Codec, raw: bytes, parts: list[list[int]], reason: InferenceFinishReason) -> list[str]:
    """The library's token path: a tokenizer-attached processor fed the token IDs themselves."""
    conv = ChatCompletionRequest(raw).convert(codec.options)
    n_prompt = len(ORACLE.encode(conv.conversation))
    proc = StreamProcessor(
        ChatCompletionRequest.chunk_generator(conv, "chatcmpl-test", MODEL), conv.parsing_options, RECIPE_TOKENIZER
    )
    chunks = list(proc.push(InferenceChunk.ready(prompt_usage=PromptUsage(prompt_tokens=n_prompt))))
    for part in parts:
        if proc.finished:
            break
        chunks += proc.push(InferenceChunk.tokens(part))
    if not proc.finished:
        chunks += proc.push(InferenceChunk.finish(reason))
    chunks += proc.finish()
    if conv.stream:
        return [c.to_json() for c in chunks]
    final = ChatCompletionResponse("chatcmpl-test", MODEL, 0, n_prompt, 0)
    for c in chunks:
        final.accumulate(c)
    return [final.to_json()]


def ours(codec: Codec, raw: bytes, parts: list[list[int]], finish: int) -> tuple[list[str], int]:
    prepared = prepare(codec, raw)
    out = list(prepared.first_chunks)
    state = RUNNING
    for i, part in enumerate(parts):
        state, got = prepared.decoder.push(part, finish if i == len(parts) - 1 else _native.FINISH_NONE)
        out += [got] if isinstance(got, str) else got
        if state != RUNNING:
            break
    return out, state


def summary(chunks: list[str]) -> dict[str, Any]:
    """What a client reads from a stream or a response: texts, tool calls, finish reason, usage."""
    s: dict[str, Any] = {"reasoning": "", "content": "", "tools": {}, "finish": None, "usage": None}
    for js in chunks:
        d = json.loads(js)
        s["usage"] = d.get("usage") or s["usage"]
        for choice in d["choices"]:
            part = choice.get("delta") or choice.get("message") or {}
            s["reasoning"] += part.get("reasoning_content") or ""
            s["content"] += part.get("content") or ""
            for k, call in enumerate(part.get("tool_calls") or []):
                slot = s["tools"].setdefault(call.get("index", k), {"name": "", "arguments": ""})
                slot["name"] += call["function"].get("name") or ""
                slot["arguments"] += call["function"].get("arguments") or ""
            s["finish"] = choice.get("finish_reason") or s["finish"]
    return s


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
@pytest.mark.parametrize("size", [1, 3, 7, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_same_output_as_the_library_token_path(codec: Codec, case: str, size: int, stream: bool) -> None:
    extra, text = CASES[case]
    ids = RECIPE_TOKENIZER.encode(text)
    raw = body(stream, extra)
    parts = batches(ids, size)
    want = summary(oracle(codec, raw, parts, InferenceFinishReason.Length))
    got, state = ours(codec, raw, parts, _native.FINISH_LENGTH)
    assert state == FINISHED
    assert summary(got) == want
    assert want["reasoning"] or want["content"] or want["tools"]  # the case exercised something
    if stream:
        assert json.loads(got[-1])["choices"] == []  # usage in its own final chunk


def test_reasoning_tokens_are_the_engine_tokens_before_think_end(codec: Codec) -> None:
    reasoning = RECIPE_TOKENIZER.encode("Weighing the options carefully here.")
    ids = reasoning + RECIPE_TOKENIZER.encode("</think>Yes.")
    got, _ = ours(codec, body(False, {}), batches(ids, 4), _native.FINISH_LENGTH)
    usage = json.loads(got[-1])["usage"]
    assert usage["completion_tokens_details"] == {"reasoning_tokens": len(reasoning)}
    assert list(usage) == [  # the library's key order
        "prompt_tokens",
        "completion_tokens",
        "total_tokens",
        "prompt_tokens_details",
        "completion_tokens_details",
        "prompt_cache_hit_tokens",
        "prompt_cache_miss_tokens",
    ]
    no_think, _ = ours(codec, body(False, {"thinking": {"type": "disabled"}}), [ids], _native.FINISH_LENGTH)
    assert "completion_tokens_details" not in json.loads(no_think[-1])["usage"]


def test_ids_past_the_vocabulary_have_no_text(codec: Codec) -> None:
    ids = RECIPE_TOKENIZER.encode("Plain words here.")
    padded = [*ids[:2], 129_279, *ids[2:]]  # an ID a padded output layer could produce
    raw = body(False, {"thinking": {"type": "disabled"}})
    got, _ = ours(codec, raw, [padded], _native.FINISH_LENGTH)
    message = json.loads(got[-1])["choices"][0]["message"]
    assert message["content"] == "Plain words here."
    assert json.loads(got[-1])["usage"]["completion_tokens"] == len(padded)


def test_stop_sequence_matches_the_library(codec: Codec) -> None:
    extra = {"thinking": {"type": "disabled"}, "stop": ["answer"]}
    ids = RECIPE_TOKENIZER.encode("The final answer is 42 and more text follows.")
    for size in (1, 2, 5):
        raw = body(True, extra)
        want = summary(oracle(codec, raw, batches(ids, size), InferenceFinishReason.Length))
        got, state = ours(codec, raw, batches(ids, size), _native.FINISH_NONE)
        assert state == STOPPED_EARLY  # the rank must be told to abort
        assert summary(got) == want
        assert want["content"] == "The final " and want["finish"] == "stop"


def test_length_inside_a_character_keeps_the_text(codec: Codec) -> None:
    """The library's token path drops a batch that ends inside a UTF-8 character; the server keeps its text."""
    ids = RECIPE_TOKENIZER.encode("Hello 🎉 wörld")
    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    cut = next(n for n in range(1, len(ids)) if "\ufffd" in tokenizer.decode(ids[:n], False))
    raw = body(False, {"thinking": {"type": "disabled"}})
    assert summary(oracle(codec, raw, [ids[:cut]], InferenceFinishReason.Length))["content"] == ""
    got, _ = ours(codec, raw, [ids[:cut]], _native.FINISH_LENGTH)
    message = json.loads(got[-1])["choices"][0]
    assert message["message"]["content"] == "Hello \ufffd"
    assert message["finish_reason"] == "length"
    assert json.loads(got[-1])["usage"]["completion_tokens"] == cut


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "non-stream"])
def test_ignore_eos_counts_the_eos_tokens_and_the_reasoning(codec: Codec, stream: bool) -> None:
    """With ignore_eos the engine's EOS tokens are generated tokens: no text, but in usage (with the reasoning)."""
    reasoning = RECIPE_TOKENIZER.encode("Short thought.")
    eos = codec.vocab.eos_id
    ids = [*reasoning, eos, *RECIPE_TOKENIZER.encode("</think>Answer"), eos, eos]
    prepared = codec.prepare(
        PrepareInput(
            door=CHAT,
            body=body(stream, {}),
            response_id="chatcmpl-test",
            model=MODEL,
            ignore_eos=True,
            include_usage=True,
        )
    )
    assert isinstance(prepared, Prepared)
    state, out = prepared.decoder.push(ids, _native.FINISH_LENGTH)
    assert state == FINISHED
    chunks = [out] if isinstance(out, str) else [*prepared.first_chunks, *out]
    got = summary(chunks)
    assert got["reasoning"] == "Short thought." and got["content"] == "Answer"
    assert got["usage"]["completion_tokens"] == len(ids)
    assert got["usage"]["completion_tokens_details"] == {"reasoning_tokens": len(reasoning)}


def parsed_finish(decoder: ChatDecoder, out: list[str]) -> list[str]:
    """The last batch's chunks written by parsing the chunk that carries usage (the fallback path)."""
    result: list[str] = []
    usage_chunk = None
    for js in out:
        if '"usage":{' not in js:
            if decoder.continuous and js.endswith('"usage":null}'):
                js = js[:-13] + decoder._usage_tail()
            result.append(js)
            continue
        chunk, usage_chunk = decoder._finish_parsed(js)
        result.append(chunk)
    return result + ([usage_chunk] if usage_chunk else [])


@pytest.mark.parametrize("usage", ["none", "final", "continuous"])
@pytest.mark.parametrize("thinking", [True, False], ids=["thinking", "no-thinking"])
@pytest.mark.parametrize("eos", [True, False], ids=["eos-kept", "no-eos"])
def test_the_last_batch_is_spliced_as_parsing_would_write_it(
    codec: Codec, usage: str, thinking: bool, eos: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Text that looks like the keys the splice cuts at must not fool it; usage fixes (EOS kept out of the text,
    reasoning tokens) land in the same place, in the library's key order."""
    req: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Say something tricky."}],
        "stream": True,
        "thinking": {"type": "enabled" if thinking else "disabled"},
    }
    if usage != "none":
        req["stream_options"] = {"include_usage": True, "continuous_usage_stats": usage == "continuous"}
    raw = json.dumps(req).encode()
    prepared = codec.prepare(
        PrepareInput(
            door=CHAT,
            body=raw,
            response_id="chatcmpl-test",
            model=MODEL,
            ignore_eos=eos,
            include_usage=usage != "none",
            continuous_usage=usage == "continuous",
        )
    )
    assert isinstance(prepared, Prepared)
    text = 'A thought, "usage":{ and "choices":[.</think>' if thinking else ""
    ids = RECIPE_TOKENIZER.encode(text + 'Answer: ,"usage":{"x":1}} "choices":[] \\",\\"usage\\":{')
    if eos:
        ids = [*ids[:5], codec.vocab.eos_id, *ids[5:], codec.vocab.eos_id]
    seen: list[list[str]] = []
    splice = ChatDecoder._finish_stream
    monkeypatch.setattr(ChatDecoder, "_finish_stream", lambda self, out: seen.append(list(out)) or splice(self, out))
    state, got = prepared.decoder.push(ids, _native.FINISH_LENGTH)
    assert state == FINISHED and isinstance(got, list)
    want = parsed_finish(prepared.decoder, seen[0])
    assert [json.dumps(json.loads(js)) for js in got] == [json.dumps(json.loads(js)) for js in want]
    last = json.loads(got[-1])
    if usage == "none":
        assert all("usage" not in json.loads(js) or json.loads(js)["usage"] is None for js in got)
        return
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == len(ids)
    assert ("completion_tokens_details" in last["usage"]) == thinking
    assert json.loads(got[-2])["usage"] == (last["usage"] if usage == "continuous" else None)
    assert summary([*prepared.first_chunks, *got])["content"].endswith('\\",\\"usage\\":{')


def test_deepseek_recipes_tokenizer_is_loaded_on_the_first_request_with_logprobs() -> None:
    """With fastokens encoding the prompts, deepseek-recipe's tokenizer (~50 MB for DeepSeek's vocabulary) is not
    kept from start-up: the first request that asks for logprobs loads it, once; the recipe encoder shares its own."""
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 16384, prompt_encoder="fastokens")
    assert codec.vocab._recipe_tokenizer is None
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "thinking": {"type": "disabled"}}
    p = codec.prepare(PrepareInput(door=CHAT, body=json.dumps(body).encode(), response_id="r", model=MODEL))
    assert isinstance(p, Prepared) and codec.vocab._recipe_tokenizer is None, "no logprobs: not needed"
    p = codec.prepare(
        PrepareInput(door=CHAT, body=json.dumps({**body, "logprobs": True}).encode(), response_id="r", model=MODEL)
    )
    assert isinstance(p, Prepared) and p.logprobs == 0
    loaded = codec.vocab._recipe_tokenizer
    assert loaded is not None
    codec.prepare(
        PrepareInput(door=CHAT, body=json.dumps({**body, "logprobs": True}).encode(), response_id="r", model=MODEL)
    )
    assert codec.vocab._recipe_tokenizer is loaded
    recipe = Codec(BUNDLED_TOKENIZER, [MODEL], 16384, prompt_encoder="recipe")
    assert recipe.vocab._recipe_tokenizer is not None, "the recipe encoder's own tokenizer, shared"


def test_a_custom_tool_inside_a_namespace_is_refused_naming_its_place(codec: Codec) -> None:
    # deepseek-recipe refuses it with `param` null; the message says where, and the envelope should too.
    tools = [{"type": "function", "name": "a", "parameters": {}}, {"type": "custom", "name": "c"}]
    ns = {"type": "namespace", "name": "ns", "description": "d", "tools": tools}
    body = {"model": "DeepSeek-V4.1-Flash", "max_output_tokens": 4, "input": "hi", "tools": [ns]}
    got = codec.prepare(PrepareInput(door=RESPONSES, body=json.dumps(body).encode(), response_id="resp", model=MODEL))
    assert isinstance(got, Refusal) and got.status == 400
    err = json.loads(got.body)["error"]
    assert err["param"] == "tools[0].tools[1]" and "custom tool 'c'" in err["message"]
    # An input item's tools are named the same way.
    said = "Currently custom tools are not allowed inside a namespace. Found custom tool 'x' in input[0].tools[1]."
    filled = with_param(json.dumps({"error": {"message": said, "param": None}}), RESPONSES)
    assert json.loads(filled)["error"]["param"] == "input[0].tools[1]"


# Anthropic's structured output: keywords it takes that a schema's own copy could lose (enum, format, minItems,
# descriptions, anyOf), in an order the grammar must keep.
ANTHROPIC_SCHEMA = {
    "type": "object",
    "properties": {
        "when": {"type": "string", "format": "date", "description": "the day"},
        "cities": {"type": "array", "items": {"enum": ["Oslo", "Paris"]}, "minItems": 1},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["when", "cities", "note"],
    "additionalProperties": False,
}


def messages_body(**fields: Any) -> bytes:
    body = {"model": MODEL, "max_tokens": 50, "messages": [{"role": "user", "content": "hi"}], **fields}
    return json.dumps(body).encode()


def with_format(field: str, fmt: dict[str, Any]) -> bytes:
    """A Messages body with its output format in `output_config.format` or in the beta `output_format`."""
    return (
        messages_body(output_config={"format": fmt}) if field == "output_config" else messages_body(output_format=fmt)
    )


@pytest.mark.parametrize("field", ["output_config", "output_format"])
def test_a_messages_output_format_is_enforced_as_written(field: str) -> None:
    """A Messages JSON schema, in `output_config.format` or the beta `output_format`, is the grammar as the client
    wrote it (deepseek-recipe's Messages conversion leaves it out; the codec puts it back, verbatim)."""
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 16384)
    fmt = {"type": "json_schema", "schema": ANTHROPIC_SCHEMA}
    body = with_format(field, fmt)
    got = codec.prepare(PrepareInput(door=MESSAGES, body=body, response_id="msg_1", model=MODEL))
    assert isinstance(got, Prepared) and got.constraint is not None
    schema_type, schema = got.constraint.schema_type, got.constraint.schema
    assert SCHEMA_NAMES[schema_type] == "json" and schema == json.dumps(ANTHROPIC_SCHEMA, separators=(",", ":"))
    # With both, `output_config.format` is the one (the beta field is its old spelling).
    other = {"type": "json_schema", "schema": {"type": "object", "properties": {}, "additionalProperties": False}}
    both = messages_body(output_config={"format": fmt}, output_format=other)
    got = codec.prepare(PrepareInput(door=MESSAGES, body=both, response_id="msg_2", model=MODEL))
    assert isinstance(got, Prepared) and got.constraint is not None and got.constraint.schema == schema


@pytest.mark.parametrize(
    ("field", "param"), [("output_config", "output_config.format"), ("output_format", "output_format")]
)
def test_a_messages_schema_refusal_names_the_field_it_came_from(field: str, param: str) -> None:
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 16384)
    fmt = {"type": "json_schema", "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}}
    body = with_format(field, fmt)
    got = codec.prepare(PrepareInput(door=MESSAGES, body=body, response_id="msg_1", model=MODEL))
    assert isinstance(got, Refusal) and got.status == 400
    err = json.loads(got.body)["error"]
    assert err["param"] == f"{param}.schema" and "'minimum'" in err["message"], err
