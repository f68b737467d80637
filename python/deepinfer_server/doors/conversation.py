"""The path every conversation door shares (Chat, Responses, Messages): deepseek-recipe converts the request into
one `ConversationRequest`; from there on, encoding, the length guard, images, the grammar and the sampling are the
same for all, and only the decoder's wire format differs again.

A door subclasses `ConversationDoor` and supplies what is its own: the conversion (`convert`), where its response
format and strict tools are in the body, and its decoder. Conversion and encoding release the GIL.
"""

from __future__ import annotations

import json
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from deepseek_recipe import Conversation, ConversationRequest, ConversionError, ConversionOptions

from deepinfer_server._native import SubmitImages
from deepinfer_server.decoding import BaseDecoder, Generator
from deepinfer_server.doors.base import Context, Door, Prepared, PrepareInput, Prompt
from deepinfer_server.grammar import Constraint, GrammarError, GrammarTooCostly
from deepinfer_server.images import ResolvedImages, sources_of
from deepinfer_server.prompt_encoder import PromptTooLong
from deepinfer_server.prompt_logprobs import PromptTokens
from deepinfer_server.refusals import Refusal, error_body, too_long, with_param
from deepinfer_server.request_grammar import AnswerFormat, FormatBesideTools, converted_answer_format
from deepinfer_server.token_ids import Asked, TokenIds
from deepinfer_server.vocabulary import Vocabulary

MakeGenerator = Callable[[str, str], Generator]  # (response id, model) -> the door's chunk generator

_THINKING_TOOL_CHOICE = "Thinking mode does not support this tool_choice"
# deepseek-recipe's refusals of strict tools beside a response format or beside non-strict tools.
_STRICT_REFUSALS = (
    "response_format should not be used with tools",
    "Cannot use strict tool with non-strict tool in the same request",
)


@dataclass(frozen=True)
class Converted:
    """A door's deepseek-recipe conversion."""

    conv: ConversationRequest
    generator: MakeGenerator
    # What the prompt renders: the request's conversation, or (a Messages request with an output format) the same
    # with the schema deepseek-recipe's own structured-output prompt section carries.
    conversation: Conversation


@dataclass(frozen=True)
class _Encoded:
    conv: ConversationRequest
    ids: list[int]
    generator: MakeGenerator
    images: ResolvedImages | None = None

    @property
    def image_tokens(self) -> int:
        """Prompt tokens the images take beyond their placeholders."""
        return 0 if self.images is None else self.images.extra_tokens


