"""Anthropic Messages (`POST /v1/messages`): deepseek-recipe's `MessagesRequest` conversion, with Anthropic's
structured output (`output_config.format`, or the beta `output_format`), which that conversion leaves out, put
back into the prompt and the grammar; and its events as Anthropic's types have them."""

from __future__ import annotations

import json
from typing import Any, ClassVar

from deepseek_recipe import Conversation, ConversationRequest, ConversionOptions, MessagesRequest, MessagesResponse

from deepinfer_server import _native
from deepinfer_server.decoding import BaseDecoder, Generator, dumps
from deepinfer_server.doors.base import PrepareInput
from deepinfer_server.doors.conversation import ConversationDoor, Converted
from deepinfer_server.doors.events import EventDecoder, EventWire
from deepinfer_server.grammar import SCHEMA_JSON, anthropic_schema_problem
from deepinfer_server.prompt_logprobs import PromptTokens
from deepinfer_server.request_grammar import AnswerFormat
from deepinfer_server.vocabulary import Vocabulary


def _format(d: dict[str, Any]) -> object:
    """The output format: `output_config.format`, else the beta `output_format`."""
    return (d.get("output_config") or {}).get("format") or d.get("output_format")


# deepseek-recipe puts the message's service tier in `message_delta`'s usage too, where Anthropic's type has none.
_DELTA_TIER = ',"service_tier":"standard"'


class MessagesDoor(ConversationDoor):
    code = _native.DOOR_MESSAGES
    schema_param = "output_config.format"
    tool_choice_auto: ClassVar[Any] = {"type": "auto"}

    def convert(self, body: bytes, options: ConversionOptions) -> Converted:
        m = MessagesRequest(body).convert(options)
        conversation = m.conversation
        schema = self.client_schema(body)
        if schema is not None:
            # deepseek-recipe's Messages conversion leaves Anthropic's output format out: put its schema in the
            # prompt as chat's json_schema does (a `response_schema` makes the format json_schema).
            was = conversation
            conversation = Conversation(
                messages=was.messages,
                thinking_mode=was.thinking_mode,
                tools=was.tools,
                tool_choice=was.tool_choice,
                reasoning_effort=was.reasoning_effort,
                response_schema=json.loads(schema),
            )
        return Converted(m, lambda rid, model: MessagesRequest.chunk_generator(m, rid, model), conversation)

    def client_schema(self, body: bytes) -> str | None:
        """`output_config.format.schema`, or the beta `output_format.schema`."""
        if b'"json_schema"' not in body:
            return None
        fmt = _format(json.loads(body))
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
            return None
        schema = fmt.get("schema")
        return None if schema is None else dumps(schema)

    def schema_field(self, body: bytes) -> str:
        d = json.loads(body)
        return "output_format" if not (d.get("output_config") or {}).get("format") and _format(d) else self.schema_param

    def answer_format(self, conv: ConversationRequest, schema: str | None) -> AnswerFormat | None:
        # The conversion carries none of Anthropic's output format: the client's schema is the answer's, as written.
        return None if schema is None else (SCHEMA_JSON, schema)

    def schema_problem(self, schema: str) -> str | None:
        return anthropic_schema_problem(json.loads(schema))

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


def _mend_delta(event: str) -> str:
    return event.replace(_DELTA_TIER, "", 1) if event.startswith("event: message_delta\n") else event


WIRE = EventWire(MessagesResponse, _mend_delta)
