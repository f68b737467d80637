"""Anthropic Messages and OpenAI Responses output: deepseek-recipe's events as named SSE events
(`event: <name>\ndata: <JSON>`), or accumulated into the whole response for a non-stream."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from typing import cast

from deepseek_recipe import ConversationRequest, MessagesResponse, MessagesStreamEvent, ResponsesResponse

from deepinfer_server._native import mend_response
from deepinfer_server.decoding import BaseDecoder, Chunk, Generator, cut_partial_tag, dumps
from deepinfer_server.vocabulary import Vocabulary

Accumulator = type[MessagesResponse] | type[ResponsesResponse]
# Only a Responses usage object has this key; deepseek-recipe leaves it 0 without a tokenizer attached.
_NO_REASONING = '"output_tokens_details":{"reasoning_tokens":0}'
_ITEM_ADDED = "event: response.output_item.added\n"
_CALL_EVENTS = (_ITEM_ADDED, "event: response.function_call_arguments.done\n")
_USAGE_EVENTS = ("event: message_delta\n", "event: response.completed\n", "event: response.incomplete\n")
# Only usage objects have these keys unescaped (a JSON string escapes its quotes).
_OUTPUT_TOKENS = re.compile(r'("(?:output_tokens|total_tokens)":)(\d+)')
_TEXT_EVENTS = ("event: response.output_text.delta", "event: response.output_text.done")
# deepseek-recipe puts the message's service tier in `message_delta`'s usage too, where Anthropic's type has none.
_DELTA_TIER = ',"service_tier":"standard"'


class EventDecoder(BaseDecoder):
    """One Messages or Responses request's output."""

    __slots__ = ("calls", "final", "mend", "name", "opened")

    def __init__(
        self,
        vocab: Vocabulary,
        conv: ConversationRequest,
        generator: Generator,
        kind: Accumulator,
        response_id: str,
        model: str,
        n_prompt: int,
        ignore_eos: bool,
    ) -> None:
        super().__init__(vocab, conv, generator, n_prompt, ignore_eos)
        self.name = kind.sse_event_name
        self.final = None if self.stream else kind(response_id, model, int(time.time()), n_prompt, 0)
        self.mend: Callable[[str], str] = _mend_response_event if kind is ResponsesResponse else _mend_delta
        self.opened = False  # whether the opening events (message_start, response.created ...) went out
        self.calls: dict[str, str] | None = {} if kind is ResponsesResponse else None  # function call id -> name

    def _flushed(self, chunks: list[Chunk]) -> Sequence[object]:
        # A Responses stream: what the finish flushes is where a cut-off call's held-back tag would surface.
        if not self.stream or self.mend is not _mend_response_event:
            return chunks
        name = self.name
        return [_trim_event(f"event: {name(ev)}\ndata: {ev.to_json()}") for ev in chunks]  # type: ignore[arg-type]

    def _emit(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        if self.opened and not last and self.final is None and self.token_strings is None:
            # A stream's deltas: the hot path, nothing to mend but a function call's `done` (Responses).
            events = cast(Sequence[MessagesStreamEvent], chunks)
            name = self.name
            if self.calls is None:
                return [f"event: {name(ev)}\ndata: {ev.to_json()}" for ev in events]  # type: ignore[arg-type]
            return [
                self._named(e) if (e := f"event: {name(ev)}\ndata: {ev.to_json()}").startswith(_CALL_EVENTS) else e  # type: ignore[arg-type]
                for ev in events
            ]
        out = self._emit_events(chunks, last)
        if self.token_strings is None:
            return out
        if isinstance(out, str):
            return self._mend_logprobs(out)
        return [self._mend_logprobs(e) for e in out]

    def _mend_logprobs(self, event: str) -> str:
        """Logprobs' token strings that spell the text (`TokenStrings`): a delta's continue the ones before it."""
        if '"logprobs":[{' not in event:
            return event
        head, _, data = event.rpartition("\ndata: ") if event.startswith("event: ") else ("", "", event)
        d = json.loads(data)
        assert self.token_strings is not None
        if head == "event: response.output_text.delta":
            self.token_strings.fix_list(d.get("logprobs"), "text")
        else:
            self.token_strings.fix_all(d)
        if head in _TEXT_EVENTS:  # OpenAI's ResponseLogProb, in these events, has no bytes
            for entry in d.get("logprobs") or []:
                entry.pop("bytes", None)
                for alt in entry.get("top_logprobs") or []:
                    alt.pop("bytes", None)
        return f"{head}\ndata: {dumps(d)}" if head else dumps(d)

    def _emit_events(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        events = cast(Sequence[MessagesStreamEvent], chunks)
        if self.opened and not last and self.final is None:  # a stream's deltas: the hot path, nothing to mend
            name = self.name
            out = [f"event: {name(ev)}\ndata: {ev.to_json()}" for ev in events]  # type: ignore[arg-type]
            if self.calls is None:
                return out
            return [self._named(e) if e.startswith(_CALL_EVENTS) else e for e in out]
        if self.final is not None:  # non-stream: accumulate, answer once
            for ev in events:
                self.final.accumulate(ev)  # type: ignore[arg-type]
            if not last:
                return []
            body = self.final.to_json()
            body = _mend_response(body) if isinstance(self.final, ResponsesResponse) else body
            return self._usage(body)
        name = self.name
        out = [ev if isinstance(ev, str) else f"event: {name(ev)}\ndata: {ev.to_json()}" for ev in events]  # type: ignore[arg-type]
        if self.calls is not None:
            out = [self._named(e) if e.startswith(_CALL_EVENTS) else e for e in out]
        # Only the opening and the closing events carry what needs mending (the whole response, the final usage);
        # the deltas between them go out as they are.
        if last or not self.opened:
            self.opened = True
            mend = self.mend
            out = [mend(e) for e in out]
            if last:
                out = [self._usage(e) if e.startswith(_USAGE_EVENTS) else e for e in out]
        return out

    def _named(self, event: str) -> str:
        """deepseek-recipe leaves out the function's name that OpenAI's `function_call_arguments.done` event
        carries: take it from the call's `output_item.added`."""
        if event.startswith(_ITEM_ADDED) and '"function_call"' not in event:
            return event  # a message or reasoning item: no call to remember (and no parse)
        head, _, data = event.partition("\ndata: ")
        d = json.loads(data)
        calls = cast(dict[str, str], self.calls)
        if head == "event: response.output_item.added":
            item = d.get("item") or {}
            if item.get("type") == "function_call":
                calls[str(item.get("id"))] = str(item.get("name"))
            return event
        if "name" in d or str(d.get("item_id")) not in calls:
            return event
        d["name"] = calls[str(d["item_id"])]
        return f"{head}\ndata: {dumps(d)}"

    def _usage(self, js: str) -> str:
        """The final usage as the engine counted it: reasoning tokens from its IDs (Responses), and the EOS tokens
        that `ignore_eos` kept out of the text."""
        if self.reasoning and _NO_REASONING in js:
            js = js.replace(_NO_REASONING, f'"output_tokens_details":{{"reasoning_tokens":{self.reasoning}}}', 1)
        if self.dropped_eos:
            add = self.dropped_eos
            js = _OUTPUT_TOKENS.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + add}", js)
        return js


def _mend_delta(event: str) -> str:
    return event.replace(_DELTA_TIER, "", 1) if event.startswith("event: message_delta\n") else event


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
