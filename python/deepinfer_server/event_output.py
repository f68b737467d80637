"""Anthropic Messages and OpenAI Responses output: deepseek-recipe's events as named SSE events
(`event: <name>\ndata: <JSON>`), or accumulated into the whole response for a non-stream."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

from deepseek_recipe import ConversationRequest, MessagesResponse, MessagesStreamEvent, ResponsesResponse

from deepinfer_server.decoding import BaseDecoder, Generator

if TYPE_CHECKING:
    from deepinfer_server.codec import Codec

Accumulator = type[MessagesResponse] | type[ResponsesResponse]
# Only a Responses usage object has this key; deepseek-recipe leaves it 0 without a tokenizer attached.
_NO_REASONING = '"output_tokens_details":{"reasoning_tokens":0}'


class EventDecoder(BaseDecoder):
    """One Messages or Responses request's output."""

    __slots__ = ("final", "name")

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

    def _emit(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        events = cast(Sequence[MessagesStreamEvent], chunks)
        if self.final is not None:  # non-stream: accumulate, answer once
            for ev in events:
                self.final.accumulate(ev)  # type: ignore[arg-type]
            return self._with_reasoning(self.final.to_json()) if last else []
        name = self.name
        out = [f"event: {name(ev)}\ndata: {ev.to_json()}" for ev in events]  # type: ignore[arg-type]
        if last and out:
            out[-1] = self._with_reasoning(out[-1])  # response.completed / incomplete carries the usage
        return out

    def _with_reasoning(self, js: str) -> str:
        """Responses usage with the reasoning tokens counted from the engine's IDs."""
        if not self.reasoning or _NO_REASONING not in js:
            return js
        return js.replace(_NO_REASONING, f'"output_tokens_details":{{"reasoning_tokens":{self.reasoning}}}', 1)
