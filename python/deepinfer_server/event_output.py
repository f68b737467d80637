"""Anthropic Messages and OpenAI Responses output: deepseek-recipe's events as named SSE events
(`event: <name>\ndata: <JSON>`), or accumulated into the whole response for a non-stream."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, cast

from deepseek_recipe import ConversationRequest, MessagesResponse, MessagesStreamEvent, ResponsesResponse

from deepinfer_server.decoding import BaseDecoder, Generator, dumps

if TYPE_CHECKING:
    from deepinfer_server.codec import Codec

Accumulator = type[MessagesResponse] | type[ResponsesResponse]
# Only a Responses usage object has this key; deepseek-recipe leaves it 0 without a tokenizer attached.
_NO_REASONING = '"output_tokens_details":{"reasoning_tokens":0}'
# deepseek-recipe puts the message's service tier in `message_delta`'s usage too, where Anthropic's type has none.
_DELTA_TIER = ',"service_tier":"standard"'


class EventDecoder(BaseDecoder):
    """One Messages or Responses request's output."""

    __slots__ = ("final", "mend", "name")

    def __init__(
        self,
        codec: Codec,
        conv: ConversationRequest,
        generator: Generator,
        kind: Accumulator,
        response_id: str,
        model: str,
        n_prompt: int,
    ) -> None:
        super().__init__(codec, conv, generator, n_prompt, ignore_eos=False)
        self.name = kind.sse_event_name
        self.final = None if self.stream else kind(response_id, model, int(time.time()), n_prompt, 0)
        self.mend: Callable[[str], str] = _mend_response_event if kind is ResponsesResponse else _mend_delta

    def _emit(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        events = cast(Sequence[MessagesStreamEvent], chunks)
        if self.final is not None:  # non-stream: accumulate, answer once
            for ev in events:
                self.final.accumulate(ev)  # type: ignore[arg-type]
            if not last:
                return []
            body = self.final.to_json()
            return self._with_reasoning(_mend_response(body) if isinstance(self.final, ResponsesResponse) else body)
        name, mend = self.name, self.mend
        out = [mend(f"event: {name(ev)}\ndata: {ev.to_json()}") for ev in events]  # type: ignore[arg-type]
        if last and out:  # the last event carries the usage: message_delta, response.completed / incomplete
            out[-1] = self._with_reasoning(out[-1])
        return out

    def _with_reasoning(self, js: str) -> str:
        """Responses usage with the reasoning tokens counted from the engine's IDs."""
        if not self.reasoning or _NO_REASONING not in js:
            return js
        return js.replace(_NO_REASONING, f'"output_tokens_details":{{"reasoning_tokens":{self.reasoning}}}', 1)


def _mend_delta(event: str) -> str:
    return event.replace(_DELTA_TIER, "", 1) if event.startswith("event: message_delta\n") else event


# Keys deepseek-recipe writes in a Response that OpenAI's published schema does not have, and fields it writes as
# null where the schema has no null (absent instead).
_UNDECLARED = ("content_filters", "frequency_penalty", "moderation", "presence_penalty", "store")
_NOT_NULL = ("user", "safety_identifier", "prompt_cache_key", "usage")
_LIFECYCLE = ("event: response.created\n", "event: response.in_progress\n", "event: response.completed\n")
_LIFECYCLE_END = ("event: response.incomplete\n", "event: response.failed\n")


def _mend_response_event(event: str) -> str:
    """The events that carry the whole Response (created, in progress, completed ...) as OpenAI's schema has it."""
    if not event.startswith(_LIFECYCLE) and not event.startswith(_LIFECYCLE_END):
        return event
    head, _, data = event.partition("\ndata: ")
    d = json.loads(data)
    _mend(d["response"])
    return f"{head}\ndata: {dumps(d)}"


def _mend_response(body: str) -> str:
    d = json.loads(body)
    _mend(d)
    return dumps(d)


def _mend(response: dict[str, object]) -> None:
    for key in _UNDECLARED:
        response.pop(key, None)
    for key in _NOT_NULL:
        if response.get(key, "") is None:
            del response[key]
