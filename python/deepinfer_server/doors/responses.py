"""OpenAI Responses (`POST /v1/responses`): deepseek-recipe's `ResponsesRequest` conversion (with its echo of the
request and its namespaced tools), and its events mended to OpenAI's published schema."""

from __future__ import annotations

import json
from typing import cast

from deepseek_recipe import ConversationRequest, ConversionOptions, ResponsesRequest, ResponsesResponse

from deepinfer_server import _native
from deepinfer_server._native import mend_response
from deepinfer_server.decoding import BaseDecoder, Generator, cut_partial_tag, dumps
from deepinfer_server.doors.base import Request
from deepinfer_server.doors.conversation import ConversationDoor, Converted
from deepinfer_server.doors.events import EventDecoder, EventWire
from deepinfer_server.prompt_logprobs import PromptTokens
from deepinfer_server.vocabulary import Vocabulary


class ResponsesDoor(ConversationDoor):
    code = _native.DOOR_RESPONSES
    schema_param = "text.format"

    def convert(self, body: bytes, options: ConversionOptions) -> Converted:
        req = ResponsesRequest(body)
        echo, names = req.echo(), req.namespace_tool_map(options)  # read before convert consumes it
        r = req.convert(options)

        def responses(rid: str, model: str) -> Generator:
            gen = ResponsesRequest.chunk_generator(r, rid, model).with_echo(echo)
            return gen.with_namespace_tool_map(names) if names else gen

        return Converted(r, responses, r.conversation)

    def client_schema(self, body: bytes) -> str | None:
        """`text.format.schema`."""
        if b'"json_schema"' not in body:
            return None
        fmt = (json.loads(body).get("text") or {}).get("format")
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return None
        schema = fmt.get("schema")
        return None if schema is None else dumps(schema)

    def decoder(
        self,
        vocab: Vocabulary,
        conv: ConversationRequest,
        generator: Generator,
        req: Request,
        n_prompt: int,
        prompt: PromptTokens | None,
    ) -> BaseDecoder:
        return EventDecoder(vocab, conv, generator, WIRE, req.response_id, req.model, n_prompt, req.ignore_eos)


# Keys deepseek-recipe writes in a Response that OpenAI's published schema does not have, and fields it writes as
# null where the schema has no null (absent instead).
_UNDECLARED = ("content_filters", "frequency_penalty", "moderation", "presence_penalty", "store")
_NOT_NULL = ("user", "safety_identifier", "prompt_cache_key", "usage")
_LIFECYCLE = ("event: response.created\n", "event: response.in_progress\n", "event: response.completed\n")
_LIFECYCLE_END = ("event: response.incomplete\n", "event: response.failed\n")


def _mend_response_event(event: str) -> str:
    """The events that carry the whole Response (created, in progress, completed ...) as OpenAI's schema has it:
    cut as text in Rust (`mend_response`), parsed here only when a function call's arguments may need trimming."""
    if not event.startswith(_LIFECYCLE) and not event.startswith(_LIFECYCLE_END):
        return event
    head, _, data = event.partition("\ndata: ")
    mended = mend_response(data, True)
    if mended is None:
        d = json.loads(data)
        _mend(d["response"])
        mended = dumps(d)
    return f"{head}\ndata: {mended}"


def _mend_response(body: str) -> str:
    mended = mend_response(body, False)
    if mended is not None:
        return mended
    d = json.loads(body)
    _mend(d)
    return dumps(d)


def _mend(response: dict[str, object]) -> None:
    for key in _UNDECLARED:
        response.pop(key, None)
    for key in _NOT_NULL:
        if response.get(key, "") is None:
            del response[key]
    for item in cast(list[dict[str, object]], response.get("output") or []):
        _trim_arguments(item)
    fmt = cast(dict[str, object], response.get("text") or {}).get("format")
    if isinstance(fmt, dict) and fmt.get("description", "") is None:
        del fmt["description"]  # echoed from a json_schema format; OpenAI's schema has it a string when present


def _trim_arguments(item: dict[str, object]) -> None:
    if isinstance(item.get("arguments"), str):
        item["arguments"] = cut_partial_tag(cast(str, item["arguments"]))


def _trim_event(event: str) -> str:
    """A flushed Responses event without a partial DSML tag at the end of a function call's arguments."""
    if '"arguments"' not in event and not event.startswith("event: response.function_call_arguments.delta\n"):
        return event
    head, _, data = event.partition("\ndata: ")
    d = json.loads(data)
    if isinstance(d.get("delta"), str):
        d["delta"] = cut_partial_tag(d["delta"])
    _trim_arguments(d)
    if isinstance(d.get("item"), dict):
        _trim_arguments(d["item"])
    if isinstance(d.get("response"), dict):
        _mend(d["response"])
    return f"{head}\ndata: {dumps(d)}"


WIRE = EventWire(ResponsesResponse, _mend_response_event, _mend_response, _trim_event, names_calls=True)
