"""OpenAI Responses (`POST /v1/responses`): deepseek-recipe's `ResponsesRequest` conversion (with its echo of the
request and its namespaced tools), and its events mended to OpenAI's published schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, cast

from deepseek_recipe import ConversationRequest, ConversionOptions, ResponsesRequest, ResponsesResponse

from deepinfer_server import _native
from deepinfer_server._native import mend_response
from deepinfer_server.decoding import BaseDecoder, Generator, cut_partial_tag, dumps
from deepinfer_server.doors.base import PrepareInput
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
        req: PrepareInput,
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


# What each `text.format` type holds in OpenAI's Response schema.
_FORMAT_KEYS = {
    "text": ("type",),
    "json_object": ("type",),
    "json_schema": ("type", "name", "schema", "description", "strict"),
}


def _mend(response: dict[str, object]) -> None:
    for key in _UNDECLARED:
        response.pop(key, None)
    for key in _NOT_NULL:
        if response.get(key, "") is None:
            del response[key]
    for item in cast(list[dict[str, object]], response.get("output") or []):
        _trim_arguments(item)
    fmt = cast(dict[str, object], response.get("text") or {}).get("format")
    if isinstance(fmt, dict):
        # Echoed from the request: only the keys OpenAI's schema declares for its type (a client's extra key is
        # not part of the Response), and no null description (a string when present).
        declared = _FORMAT_KEYS.get(str(fmt.get("type")), ("type",))
        for key in [k for k in fmt if k not in declared or (k == "description" and fmt[k] is None)]:
            del fmt[key]


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


# The tail an output ended with (decoding.py `Tail`): its text (and, in the answer, its logprob entries) goes at the
# end of the last part of its kind, or, in the answer, in a message of its own when the output had none (as
# deepseek-recipe opens one for the text it sees).

Entries = list[dict[str, object]]


@dataclass(frozen=True)
class _Kind:
    """Where a tail goes: the answer (a message's output_text, with logprobs) or the reasoning (no logprobs)."""

    item: str
    part: str
    logprobs: bool

    @property
    def done(self) -> str:
        return f"event: response.{self.part}.done\n"


# A tail in a function call's arguments ("tool_calls") is counted, but its U+FFFD is not added to them (the many
# events that repeat the arguments are not mended for it).
_KINDS = {
    "content": _Kind("message", "output_text", True),
    "reasoning_content": _Kind("reasoning", "reasoning_text", False),
}
_CLOSING = ("event: response.completed\n", "event: response.incomplete\n")


def _tail_body(body: str, field: str, text: str, entries: Entries) -> str:
    """A non-stream's Response with the tail (`field`: "content" or "reasoning_content") in its output."""
    kind = _KINDS.get(field)
    if kind is None:
        return body  # in a function call's arguments: see `_KINDS`
    d = json.loads(body)
    _add_to_response(d, kind, text, entries)
    return dumps(d)


def _tail_events(out: list[str], field: str, text: str, entries: Entries) -> list[str]:
    """A stream's last events with the tail: its own delta before its text's `done` (or, in an answer with no
    text before it, the events of a message of its own before the closing event), its text and entries in every
    event after that repeats the whole text, and the sequence numbers after it moved on."""
    kind = _KINDS.get(field)
    if kind is None:
        return out  # in a function call's arguments: see `_KINDS`
    at = next((i for i, e in enumerate(out) if e.startswith(kind.done)), -1)
    if at >= 0:
        done = _data(out[at])
        added = [_delta(kind, done["item_id"], done["output_index"], text, entries)]
    else:
        at = next((i for i, e in enumerate(out) if e.startswith(_CLOSING)), -1)
        if at < 0 or not kind.logprobs:
            return out  # a reasoning of nothing but the tail: no reasoning item to put it in
        response = _data(out[at])["response"]
        added = _message_events(_message(response, text, entries), len(response.get("output") or []))
    seq = int(_data(out[at])["sequence_number"])
    events = [*added, *map(_data, out[at:])]
    mended = []
    for n, d in enumerate(events):
        d["sequence_number"] = seq + n
        if n >= len(added):
            _add_to_event(d, kind, text, entries)
        mended.append(f"event: {d['type']}\ndata: {dumps(d)}")
    return [*out[:at], *mended]


def _data(event: str) -> dict[str, Any]:
    return cast(dict[str, Any], json.loads(event.partition("\ndata: ")[2]))


def _add_to_event(d: dict[str, object], kind: _Kind, text: str, entries: Entries) -> None:
    """An event after the tail's own: whatever whole text of its kind it repeats gets the tail."""
    if d.get("type") == f"response.{kind.part}.done":
        d["text"] = str(d.get("text") or "") + text
        if kind.logprobs:
            d["logprobs"] = [*cast(list[object], d.get("logprobs") or []), *map(_without_bytes, entries)]
    elif isinstance(d.get("part"), dict):
        _add_to_part(cast(dict[str, object], d["part"]), kind, text, entries)
    elif isinstance(d.get("item"), dict):
        _add_to_item(cast(dict[str, object], d["item"]), kind, text, entries)
    elif isinstance(d.get("response"), dict):
        _add_to_response(cast(dict[str, object], d["response"]), kind, text, entries)


def _add_to_response(response: dict[str, object], kind: _Kind, text: str, entries: Entries) -> None:
    output = cast(list[dict[str, object]], response.setdefault("output", []))
    items = [item for item in output if item.get("type") == kind.item]
    if items:
        _add_to_item(items[-1], kind, text, entries)
    elif kind.logprobs:
        output.append(_message(response, text, entries))


def _add_to_item(item: dict[str, object], kind: _Kind, text: str, entries: Entries) -> None:
    if item.get("type") != kind.item:
        return
    parts = [p for p in cast(list[dict[str, object]], item.get("content") or []) if p.get("type") == kind.part]
    if parts:
        _add_to_part(parts[-1], kind, text, entries)


def _add_to_part(part: dict[str, object], kind: _Kind, text: str, entries: Entries) -> None:
    if part.get("type") != kind.part:
        return
    part["text"] = str(part.get("text") or "") + text
    if kind.logprobs:
        part["logprobs"] = [*cast(list[object], part.get("logprobs") or []), *entries]


def _message(response: dict[str, object], text: str, entries: Entries) -> dict[str, object]:
    """The message item deepseek-recipe would have opened for the tail's text (its ID scheme, its fields)."""
    index = len(cast(list[object], response.get("output") or []))
    return {
        "type": "message",
        "id": f"msg_{response.get('id')}_{index}",
        "status": "incomplete" if response.get("status") == "incomplete" else "completed",
        "role": "assistant",
        "phase": "final_answer",
        "content": [{"type": "output_text", "annotations": [], "logprobs": entries, "text": text}],
    }


def _message_events(item: dict[str, Any], index: int) -> list[dict[str, object]]:
    """A message's stream events, from its opening to its `output_item.done` (sequence numbers left to fill)."""
    part = item["content"][0]
    text, entries, item_id = part["text"], part["logprobs"], item["id"]
    at = {"content_index": 0, "item_id": item_id, "output_index": index}
    opened = {**item, "status": "in_progress", "content": []}
    return [
        {"type": "response.output_item.added", "item": opened, "output_index": index},
        {"type": "response.content_part.added", **at, "part": {**part, "logprobs": [], "text": ""}},
        _delta(_KINDS["content"], item_id, index, text, entries),
        {"type": "response.output_text.done", **at, "logprobs": [_without_bytes(e) for e in entries], "text": text},
        {"type": "response.content_part.done", **at, "part": part},
        {"type": "response.output_item.done", "item": item, "output_index": index},
    ]


def _delta(kind: _Kind, item_id: object, index: object, text: str, entries: Entries) -> dict[str, object]:
    d: dict[str, object] = {"type": f"response.{kind.part}.delta", "content_index": 0, "delta": text}
    d["item_id"] = item_id
    if kind.logprobs:
        d["logprobs"] = [_without_bytes(e) for e in entries]
    d["output_index"] = index
    return d


def _without_bytes(entry: dict[str, object]) -> dict[str, object]:
    """A logprob entry as OpenAI's text events have it: no `bytes` (ResponseLogProb)."""
    alternatives = cast(list[dict[str, object]], entry["top_logprobs"])
    top = [{k: v for k, v in alt.items() if k != "bytes"} for alt in alternatives]
    return {"token": entry["token"], "logprob": entry["logprob"], "top_logprobs": top}


WIRE = EventWire(
    ResponsesResponse,
    _mend_response_event,
    _mend_response,
    _trim_event,
    names_calls=True,
    tail_body=_tail_body,
    tail_events=_tail_events,
)
