"""The event doors' output (Anthropic Messages, OpenAI Responses): deepseek-recipe's events as named SSE events
(`event: <name>\ndata: <JSON>`), or accumulated into the whole response for a non-stream. What each door mends on
the way out is its own (`EventWire`, in doors/messages.py and doors/responses.py)."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

from deepseek_recipe import ConversationRequest, MessagesResponse, MessagesStreamEvent, ResponsesResponse

from deepinfer_server.decoding import BaseDecoder, Chunk, Generator, dumps
from deepinfer_server.vocabulary import Vocabulary

# Only a Responses usage object has this key; deepseek-recipe leaves it 0 without a tokenizer attached.
_NO_REASONING = '"output_tokens_details":{"reasoning_tokens":0}'
_ITEM_ADDED = "event: response.output_item.added\n"
_CALL_EVENTS = (_ITEM_ADDED, "event: response.function_call_arguments.done\n")
_USAGE_EVENTS = ("event: message_delta\n", "event: response.completed\n", "event: response.incomplete\n")
# Only usage objects have these keys unescaped (a JSON string escapes its quotes).
_OUTPUT_TOKENS = re.compile(r'("(?:output_tokens|total_tokens)":)(\d+)')
_TEXT_EVENTS = ("event: response.output_text.delta", "event: response.output_text.done")


@dataclass(frozen=True)
class EventWire:
    """An event door's output: its accumulator, and what it mends on the way out."""

    accumulator: type[MessagesResponse] | type[ResponsesResponse]
    mend_event: Callable[[str], str]  # the opening and closing events (the whole response, the final usage)
    mend_body: Callable[[str], str] | None = None  # a non-stream's whole response
    trim_flushed: Callable[[str], str] | None = None  # a stream's events flushed at the finish
    names_calls: bool = False  # `function_call_arguments.done` gets the call's name (Responses)
    # The tail an output with logprobs ended with (decoding.py `Tail`), added as (text, its logprob entries): to
    # a non-stream's whole response, and to a stream's last events. None: the door has no logprobs.
    # (Each takes the field it goes in, "content" or "reasoning_content", then the text and the entries.)
    tail_body: Callable[[str, str, str, list[dict[str, object]]], str] | None = None
    tail_events: Callable[[list[str], str, str, list[dict[str, object]]], list[str]] | None = None


class EventDecoder(BaseDecoder):
    """One Messages or Responses request's output."""

    __slots__ = ("calls", "final", "mend", "mend_body", "name", "opened", "tail_body", "tail_events", "trim")

    def __init__(
        self,
        vocab: Vocabulary,
        conv: ConversationRequest,
        generator: Generator,
        wire: EventWire,
        response_id: str,
        model: str,
        n_prompt: int,
        ignore_eos: bool,
    ) -> None:
        super().__init__(vocab, conv, generator, n_prompt, ignore_eos)
        kind = wire.accumulator
        self.name = kind.sse_event_name
        self.final = None if self.stream else kind(response_id, model, int(time.time()), n_prompt, 0)
        self.mend = wire.mend_event
        self.mend_body = wire.mend_body
        self.trim = wire.trim_flushed
        self.tail_body, self.tail_events = wire.tail_body, wire.tail_events
        self.opened = False  # whether the opening events (message_start, response.created ...) went out
        self.calls: dict[str, str] | None = {} if wire.names_calls else None  # function call id -> name

    def _flushed(self, chunks: list[Chunk]) -> Sequence[object]:
        # A stream: what the finish flushes is where a cut-off call's held-back tag would surface.
        trim = self.trim
        if not self.stream or trim is None:
            return chunks
        name = self.name
        return [trim(f"event: {name(ev)}\ndata: {ev.to_json()}") for ev in chunks]  # type: ignore[arg-type]

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
            return self._with_tail(self._mend_logprobs(out))
        return self._tail_events([self._mend_logprobs(e) for e in out])

    def _with_tail(self, body: str) -> str:
        """A non-stream's response with the tail the output ended with (`Tail`) in its answer."""
        tail, add = self.ended_tail, self.tail_body
        if tail is None or add is None:
            return body
        return add(body, self.tail_field, tail.text(), tail.entries())

    def _tail_events(self, out: list[str]) -> list[str]:
        """A stream's last events with the tail the output ended with (`Tail`) in its answer."""
        tail, add = self.ended_tail, self.tail_events
        if tail is None or add is None:
            return out
        return add(out, self.tail_field, tail.text(), tail.entries())

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
            body = self.mend_body(body) if self.mend_body is not None else body
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
        if self.uncounted:
            add = self.uncounted
            js = _OUTPUT_TOKENS.sub(lambda m: f"{m.group(1)}{int(m.group(2)) + add}", js)
        return js
