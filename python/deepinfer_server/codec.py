"""deepseek-recipe codec: request body -> prompt token IDs and sampling; token batches -> the protocol's output.

The Rust front end calls `Codec.prepare` on a codec thread (conversion and encoding release the GIL) and
`decode_batch` once per batch of rank outputs, so Python runs once per batch, never per token. One path serves
every door: only the conversion (`_convert`) and the output's wire format (`chat_output`, `event_output`) depend on
the protocol. The shared output machinery is in `decoding`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Union

from deepseek_recipe import (
    ChatCompletionRequest,
    Conversation,
    ConversationRequest,
    ConversionError,
    ConversionOptions,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    MessagesRequest,
    MessagesResponse,
    ModelVersion,
    ResponsesRequest,
    ResponsesResponse,
    Tokenizer,
)

from deepinfer_server.chat_output import Decoder
from deepinfer_server.completion_output import CompletionDecoder
from deepinfer_server.decoding import FINISHED, RUNNING, STOPPED_EARLY, BaseDecoder, Generator
from deepinfer_server.engine.base import TokenLogprob
from deepinfer_server.event_output import EventDecoder
from deepinfer_server.grammar import (
    ANY_OBJECT,
    CALLS_OPEN,
    DSML,
    SCHEMA_EBNF,
    SCHEMA_JSON,
    SCHEMA_NAMES,
    SCHEMA_REGEX,
    Constraint,
    GrammarCache,
    GrammarError,
    GrammarLimits,
    GrammarTooCostly,
    answer_or_calls_ebnf,
    anthropic_schema_problem,
    tool_calls_ebnf,
)
from deepinfer_server.images import Images, ResolvedImages, sources_of
from deepinfer_server.prompt_encoder import LengthGuard, PromptTooLong, RecipeEncoder
from deepinfer_server.prompt_encoder import build as build_prompt_encoder
from deepinfer_server.prompt_logprobs import PromptTokens
from deepinfer_server.vocabulary import Vocabulary, system_fingerprint

__all__ = ["FINISHED", "RUNNING", "STOPPED_EARLY", "Codec", "Decoder", "Prepared", "decode_batch"]

# The protocol codes Rust passes (rust/protocol.rs, `Protocol::code`).
CHAT, COMPLETIONS, MESSAGES, RESPONSES = 0, 1, 2, 3


def error_body(
    message: str, etype: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> str:
    """The OpenAI error envelope."""
    return json.dumps({"error": {"message": message, "type": etype, "param": param, "code": code or etype}})


# deepseek-recipe leaves `param` null; its messages name the field in one of these ways: (pattern, the param as a
# template of the pattern's groups, or None for its first group).
_PARAM_IN_MESSAGE = (
    (re.compile(r"^Invalid '([\w.\[\]]+)'"), None),  # Invalid 'stop[0]': empty string...
    (re.compile(r"^Invalid (\w+) value"), None),  # Invalid temperature value, the valid range ...
    (re.compile(r"^\.?((?:messages|input)\[\d+\](?:\.[\w\[\]]+)*)"), None),  # .messages[0].content: ...
    (re.compile(r"^Stop string array too long"), "stop"),
    # The conversation's structure: which message is at fault depends on the others.
    (
        re.compile(r"^(An assistant message with 'tool_calls'|Messages with role 'tool'|Invalid assistant message)"),
        "messages",
    ),
    (
        re.compile(r"^(Duplicate 'call_id'|No tool call found for tool output|No tool output found for tool call)"),
        "input",
    ),
    (re.compile(r"^Duplicate value for '\w+' .* in message\[(\d+)\]", re.S), "messages[{0}]"),
    (re.compile(r"^Invalid json schema"), "response_format"),
    (re.compile(r"^Prompt must contain the word 'json'"), "response_format"),
    (re.compile(r"^Invalid schema for function '[^']*'"), "tools"),
    (re.compile(r"^Invalid tool parameters schema"), "tools"),
    (re.compile(r"^Unsupported custom tool"), "tools"),
    (re.compile(r"^Currently custom tools are not allowed inside a namespace\..* in ([\w.\[\]]+?)\.?$", re.S), None),
    (re.compile(r"^(Cannot use strict tool|response_format should not be used with tools)"), "tools"),
)

_BAD_IMAGE_DATA = re.compile(r"Invalid base64 data|data url", re.I)

# The request field a constraint comes from, per door: (schema's field, tools' field).
_SCHEMA_PARAM = {CHAT: "response_format", RESPONSES: "text.format", MESSAGES: "output_config.format"}
_THINKING_TOOL_CHOICE = "Thinking mode does not support this tool_choice"
# deepseek-recipe's refusals of strict tools beside a response format or beside non-strict tools.
_STRICT_REFUSALS = (
    "response_format should not be used with tools",
    "Cannot use strict tool with non-strict tool in the same request",
)


def with_param(body: str, protocol: int = CHAT) -> str:
    """A deepseek-recipe error envelope with `param` filled in from its message, where the message names one."""
    try:
        d = json.loads(body)
        err = d["error"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(err, dict) or err.get("param") is not None:
        return body
    message = str(err.get("message", ""))
    if protocol != CHAT and "response_format" in message:
        # deepseek-recipe words every door's refusals in chat's field names: say the one this door has.
        message = err["message"] = message.replace("response_format", _SCHEMA_PARAM.get(protocol, "response_format"))
        body = json.dumps(d)
    if err.get("code") == "invalid_request_error" and _BAD_IMAGE_DATA.search(message):
        err["code"] = "invalid_image_url"  # the images' own refusals have codes (images.py); this one is the recipe's
    elif err.get("code") == "invalid_request_error" and "uploaded an unsupported image" in message:
        err["code"] = "unsupported_image_type"  # a data URL's media type deepseek-recipe does not take
    for pattern, param in _PARAM_IN_MESSAGE:
        m = pattern.match(message)
        if m:
            err["param"] = param.format(*m.groups()) if param else m.group(1)
            if err["param"] == "response_format":
                err["param"] = _SCHEMA_PARAM.get(protocol, "response_format")
            return json.dumps(d)
    return body


class FormatBesideTools(GrammarError):
    """A response format that cannot stand beside tools: the response format's field is at fault."""