class ConversationDoor(Door):
    """A door whose requests deepseek-recipe converts: the shared path, around the door's own parts."""

    tool_choice_auto: ClassVar[Any] = "auto"  # how the door spells tool_choice auto
    takes_prompt_logprobs: ClassVar[bool] = False  # vLLM's `prompt_logprobs` (the front end checked it)
    takes_token_ids: ClassVar[bool] = False  # vLLM's `return_token_ids`, `return_tokens_as_token_ids` (checked too)

    # -- the door's own parts ----------------------------------------------------------------------------------
    @abstractmethod
    def convert(self, body: bytes, options: ConversionOptions) -> Converted:
        """deepseek-recipe's conversion of the door's request. Raises ConversionError (and ValueError ...)."""

    @abstractmethod
    def client_schema(self, body: bytes) -> str | None:
        """The JSON schema the request's response format gives, compact, as the client wrote it; or None."""

    @abstractmethod
    def decoder(
        self,
        vocab: Vocabulary,
        conv: ConversationRequest,
        generator: Generator,
        req: PrepareInput,
        n_prompt: int,
        prompt: PromptTokens | None,
    ) -> BaseDecoder:
        """The request's decoder. `prompt`: the prompt's tokens, when their logprobs were asked for."""

    def tool_function(self, tool: dict[str, Any]) -> object:
        """Where a tool's `name` and `strict` are (Chat nests them in `function`)."""
        return tool

    def answer_format(self, conv: ConversationRequest, schema: str | None) -> AnswerFormat | None:
        """The response format the answer must take: what the conversion carries (`schema`: the client's own)."""
        return converted_answer_format(conv, schema)

    def schema_problem(self, schema: str) -> str | None:
        """Why the door refuses a response format's schema before any grammar work, or None."""
        return None

    def schema_field(self, body: bytes) -> str:
        """The field the request's response format is in, as a refusal names it."""
        return self.schema_param

    def strict_tools(self, body: bytes) -> frozenset[str]:
        """The names of the request's strict tools."""
        if b'"strict"' not in body:
            return frozenset()
        names = set()
        for tool in json.loads(body).get("tools") or []:
            if not isinstance(tool, dict):
                continue
            fn = self.tool_function(tool)
            if isinstance(fn, dict) and fn.get("strict") is True:
                names.add(str(fn.get("name")))
        return frozenset(names)

    # -- the shared path ---------------------------------------------------------------------------------------
    def prepare(self, ctx: Context, body: bytes, req: PrepareInput) -> Prepared | Refusal:
        encoded = self.encode(ctx, body, req.forced_tool is not None, req.images)
        if not isinstance(encoded, _Encoded):
            return encoded
        conv, ids = encoded.conv, encoded.ids
        n_prompt = len(ids) + encoded.image_tokens
        try:
            max_tokens = conv.resolve_max_tokens(n_prompt, ctx.max_model_len)
        except ConversionError as e:
            return Refusal(e.status_code, with_param(e.body, self.schema_param))
        constraint = self.request_constraint(ctx, conv, body, req.forced_tool, req.parallel_tools)
        if isinstance(constraint, Refusal):
            return constraint
        opts = conv.inference_options
        generator = encoded.generator(req.response_id, req.model)
        # vLLM's prompt_logprobs (the front end checked it): the raw text test spares most requests a parse.
        scored = self.takes_prompt_logprobs and b'"prompt_logprobs"' in body
        scored = scored and json.loads(body).get("prompt_logprobs") is not None
        if scored and encoded.images is not None:
            msg = "'prompt_logprobs' is not available for a prompt with images (their tokens are the engine's own)"
            return Refusal(400, error_body(msg, param="prompt_logprobs"))
        prompt = PromptTokens(ctx.vocab, ids) if scored else None
        decoder = self.decoder(ctx.vocab, conv, generator, req, n_prompt, prompt)
        asked = Asked.of(body) if self.takes_token_ids else Asked()
        if asked.any:
            stops = list(conv.parsing_options.stop_sequences or [])
            logprobs = decoder.logprobs is not None
            decoder.token_ids = TokenIds(ctx.vocab, ids, asked, logprobs, stops, decoder.think_end_id)
        pictures, blob = encoded.images, None
        if pictures is not None and ctx.images is not None:
            sizes = [(w, h, len(d)) for (w, h), d in zip(pictures.sizes, pictures.data, strict=True)]
            blob = SubmitImages(path=ctx.images.write_blob(pictures), extra_tokens=pictures.extra_tokens, sizes=sizes)
        # A request that scores its prompt runs at the model's own distribution (the front end turned top-k off).
        temperature, top_p = (None, None) if scored else (opts.temperature, opts.top_p)
        return Prepared(
            prompt_ids=ids,
            max_tokens=max_tokens,
            temperature=round(temperature if temperature is not None else 1.0, 6),
            top_p=round(top_p if top_p is not None else 1.0, 6),
            decoder=decoder,
            first_chunks=decoder.start(),
            incremental=conv.stream or bool(conv.parsing_options.stop_sequences),
            logprobs=decoder.logprobs,
            prompt_logprobs=scored,
            constraint=None if constraint is None else constraint.record(),
            images=blob,
        )

    def check_constraint(
        self, ctx: Context, body: bytes, forced_tool: str | None, parallel_tools: bool
    ) -> Refusal | None:
        converted = self.converted(ctx, body, forced_tool is not None)
        if not isinstance(converted, Converted):
            return converted
        got = self.request_constraint(ctx, converted.conv, body, forced_tool, parallel_tools)
        return got if isinstance(got, Refusal) else None

    def prompt_tokens(self, ctx: Context, body: bytes, images: dict[str, bytes] | None) -> Prompt | Refusal:
        encoded = self.encode(ctx, body, False, images)
        if not isinstance(encoded, _Encoded):
            return encoded
        return Prompt(encoded.ids, encoded.image_tokens)

    def encode(self, ctx: Context, body: bytes, forced: bool, images: dict[str, bytes] | None) -> _Encoded | Refusal:
        """The converted and encoded request, its images preprocessed, or (status, error envelope). `forced`: the
        tool choice forces a call, which deepseek-recipe refuses with thinking on; the server then constrains it
        itself (`request_constraint`). `images`: fetched bytes by URL."""
        converted = self.converted(ctx, body, forced)
        if not isinstance(converted, Converted):
            return converted
        conv, generator = converted.conv, converted.generator
        try:
            ids = ctx.encoder.encode(converted.conversation)
        except RuntimeError as e:
            return Refusal(400, error_body(f"the conversation cannot be encoded: {e}"))
        except PromptTooLong as e:
            return Refusal(400, too_long(ctx.max_model_len, f"at least {e.at_least}"))
        resolved = None
        # Only a body that names an image can have one (reading the conversation's messages back costs a copy).
        sources = sources_of(conv.conversation.messages) if b"image" in body else []
        if sources:
            if ctx.images is None:
                return Refusal(400, error_body("Image input is not enabled on this server.", code="images_disabled"))
            got = ctx.images.resolve(sources, images or {})
            if isinstance(got, Refusal):
                return got
            resolved = got
        n = len(ids) + (resolved.extra_tokens if resolved is not None else 0)
        if n >= ctx.max_model_len:
            return Refusal(400, too_long(ctx.max_model_len, str(n)))
        return _Encoded(conv, ids, generator, resolved)

    def converted(self, ctx: Context, body: bytes, forced: bool) -> Converted | Refusal:
        """`convert`, past deepseek-recipe's refusals of what the server enforces itself, or (status, error
        envelope): a forced tool choice in thinking mode is converted as `auto` (the grammar forces the call), and
        strict tools beside a response format or beside non-strict tools as non-strict ones (the grammar holds
        each strict tool's calls to its schema, `request_constraint`). OpenAI accepts both combinations."""
        try:
            for _ in range(3):
                try:
                    return self.convert(body, ctx.options)
                except ConversionError as e:
                    if forced and str(e) == _THINKING_TOOL_CHOICE:
                        d = json.loads(body)
                        d["tool_choice"] = self.tool_choice_auto
                    elif str(e) in _STRICT_REFUSALS:
                        d = json.loads(body)
                        for tool in d.get("tools") or []:
                            if isinstance(tool, dict):
                                tool.pop("strict", None)
                                if isinstance(tool.get("function"), dict):
                                    tool["function"].pop("strict", None)
                    else:
                        raise
                    body = json.dumps(d).encode()
            return self.convert(body, ctx.options)
        except ConversionError as e:
            return Refusal(e.status_code, with_param(e.body, self.schema_param))
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            return Refusal(400, error_body(str(e)))

    def request_constraint(
        self, ctx: Context, conv: ConversationRequest, body: bytes, forced_tool: str | None, parallel_tools: bool
    ) -> Constraint | Refusal | None:
        """The request's grammar (request_grammar.py), or the 400 naming the field it came from."""
        schema = self.client_schema(body)
        if schema is not None and (problem := self.schema_problem(schema)):
            param = self.schema_field(body)
            return Refusal(400, error_body(f"Invalid '{param}.schema': {problem}.", param=f"{param}.schema"))
        try:
            answer = self.answer_format(conv, schema)
            return ctx.grammars.constraint(conv, forced_tool, parallel_tools, answer, self.strict_tools(body))
        except GrammarError as e:
            param = "tool_choice" if forced_tool is not None else self.schema_field(body)
            if forced_tool is None and (oc := conv.inference_options.output_constraint) and oc.kind != "json":
                about_format = isinstance(e, FormatBesideTools) or schema is not None
                param = "tools" if oc.kind.startswith("tool_call") and not about_format else param
            code = "grammar_too_complex" if isinstance(e, GrammarTooCostly) else "invalid_grammar"
            return Refusal(
                400, error_body(f"Invalid '{param}': the grammar cannot be enforced: {e}", code=code, param=param)
            )
