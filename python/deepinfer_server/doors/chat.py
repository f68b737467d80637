"""OpenAI Chat Completions (`POST /v1/chat/completions`): deepseek-recipe's `ChatCompletionRequest` conversion, and
its chunks with the OpenAI wire details around them (usage chunk, continuous usage, `refusal`, no partial tool-call
markup, vLLM's `prompt_logprobs`)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Sequence
from typing import Any, cast

from deepseek_recipe import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ConversationRequest,
    ConversionOptions,
)

from deepinfer_server import _native
from deepinfer_server.decoding import BaseDecoder, Chunk, Generator, cut_partial_tag, dumps
from deepinfer_server.doors.base import PrepareInput
from deepinfer_server.doors.conversation import ConversationDoor, Converted
from deepinfer_server.prompt_logprobs import PromptTokens
from deepinfer_server.token_ids import TokenIds
from deepinfer_server.vocabulary import Vocabulary


class ChatDoor(ConversationDoor):
    code = _native.DOOR_CHAT
    schema_param = "response_format"
    takes_prompt_logprobs = True
    takes_token_ids = True

    def convert(self, body: bytes, options: ConversionOptions) -> Converted:
        c = ChatCompletionRequest(body).convert(options)
        return Converted(c, lambda rid, model: ChatCompletionRequest.chunk_generator(c, rid, model), c.conversation)

    def client_schema(self, body: bytes) -> str | None:
        """`response_format.json_schema.schema`."""
        if b'"json_schema"' not in body:
            return None
        fmt = json.loads(body).get("response_format")
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return None
        schema = (fmt.get("json_schema") or {}).get("schema")
        return None if schema is None else dumps(schema)

    def tool_function(self, tool: dict[str, Any]) -> object:
        return tool.get("function")

    def decoder(
        self,
        vocab: Vocabulary,
        conv: ConversationRequest,
        generator: Generator,
        req: PrepareInput,
        n_prompt: int,
        prompt: PromptTokens | None,
    ) -> BaseDecoder:
        stream_usage = req.include_usage and conv.stream
        decoder = ChatDecoder(
            vocab,
            conv,
            generator,
            req.response_id,
            req.model,
            n_prompt,
            req.ignore_eos,
            stream_usage,
            req.continuous_usage,
        )
        if prompt is not None:
            decoder.want_prompt_logprobs(prompt)
        return decoder


_dumps = dumps


class ChatDecoder(BaseDecoder):
    """One Chat Completions request's output."""

    __slots__ = ("continuous", "final", "include_usage", "last_call", "prompt", "prompt_json")

    def __init__(
        self,
        vocab: Vocabulary,
        conv: ConversationRequest,
        generator: Generator,
        response_id: str,
        model: str,
        n_prompt: int,
        ignore_eos: bool,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        super().__init__(vocab, conv, generator, n_prompt, ignore_eos)
        self.final = None if self.stream else ChatCompletionResponse(response_id, model, int(time.time()), n_prompt, 0)
        self.include_usage = include_usage
        self.continuous = continuous_usage and include_usage
        # vLLM's `prompt_logprobs` (non-streams only): the prompt's tokens, then their logprobs as JSON.
        self.prompt: PromptTokens | None = None
        self.prompt_json = "null"
        self.last_call: int | None = None  # a stream's last tool call (`_note_calls`)

    def want_prompt_logprobs(self, tokens: PromptTokens) -> None:
        self.prompt = tokens

    def _take_prompt_logprobs(self, values: list[float]) -> None:
        if self.prompt is not None:
            self.prompt_json = self.prompt.vllm(values)

    def _flushed(self, chunks: list[Chunk]) -> Sequence[object]:
        # Streams: what the finish flushes is where a cut-off tool call's held-back tag would surface.
        return [_trim_tool_arguments(ch.to_json()) for ch in chunks] if self.stream else chunks

    def _emit(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        """Chunk objects (or, from a stream's finish, their JSON already) -> the wire output of this batch."""
        if self.final is not None:  # non-stream: accumulate, answer once
            for ch in chunks:
                if isinstance(ch, ChatCompletionChunk):
                    self.final.accumulate(ch)
            if not last:
                return []
            body = _conform_response(self._with_tail(self._mend_logprobs(self.final.to_json())))
            spliced = self._splice_usage(body)
            if spliced is None:
                d = json.loads(body)
                self._fix_usage(d["usage"])
                spliced = _dumps(d)
            if self.prompt is not None:  # vLLM puts them beside the choices
                spliced = f'{spliced[:-1]},"prompt_logprobs":{self.prompt_json}}}'
            return spliced
        out = [
            ch if isinstance(ch, str) else ch.to_json() for ch in chunks if isinstance(ch, (str, ChatCompletionChunk))
        ]
        if self.token_strings is not None:
            out = [self._mend_logprobs(js) for js in out]
            if self.in_calls:
                self._note_calls(out)
        if last:
            return self._finish_stream(self._tail_chunk(out))
        if self.continuous:
            tail = self._usage_tail()
            out = [js[:-13] + tail if js.endswith('"usage":null}') else js for js in out]
        return out

    def _dress(self, out: list[str] | str) -> list[str] | str:
        ids = self.token_ids
        if not isinstance(ids, TokenIds):
            return out
        return ids.dress_chat_body(out) if isinstance(out, str) else ids.dress_chat_chunks(out)

    def _mend_logprobs(self, js: str) -> str:
        """A chunk or response with its logprobs' token strings spelling the text (`TokenStrings`)."""
        if self.token_strings is None or '"logprobs":{' not in js:
            return js
        d = json.loads(js)
        for choice in d.get("choices") or []:
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                self.token_strings.fix(lp)
                lp.setdefault("content", None)  # OpenAI's schema requires both, null when there are none
                lp.setdefault("refusal", None)
        return _dumps(d)

    def _note_calls(self, out: list[str]) -> None:
        """The index of the last tool call a stream's chunks opened: where a `Tail` in its arguments goes."""
        for js in out:
            for m in _CALL_INDEX.finditer(js):
                self.last_call = int(m.group(1))

    def _with_tail(self, body: str) -> str:
        """A non-stream's response with the tail the output ended with (`Tail`) added to its message."""
        tail = self.ended_tail
        if tail is None:
            return body
        d = json.loads(body)
        choice = d["choices"][0]
        field = self.tail_field
        message = choice["message"]
        calls = message.get("tool_calls")
        if field == "tool_calls" and calls:  # its arguments, which have no logprob entries
            function = calls[-1]["function"]
            function["arguments"] = (function.get("arguments") or "") + tail.text()
            return _dumps(d)
        field = "content" if field == "tool_calls" else field
        message[field] = (message.get(field) or "") + tail.text()
        choice["logprobs"] = _logprobs_with(choice.get("logprobs"), field, tail.entries())
        return _dumps(d)

    def _tail_chunk(self, out: list[str]) -> list[str]:
        """A stream's last chunks with a delta for the tail the output ended with (`Tail`), just before the
        chunk that finishes the choice."""
        tail = self.ended_tail
        if tail is None or not out:
            return out
        at = next((i for i, js in enumerate(out) if '"finish_reason":"' in js), len(out))
        d = json.loads(out[min(at, len(out) - 1)])  # the envelope (id, model, ...) every chunk repeats
        field = self.tail_field
        if field == "tool_calls" and self.last_call is not None:  # its arguments, which have no logprob entries
            call = {"index": self.last_call, "function": {"arguments": tail.text()}}
            d["choices"] = [{"index": 0, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": None}]
        else:
            field = "content" if field == "tool_calls" else field
            logprobs = _logprobs_with(None, field, tail.entries())
            d["choices"] = [{"index": 0, "delta": {field: tail.text()}, "logprobs": logprobs, "finish_reason": None}]
        d.pop("usage", None)  # the finish carries it (`_finish_stream`); continuous usage is on every chunk
        if self.continuous:
            d["usage"] = None
        return [*out[:at], _dumps(d), *out[at:]]

    def _usage_tail(self) -> str:
        n = self.n_out + self.dropped_eos
        return (
            f'"usage":{{"prompt_tokens":{self.n_prompt},"completion_tokens":{n},"total_tokens":{self.n_prompt + n}}}}}'
        )

    def _finish_stream(self, out: list[str]) -> list[str]:
        """OpenAI wire format: usage travels in its own final chunk with empty choices, only if asked for.

        The chunk that carries the library's usage is cut and spliced as text, not parsed and re-serialized (a
        JSON round trip of the chunk was most of the cost of a stream's last batch). `,"usage":{` and
        `"choices":[` cannot occur inside a JSON string (its quotes are escaped), and the library serializes usage
        last, after choices; a chunk of any other shape takes the parsing path."""
        result = []
        usage_chunk = None
        for js in out:
            k = js.rfind(',"usage":{')
            if k < 0:
                if self.continuous and js.endswith('"usage":null}'):
                    js = js[:-13] + self._usage_tail()
                result.append(js)
                continue
            head, usage = js[:k], js[k + 9 : -1]
            c = head.find('"choices":[')
            if c < 0 or not head.endswith("]") or not js.endswith("}}"):
                chunk, usage_chunk = self._finish_parsed(js)
                result.append(chunk)
                continue
            spliced = self._splice_usage(usage)
            usage = spliced if spliced is not None else _dumps(self._fix_usage(json.loads(usage)))
            if self.include_usage:
                result.append(f'{head},"usage":{usage if self.continuous else "null"}}}')
                usage_chunk = f'{head[:c]}"choices":[],"usage":{usage}}}'
            else:
                result.append(head + "}")
        if usage_chunk is not None:
            result.append(usage_chunk)
        return result

    def _splice_usage(self, js: str) -> str | None:
        """`js` (a usage object, or a body that holds one) with `_fix_usage` applied as text, or None when only
        parsing can apply it (`uncounted` tokens change numbers). Only usage holds an unescaped
        '"prompt_cache_hit_tokens":' (strings escape '"'): reasoning_tokens goes in just before it."""
        if self.uncounted == 0 and self.reasoning is None:
            return js
        k = js.find('"prompt_cache_hit_tokens":') if self.uncounted == 0 else -1
        if k < 0 or '"completion_tokens_details"' in js:
            return None
        return f'{js[:k]}"completion_tokens_details":{{"reasoning_tokens":{self.reasoning}}},{js[k:]}'

    def _finish_parsed(self, js: str) -> tuple[str, str | None]:
        """The parsing path for a chunk that carries usage: (that chunk, the usage-only chunk if asked for)."""
        d = json.loads(js)
        usage = self._fix_usage(d.pop("usage"))
        usage_chunk = None
        if self.include_usage:
            d["usage"] = usage if self.continuous else None
            usage_chunk = _dumps({**d, "choices": [], "usage": usage})
        return _dumps(d), usage_chunk

    def _fix_usage(self, usage: dict[str, object]) -> dict[str, object]:
        """Add the tokens deepseek-recipe did not count (`uncounted`), and the counted reasoning tokens."""
        if self.uncounted:
            for key in ("completion_tokens", "total_tokens"):
                usage[key] = int(usage[key]) + self.uncounted  # type: ignore[call-overload]
        if self.reasoning is not None:
            tail = {k: usage.pop(k) for k in list(usage) if k.startswith("prompt_cache_")}
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning}
            usage.update(tail)
        return usage


def _logprobs_with(logprobs: object, field: str, entries: list[dict[str, object]]) -> dict[str, object]:
    """A choice's logprobs object with `entries` added at the end of `field` (the object made if there was none)."""
    lp: dict[str, object] = logprobs if isinstance(logprobs, dict) else {"content": None, "refusal": None}
    lp[field] = [*cast(list[object], lp.get(field) or []), *entries]
    return lp


_MESSAGE_START = '"message":{"role":"assistant",'
# A tool call delta's index: `"tool_calls":[{"index":N` cannot occur unescaped inside a JSON string.
_CALL_INDEX = re.compile(r'"tool_calls":\[\{"index":(\d+)')


def _conform_response(body: str) -> str:
    """A non-streamed response as OpenAI's schema wants it: `message.refusal` present (null), and no partial DSML
    tag in a cut-off tool call's arguments. The refusal goes in as text: an unescaped `"message":{` cannot occur
    inside a JSON string, and the library writes the role first."""
    if '"tool_calls"' in body:
        return _dumps(_with_refusal(_trim_tool_arguments_in(json.loads(body))))
    k = body.find(_MESSAGE_START)
    if k < 0:
        return _dumps(_with_refusal(json.loads(body)))
    k += len(_MESSAGE_START)
    return f'{body[:k]}"refusal":null,{body[k:]}'


def _with_refusal(d: dict[str, object]) -> dict[str, object]:
    """`refusal` in each message; a message's tool calls carry no `index` (that is a stream delta's field); a message
    that only calls tools has `content` null, as OpenAI sends it (not "")."""
    for choice in cast(list[dict[str, dict[str, object]]], d.get("choices") or []):
        message = choice.get("message", {})
        message.setdefault("refusal", None)
        calls = cast(list[dict[str, object]], message.get("tool_calls") or [])
        for call in calls:
            call.pop("index", None)
        if calls and message.get("content") == "":
            message["content"] = None
    return d


def _trim_tool_arguments(js: str) -> str:
    """A chunk's JSON with any partial DSML tag cut from the end of its tool calls' arguments."""
    return _dumps(_trim_tool_arguments_in(json.loads(js))) if '"tool_calls"' in js else js


def _trim_tool_arguments_in(d: dict[str, object]) -> dict[str, object]:
    for choice in cast(list[dict[str, dict[str, object]]], d.get("choices") or []):
        part = choice.get("message") or choice.get("delta") or {}
        for call in cast(list[dict[str, dict[str, str]]], part.get("tool_calls") or []):
            function = call.get("function") or {}
            if isinstance(function.get("arguments"), str):
                function["arguments"] = cut_partial_tag(function["arguments"])
    return d