_MakeGenerator = Callable[[str, str], Generator]


@dataclass(frozen=True)
class _Converted:
    conv: ConversationRequest
    generator: _MakeGenerator  # (response id, model) -> the door's chunk generator
    # What the prompt renders: the request's conversation, or (a Messages request with an output format) the same
    # with the schema deepseek-recipe's own structured-output prompt section carries.
    conversation: Conversation


@dataclass(frozen=True)
class _Encoded:
    conv: ConversationRequest
    ids: list[int]
    generator: _MakeGenerator  # (response id, model) -> the door's chunk generator
    images: ResolvedImages | None = None

    @property
    def image_tokens(self) -> int:
        """Prompt tokens the images take beyond their placeholders."""
        return 0 if self.images is None else self.images.extra_tokens


@dataclass(frozen=True)
class Prepared:
    """What `Codec.prepare` hands to the dispatcher."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    decoder: BaseDecoder | CompletionDecoder
    first_chunks: list[str]
    incremental: bool  # decode as tokens arrive (streams, stop sequences), or once at the end
    logprobs: int | None = None  # logprobs asked for: alternatives per token
    prompt_logprobs: bool = False  # the prompt tokens' logprobs asked for (with the first token)
    constraint: tuple[int, str, list[int], int | None] | None = None  # (schema_type, schema, triggers, bound)
    # The request's images for the rank: (file, prompt tokens beyond the placeholders, [(width, height, bytes)]).
    images: tuple[str, int, list[tuple[int, int, int]]] | None = None


class Codec:
    """Request conversion and prompt encoding. Built once at start-up; thread-safe."""

    def __init__(
        self,
        tokenizer_path: str | Path,
        served_model_names: Sequence[str],
        max_model_len: int,
        model_version: str = "v4.1",
        prompt_encoder: str = "auto",
        fingerprint: str | None = None,
        default_thinking: bool = True,
        images: Images | None = None,
        grammar_limits: GrammarLimits | None = None,
    ) -> None:
        # deepseek-recipe's tokenizer (~50 MB for DeepSeek's vocabulary) stays alive only if deepseek-recipe encodes
        # the prompts; with fastokens it is needed at start-up alone, to check fastokens against it.
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        tokenizer_json = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
        fingerprint = fingerprint or system_fingerprint(model_version, max_model_len)
        self.vocab = vocab = Vocabulary(tokenizer_path, tokenizer_json, fingerprint)
        version = ModelVersion.DeepseekV41Flash if model_version == "v4.1" else ModelVersion.DeepseekV4Pro
        options = ConversionOptions().with_default_thinking_mode(default_thinking)
        for name in served_model_names:
            options = options.with_model_alias(name, version)
        self.options = options
        renderer = DeepseekV41Encoding() if version == ModelVersion.DeepseekV41Flash else DeepseekV4Encoding()
        self.length_guard = LengthGuard.for_tokenizer(tokenizer_json, vocab.token_bytes, max_model_len)
        self.encoder = build_prompt_encoder(
            prompt_encoder,
            tokenizer_json,
            tokenizer,
            renderer,
            options,
            served_model_names[0],
            self.length_guard,
        )
        del tokenizer_json
        self.max_model_len = max_model_len
        self.grammar_limits = grammar_limits or GrammarLimits()
        self.grammars = GrammarCache(self.grammar_limits)
        self.images = images  # None: image input is refused
        # Requests with logprobs need deepseek-recipe's tokenizer (vocabulary.py). The deepseek-recipe prompt encoder
        # holds one anyway: share it. Otherwise (fastokens encodes the prompts) it is loaded on first use.
        if isinstance(self.encoder, RecipeEncoder):
            vocab.share_recipe_tokenizer(tokenizer)

    def prepare(
        self,
        body: bytes,
        response_id: str,
        model: str,
        ignore_eos: bool,
        include_usage: bool,
        continuous_usage: bool,
        protocol: int = CHAT,
        forced_tool: str | None = None,
        parallel_tools: bool = True,
        images: dict[str, bytes] | None = None,
    ) -> Prepared | tuple[int, str]:
        """Convert and encode one request. Returns `Prepared`, or `(status, error envelope)` for a bad request.

        `body` was validated and normalized by the Rust front end (model checked, developer -> system,
        max_completion_tokens -> max_tokens, unsupported features rejected). Error envelopes are OpenAI's; Rust
        re-wraps them for the Messages door. `forced_tool`: a tool choice that forces a call ("" any tool, else
        its name; Rust checked it names one of the tools). `images`: the request's image URLs the front end
        fetched, and their bytes.
        """
        if protocol == COMPLETIONS:
            return self._prepare_completion(body, response_id, model, ignore_eos, include_usage, continuous_usage)
        encoded = self._encode(body, protocol, forced_tool is not None, images)
        if not isinstance(encoded, _Encoded):
            return encoded
        conv, ids = encoded.conv, encoded.ids
        n_prompt = len(ids) + encoded.image_tokens
        try:
            max_tokens = conv.resolve_max_tokens(n_prompt, self.max_model_len)
        except ConversionError as e:
            return e.status_code, with_param(e.body, protocol)
        constraint = self._request_constraint(conv, body, protocol, forced_tool, parallel_tools)
        if isinstance(constraint, tuple):
            return constraint
        opts = conv.inference_options
        generator = encoded.generator(response_id, model)
        decoder: BaseDecoder
        # vLLM's prompt_logprobs (the front end checked it): the raw text test spares most requests a parse.
        scored = protocol == CHAT and b'"prompt_logprobs"' in body
        scored = scored and json.loads(body).get("prompt_logprobs") is not None
        if scored and encoded.images is not None:
            msg = "'prompt_logprobs' is not available for a prompt with images (their tokens are the engine's own)"
            return 400, error_body(msg, param="prompt_logprobs")
        if protocol == CHAT:
            stream_usage = include_usage and conv.stream
            decoder = Decoder(
                self.vocab, conv, generator, response_id, model, n_prompt, ignore_eos, stream_usage, continuous_usage
            )
            if scored:
                decoder.want_prompt_logprobs(PromptTokens(self.vocab, ids))
        else:
            kind = MessagesResponse if protocol == MESSAGES else ResponsesResponse
            decoder = EventDecoder(self.vocab, conv, generator, kind, response_id, model, n_prompt, ignore_eos)
        pictures, blob = encoded.images, None
        if pictures is not None and self.images is not None:
            sizes = [(w, h, len(d)) for (w, h), d in zip(pictures.sizes, pictures.data, strict=True)]
            blob = (self.images.write_blob(pictures), pictures.extra_tokens, sizes)
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
        self, body: bytes, protocol: int, forced_tool: str | None = None, parallel_tools: bool = True
    ) -> tuple[int, str]:
        """A request's grammar checked (compiled, cached) before it waits for a slot: (200, "") or (400, envelope).
        Its prepare then finds the grammar in the cache."""
        converted = self._converted(body, protocol, forced_tool is not None)
        if not isinstance(converted, _Converted):
            return converted
        got = self._request_constraint(converted.conv, body, protocol, forced_tool, parallel_tools)
        return got if isinstance(got, tuple) else (200, "")

    def _request_constraint(
        self, conv: ConversationRequest, body: bytes, protocol: int, forced_tool: str | None, parallel_tools: bool
    ) -> Constraint | tuple[int, str] | None:
        """`constraint` for a request, or the 400 naming the field its grammar came from."""
        schema = client_schema(body, protocol)
        if protocol == MESSAGES and schema is not None and (problem := anthropic_schema_problem(json.loads(schema))):
            param = _SCHEMA_PARAM[MESSAGES]
            return 400, error_body(f"Invalid '{param}.schema': {problem}.", param=f"{param}.schema")
        try:
            return self.constraint(conv, forced_tool, parallel_tools, schema, strict_tools(body, protocol), protocol)
        except GrammarError as e:
            param = "tool_choice" if forced_tool is not None else _SCHEMA_PARAM.get(protocol, "response_format")
            if forced_tool is None and (oc := conv.inference_options.output_constraint) and oc.kind != "json":
                about_format = isinstance(e, FormatBesideTools) or schema is not None
                param = "tools" if oc.kind.startswith("tool_call") and not about_format else param
            code = "grammar_too_complex" if isinstance(e, GrammarTooCostly) else "invalid_grammar"
            return 400, error_body(f"Invalid '{param}': the grammar cannot be enforced: {e}", code=code, param=param)

    def constraint(
        self,
        conv: ConversationRequest,
        forced_tool: str | None = None,
        parallel_tools: bool = True,
        schema: str | None = None,
        strict: frozenset[str] = frozenset(),
        protocol: int = CHAT,
    ) -> Constraint | None:
        """The grammar of a request's output, as DeepInfer's so_args carry it, compiled (cached) to check it.

        - A forced tool call (`forced_tool`, or deepseek-recipe's own): the tool-call block only.
        - Tools with `auto` beside a response format: the answer in that format or a tool-call block (OpenAI serves
          the combination; deepseek-recipe refuses it for strict tools, `_converted`).
        - A response format alone: its JSON schema (the client's own `schema`, which deepseek-recipe's strict-mode
          copy would weaken by dropping keywords such as minItems), `json_object` or a regex.
        - Tools with `auto` alone: held from the block's first DSML token on, strict tools (`strict`, by name) to
          their schema, the others free; with no strict tool, nothing.
        Raises GrammarError."""
        oc = conv.inference_options.output_constraint
        stage = conv.parsing_options.thinking_initial_stage
        # Constrained from `</think>` on while the output starts in the reasoning.
        in_reasoning = stage is not None and stage.starts_in_reasoning()
        after_think: tuple[int, ...] = (self.vocab.think_end_id,) if in_reasoning else ()
        kind = oc.kind if oc is not None else None
        tools = json.loads(oc.schema) if oc is not None and kind in ("tool_call", "tool_call_required") else []
        if forced_tool is not None or kind == "tool_call_required":
            if forced_tool:
                tools = [t for t in tools if (t.get("function") or t).get("name") == forced_tool]
            # deepseek-recipe's own forced call (thinking off) opens the block in the prompt; otherwise the grammar
            # opens it, after the reasoning.
            opened = kind == "tool_call_required" and conv.parsing_options.starts_in_tool_calls
            grammar = tool_calls_ebnf(tools, "" if opened else CALLS_OPEN, parallel_tools, self.grammar_limits)
            return self._checked(SCHEMA_EBNF, grammar, () if opened else after_think)
        answer = self._answer_format(conv, schema, protocol)
        names = [str((t.get("function") or t).get("name")) for t in tools]
        free = frozenset(n for n in names if n not in strict)
        if tools and answer is not None:
            answer_type, answer_schema = answer
            if answer_type == SCHEMA_REGEX:
                raise FormatBesideTools("a regex response format cannot be combined with tools")
            grammar = answer_or_calls_ebnf(answer_schema, tools, parallel_tools, self.grammar_limits, free)
            return self._checked(SCHEMA_EBNF, grammar, after_think)
        if answer is not None:
            answer_type, answer_schema = answer
            return self._checked(answer_type, answer_schema or ANY_OBJECT, after_think)
        if tools and len(free) < len(tools):
            # The text before the block, and whether to call at all, stay free.
            grammar = tool_calls_ebnf(tools, CALLS_OPEN.split(DSML, 1)[1], parallel_tools, self.grammar_limits, free)
            return self._checked(SCHEMA_EBNF, grammar, (self.vocab.dsml_id,))
        return None

    @staticmethod
    def _answer_format(conv: ConversationRequest, schema: str | None, protocol: int) -> tuple[int, str | None] | None:
        """The response format a request's answer must take: (SCHEMA_JSON, its schema or None for any object) or
        (SCHEMA_REGEX, the pattern); None when the answer is free text."""
        if protocol == MESSAGES:  # Anthropic's output format (deepseek-recipe's Messages conversion leaves it out)
            return None if schema is None else (SCHEMA_JSON, schema)
        oc = conv.inference_options.output_constraint
        if oc is not None and oc.kind == "json":
            return SCHEMA_JSON, (oc.schema and schema) or oc.schema or None
        if oc is not None and oc.kind == "regex":
            return SCHEMA_REGEX, oc.schema
        # Beside tools deepseek-recipe's constraint is the tools': the format stays in the conversation.
        c = conv.conversation
        if c.response_format == "json_object":
            return SCHEMA_JSON, None
        if c.response_format == "json_schema":
            return SCHEMA_JSON, schema or json.dumps(c.response_schema, separators=(",", ":"), ensure_ascii=False)
        if c.response_format == "regex" and c.response_regex:
            return SCHEMA_REGEX, c.response_regex
        return None

    def _checked(self, schema_type: int, schema: str, triggers: tuple[int, ...]) -> Constraint:
        self.grammars.check(SCHEMA_NAMES[schema_type], schema)
        return Constraint(schema_type, schema, triggers)

    def _prepare_completion(
        self, body: bytes, response_id: str, model: str, ignore_eos: bool, include_usage: bool, continuous: bool
    ) -> Prepared | tuple[int, str]:
        """A raw prompt (text, or token IDs that Rust checked), with `suffix` as fill-in-the-middle."""
        d = json.loads(body)
        prompt, suffix = d["prompt"], d.get("suffix")
        try:
            ids = self.completion_prompt(prompt, suffix)
        except PromptTooLong as e:
            return 400, self._too_long(f"at least {e.at_least}", "prompt")
        except ValueError as e:
            return 400, error_body(str(e), param="suffix" if suffix is not None else "prompt")
        vocab_size = self.vocab.vocab_size
        if any(i >= vocab_size for i in ids):
            return 400, error_body(f"token IDs must be below the vocabulary size {vocab_size}", param="prompt")
        n_prompt, max_tokens = len(ids), int(d["max_tokens"])
        if n_prompt + max(1, max_tokens) > self.max_model_len:
            return 400, error_body(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                "Please reduce the length of the prompt or the completion.",
                code="context_length_exceeded",
                param="max_tokens",
            )
        stop = d.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        echo = "" if not d.get("echo") else prompt if isinstance(prompt, str) else self.vocab.text_of(ids)
        stream = bool(d.get("stream"))
        logprobs = d.get("logprobs")
        # The prompt's logprobs: the echo's (`echo` with `logprobs`, OpenAI's scoring idiom) or vLLM's extension.
        vllm_prompt = d.get("prompt_logprobs") is not None
        scored = (bool(echo) and logprobs is not None) or vllm_prompt
        decoder = CompletionDecoder(
            self.vocab,
            response_id,
            model,
            n_prompt,
            stream,
            ignore_eos,
            include_usage,
            continuous,
            stops,
            echo,
            logprobs,
            prompt=PromptTokens(self.vocab, ids, hide_first=isinstance(prompt, str) and ids[:1] == [self.vocab.bos_id])
            if scored
            else None,
            vllm_prompt_logprobs=vllm_prompt,
            discard=max_tokens == 0,
        )
        temperature, top_p = d.get("temperature"), d.get("top_p")
        if scored:  # the model's own distribution (the front end turned top-k off and checked the rest)
            temperature = top_p = None
        return Prepared(
            prompt_ids=ids,
            max_tokens=max(1, max_tokens),  # max_tokens 0: the engine makes one token, which is dropped
            temperature=round(1.0 if temperature is None else float(temperature), 6),
            top_p=round(1.0 if top_p is None else float(top_p), 6),
            decoder=decoder,
            first_chunks=decoder.start(),
            incremental=stream or bool(stops),
            logprobs=logprobs,
            prompt_logprobs=scored,
        )

    def completion_prompt(self, prompt: str | list[int], suffix: str | None) -> list[int]:
        """Prompt IDs of a raw prompt: BOS and the text as plain text (special-token spellings stay text), or the
        IDs as given; with a suffix, DeepSeek's fill-in-the-middle layout."""
        bos = self.vocab.bos_id
        ids = list(prompt) if isinstance(prompt, list) else [bos, *self.encoder.encode_text(prompt)]
        if suffix is None:
            return ids
        if self.vocab.fim is None:
            raise ValueError("'suffix' (fill-in-the-middle) needs FIM tokens, and this model's tokenizer has none")
        begin, hole, end = self.vocab.fim
        head = ids[1:] if ids[:1] == [bos] else ids
        return [bos, begin, *head, hole, *self.encoder.encode_text(suffix), end]

    def tokenize(self, body: bytes, protocol: int, images: dict[str, bytes] | None = None) -> tuple[int, str]:
        """vLLM's `POST /tokenize`: a chat body's prompt IDs (what its request would count), or a raw prompt's. An
        image is one placeholder ID in `tokens`; `count` adds the tokens the engine expands it to."""
        d = json.loads(body)
        extra = 0
        if "messages" in d:
            encoded = self._encode(body, CHAT, images=images)
            if not isinstance(encoded, _Encoded):
                return encoded
            ids, extra = encoded.ids, encoded.image_tokens
        else:
            prompt = d.get("prompt")
            if not isinstance(prompt, str):
                return 400, error_body("'prompt' (a string) or 'messages' is required", param="prompt")
            try:
                text = self.encoder.encode_text(prompt)
            except PromptTooLong as e:
                return 400, self._too_long(f"at least {e.at_least}", "prompt")
            ids = [self.vocab.bos_id, *text] if d.get("add_special_tokens", True) else text
        out = {"count": len(ids) + extra, "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        return 200, json.dumps(out)

    def detokenize(self, body: bytes, protocol: int) -> tuple[int, str]:
        """vLLM's `POST /detokenize`."""
        tokens, n = json.loads(body).get("tokens"), self.vocab.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < n for t in tokens):
            return 400, error_body(f"'tokens' must be a list of token IDs below {n}", param="tokens")
        return 200, json.dumps({"prompt": self.vocab.text_of(tokens)}, ensure_ascii=False)

    def count_tokens(self, body: bytes, protocol: int, images: dict[str, bytes] | None = None) -> tuple[int, str]:
        """`POST /v1/messages/count_tokens`: the prompt length of a request (its images' tokens included), from the
        encoder that serves it."""
        encoded = self._encode(body, protocol, images=images)
        if not isinstance(encoded, _Encoded):
            return encoded
        return 200, json.dumps({"input_tokens": len(encoded.ids) + encoded.image_tokens})

    def _encode(
        self, body: bytes, protocol: int, forced: bool = False, images: dict[str, bytes] | None = None
    ) -> _Encoded | tuple[int, str]:
        """The converted and encoded request, its images preprocessed, or (status, error envelope). `forced`: the
        tool choice forces a call, which deepseek-recipe refuses with thinking on; the server then constrains it
        itself (`constraint`). `images`: fetched bytes by URL."""
        converted = self._converted(body, protocol, forced)
        if not isinstance(converted, _Converted):
            return converted
        conv, generator = converted.conv, converted.generator
        try:
            ids = self.encoder.encode(converted.conversation)
        except RuntimeError as e:
            return 400, error_body(f"the conversation cannot be encoded: {e}")
        except PromptTooLong as e:
            return 400, self._too_long(f"at least {e.at_least}")
        resolved = None
        # Only a body that names an image can have one (reading the conversation's messages back costs a copy).
        sources = sources_of(conv.conversation.messages) if b"image" in body else []
        if sources:
            if self.images is None:
                return 400, error_body("Image input is not enabled on this server.", code="images_disabled")
            got = self.images.resolve(sources, images or {})
            if isinstance(got, tuple):
                return got
            resolved = got
        n = len(ids) + (resolved.extra_tokens if resolved is not None else 0)
        if n >= self.max_model_len:
            return 400, self._too_long(str(n))
        return _Encoded(conv, ids, generator, resolved)

    def _converted(self, body: bytes, protocol: int, forced: bool) -> _Converted | tuple[int, str]:
        """`_convert`, past deepseek-recipe's refusals of what the server enforces itself, or (status, error
        envelope): a forced tool choice in thinking mode is converted as `auto` (the grammar forces the call), and
        strict tools beside a response format or beside non-strict tools as non-strict ones (the grammar holds
        each strict tool's calls to its schema, `constraint`). OpenAI accepts both combinations."""
        try:
            for _ in range(3):
                try:
                    return self._convert(body, protocol)
                except ConversionError as e:
                    if forced and str(e) == _THINKING_TOOL_CHOICE:
                        d = json.loads(body)
                        d["tool_choice"] = {"type": "auto"} if protocol == MESSAGES else "auto"
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
            return self._convert(body, protocol)
        except ConversionError as e:
            return e.status_code, with_param(e.body, protocol)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            return 400, error_body(str(e))

    def _convert(self, body: bytes, protocol: int) -> _Converted:
        """The door's deepseek-recipe conversion, and a maker of its chunk generator (response id, model)."""
        if protocol == MESSAGES:
            m = MessagesRequest(body).convert(self.options)
            conversation = m.conversation
            schema = client_schema(body, protocol)
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
            return _Converted(m, lambda rid, model: MessagesRequest.chunk_generator(m, rid, model), conversation)
        if protocol == RESPONSES:
            req = ResponsesRequest(body)
            echo, names = req.echo(), req.namespace_tool_map(self.options)  # read before convert consumes it
            r = req.convert(self.options)

            def responses(rid: str, model: str) -> Generator:
                gen = ResponsesRequest.chunk_generator(r, rid, model).with_echo(echo)
                return gen.with_namespace_tool_map(names) if names else gen

            return _Converted(r, responses, r.conversation)
        c = ChatCompletionRequest(body).convert(self.options)
        return _Converted(c, lambda rid, model: ChatCompletionRequest.chunk_generator(c, rid, model), c.conversation)

    def _too_long(self, tokens: str, param: str = "messages") -> str:
        return error_body(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} "
            f"resulted in {tokens} tokens, which leaves no room for the completion. Please reduce the length of "
            f"the {param}.",
            code="context_length_exceeded",
            param=param,
        )


def client_schema(body: bytes, protocol: int) -> str | None:
    """The JSON schema a request's response format gives, compact, or None (read only from bodies that have one):
    chat's `response_format`, Responses' `text.format`, Messages' `output_config.format` (or the beta
    `output_format`)."""
    if b'"json_schema"' not in body:
        return None
    d = json.loads(body)
    if protocol == CHAT:
        fmt = d.get("response_format")
    elif protocol == RESPONSES:
        fmt = (d.get("text") or {}).get("format")
    else:
        fmt = (d.get("output_config") or {}).get("format") or d.get("output_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    schema = (fmt.get("json_schema") or {}).get("schema") if protocol == CHAT else fmt.get("schema")
    return None if schema is None else json.dumps(schema, separators=(",", ":"), ensure_ascii=False)


def strict_tools(body: bytes, protocol: int) -> frozenset[str]:
    """The names of the request's strict tools (chat's `function.strict`, Responses' and Messages' `strict`)."""
    if b'"strict"' not in body:
        return frozenset()
    names = set()
    for tool in json.loads(body).get("tools") or []:
        if not isinstance(tool, dict):
            continue
        fn = tool.get("function") if protocol == CHAT else tool
        if isinstance(fn, dict) and fn.get("strict") is True:
            names.add(str(fn.get("name")))
    return frozenset(names)


DecodeItem = Union[  # noqa: UP007
    tuple[BaseDecoder | CompletionDecoder, list[int], int],
    tuple[BaseDecoder | CompletionDecoder, list[int], int, list[TokenLogprob]],
]


def decode_batch(items: list[DecodeItem]) -> list[tuple[int, list[str] | str]]:
    """One call per batch of rank outputs: (decoder, new tokens, engine finish code[, logprobs]) -> (state, output)."""
    return [item[0].push(*item[1:]) for item in items]
