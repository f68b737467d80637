"""deepseek-recipe codec: request body -> prompt token IDs and sampling; token batches -> chat completion chunks.

The Rust front end calls `Codec.prepare` on a codec thread (conversion and encoding release the GIL) and
`decode_batch` once per batch of rank outputs, so Python runs once per batch, never per token.

Output tokens are detokenized here and fed to the deepseek-recipe StreamProcessor as text with their token counts.
With a tokenizer attached, the processor re-tokenizes the whole reasoning text at the finish to report
`reasoning_tokens` (about 0.8 us per output token, in one call that stalls the rank's other streams); counting the
engine's reasoning token IDs gives the true figure for free. A byte-level BPE tokenizer (DeepSeek's) detokenizes
by table: each token is a fixed byte string, so a batch is one join and an incremental UTF-8 decode. Any other
tokenizer goes through `tokenizers.DecodeStream`, one Rust call per batch.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from deepseek_recipe import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ConversationRequest,
    ConversionError,
    ConversionOptions,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    InferenceChunk,
    InferenceFinishReason,
    ModelVersion,
    PromptUsage,
    SpecialToken,
    StreamProcessor,
    Tokenizer,
)
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from deepinfer_server import __version__, _native
from deepinfer_server.prompt_encoder import LengthGuard, PromptTooLong
from deepinfer_server.prompt_encoder import build as build_prompt_encoder

# Decode results, read by Rust (rust/codec.rs).
RUNNING, FINISHED, STOPPED_EARLY = 0, 1, 2

_ENGINE_FINISH = {
    _native.FINISH_STOP: InferenceFinishReason.Stop,
    _native.FINISH_LENGTH: InferenceFinishReason.Length,
}


def error_body(
    message: str, etype: str = "invalid_request_error", code: str | None = None, param: str | None = None
) -> str:
    """The OpenAI error envelope."""
    return json.dumps({"error": {"message": message, "type": etype, "param": param, "code": code or etype}})


# deepseek-recipe leaves `param` null; its messages name the field in one of these ways: (pattern, the param, or
# None for the pattern's first group).
_PARAM_IN_MESSAGE = (
    (re.compile(r"^Invalid '([\w.\[\]]+)'"), None),  # Invalid 'stop[0]': empty string...
    (re.compile(r"^Invalid (\w+) value"), None),  # Invalid temperature value, the valid range ...
    (re.compile(r"^\.?(messages\[\d+\](?:\.[\w\[\]]+)*)"), None),  # .messages[0].content: ...
    (re.compile(r"^Stop string array too long"), "stop"),
    # The conversation's structure: which message is at fault depends on the others.
    (
        re.compile(r"^(An assistant message with 'tool_calls'|Messages with role 'tool'|Invalid assistant message)"),
        "messages",
    ),
)


def with_param(body: str) -> str:
    """A deepseek-recipe error envelope with `param` filled in from its message, where the message names one."""
    try:
        d = json.loads(body)
        err = d["error"]
    except (ValueError, KeyError, TypeError):
        return body
    if not isinstance(err, dict) or err.get("param") is not None:
        return body
    message = str(err.get("message", ""))
    for pattern, param in _PARAM_IN_MESSAGE:
        m = pattern.match(message)
        if m:
            err["param"] = param or m.group(1)
            return json.dumps(d)
    return body


def system_fingerprint(*parts: object) -> str:
    """`system_fingerprint`: names the server build and backend configuration (OpenAI types it as a string)."""
    digest = hashlib.sha256("|".join(map(str, (__version__, *parts))).encode()).hexdigest()
    return f"fp_{digest[:10]}"


@dataclass(frozen=True)
class Prepared:
    """What `Codec.prepare` hands to the dispatcher."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    decoder: Decoder
    first_chunks: list[str]
    incremental: bool  # decode as tokens arrive (streams, stop sequences), or once at the end


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
    ) -> None:
        # deepseek-recipe's tokenizer (~50 MB for DeepSeek's vocabulary) stays alive only if deepseek-recipe encodes
        # the prompts; with fastokens it is needed at start-up alone, to check fastokens against it.
        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        tokenizer_json = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
        self.token_bytes = byte_level_table(tokenizer_json)
        # Loaded only when there is no byte table (DeepSeek's vocabulary costs ~50 MB as a tokenizers object).
        self.detokenizer = HFTokenizer.from_file(str(tokenizer_path)) if self.token_bytes is None else None
        version = ModelVersion.DeepseekV41Flash if model_version == "v4.1" else ModelVersion.DeepseekV4Pro
        options = ConversionOptions()
        for name in served_model_names:
            options = options.with_model_alias(name, version)
        self.options = options
        renderer = DeepseekV41Encoding() if version == ModelVersion.DeepseekV41Flash else DeepseekV4Encoding()
        self.length_guard = LengthGuard.for_tokenizer(tokenizer_json, self.token_bytes, max_model_len)
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
        self.fingerprint = fingerprint or system_fingerprint(model_version, max_model_len)
        self.eos_id = tokenizer.encode(SpecialToken.Eos.default_str())[0]
        self.think_end_id = tokenizer.encode(SpecialToken.ThinkingEnd.default_str())[0]

    def prepare(
        self, body: bytes, response_id: str, model: str, ignore_eos: bool, include_usage: bool, continuous_usage: bool
    ) -> Prepared | tuple[int, str]:
        """Convert and encode one request. Returns `Prepared`, or `(status, error envelope)` for a bad request.

        `body` was validated and normalized by the Rust front end (model checked, developer -> system,
        max_completion_tokens -> max_tokens, unsupported features rejected).
        """
        try:
            conv = ChatCompletionRequest(body).convert(self.options)
        except ConversionError as e:
            return e.status_code, with_param(e.body)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            return 400, error_body(str(e))
        try:
            ids = self.encoder.encode(conv.conversation)
        except RuntimeError as e:
            return 400, error_body(f"the conversation cannot be encoded: {e}")
        except PromptTooLong as e:
            return 400, self._too_long(f"at least {e.at_least}")
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            return 400, self._too_long(str(n_prompt))
        try:
            max_tokens = conv.resolve_max_tokens(n_prompt, self.max_model_len)
        except ConversionError as e:
            return e.status_code, with_param(e.body)
        opts = conv.inference_options
        decoder = Decoder(
            self, conv, response_id, model, n_prompt, ignore_eos, include_usage and conv.stream, continuous_usage
        )
        return Prepared(
            prompt_ids=ids,
            max_tokens=max_tokens,
            temperature=round(opts.temperature if opts.temperature is not None else 1.0, 6),
            top_p=round(opts.top_p if opts.top_p is not None else 1.0, 6),
            decoder=decoder,
            first_chunks=decoder.start(),
            incremental=conv.stream or bool(conv.parsing_options.stop_sequences),
        )

    def _too_long(self, tokens: str) -> str:
        return error_body(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your messages "
            f"resulted in {tokens} tokens, which leaves no room for the completion. Please reduce the length of "
            "the messages.",
            code="context_length_exceeded",
            param="messages",
        )


def byte_level_table(tokenizer_json: dict[str, object]) -> list[bytes] | None:
    """Each token ID's bytes when the tokenizer's decoder is plain ByteLevel, else None.

    Mirrors the ByteLevel decoder: a token whose characters all map to bytes (the GPT-2 byte alphabet) becomes
    those bytes; any other token (a special token such as <｜end▁of▁sentence｜>) stays its UTF-8 text. An added
    token's spelling wins over a model token with the same ID, as in the tokenizer's own decoding.
    """
    decoder, model = tokenizer_json.get("decoder"), tokenizer_json.get("model")
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel" or not isinstance(model, dict):
        return None
    added = tokenizer_json.get("added_tokens") or []
    vocab = model.get("vocab") or {}
    if not isinstance(vocab, dict) or not isinstance(added, list):
        return None
    entries = [*vocab.items(), *((str(t["content"]), int(t["id"])) for t in added)]
    char_to_byte = {c: b for b, c in enumerate(_byte_alphabet())}
    table = [b""] * (max((i for _, i in entries), default=-1) + 1)
    for token, i in entries:
        try:
            table[i] = bytes([char_to_byte[c] for c in token])
        except KeyError:
            table[i] = token.encode("utf-8")
    return table


def _byte_alphabet() -> list[str]:
    """The character GPT-2's byte-level BPE uses for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


class _TableText:
    """Byte-level detokenizing: join the tokens' bytes, decode UTF-8 holding back an unfinished character."""

    __slots__ = ("table", "utf8")

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens: list[int]) -> str:
        table = self.table
        try:
            data = b"".join([table[t] for t in tokens])
        except IndexError:  # an ID past the vocabulary (a padded output layer): no text, as tokenizer.decode does
            data = b"".join([table[t] for t in tokens if t < len(table)])
        return str(self.utf8.decode(data))

    def flush(self) -> str:
        return str(self.utf8.decode(b"", True))  # an unfinished character becomes U+FFFD


class _StreamText:
    """Any other tokenizer: `tokenizers.DecodeStream`, which holds a whole batch that ends inside a character."""

    __slots__ = ("held", "stream", "tokenizer")

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=False)
        self.held: list[int] = []

    def feed(self, tokens: list[int]) -> str:
        text = self.stream.step(self.tokenizer, tokens[0] if len(tokens) == 1 else tokens)  # an int is 2x faster
        if text is None:
            self.held += tokens
            return ""
        self.held = []
        return text

    def flush(self) -> str:
        text, self.held = self.tokenizer.decode(self.held, False) if self.held else "", []
        return text


class Decoder:
    """One request's output side: a deepseek-recipe StreamProcessor plus the OpenAI wire details around it."""

    __slots__ = (
        "continuous",
        "done",
        "dropped_eos",
        "eos_id",
        "final",
        "fingerprint",
        "ignore_eos",
        "include_usage",
        "n_out",
        "n_prompt",
        "proc",
        "reasoning",
        "stream",
        "text",
        "text_ids",
        "think_end_id",
    )

    def __init__(
        self,
        codec: Codec,
        conv: ConversationRequest,
        response_id: str,
        model: str,
        n_prompt: int,
        ignore_eos: bool,
        include_usage: bool,
        continuous_usage: bool,
    ) -> None:
        generator = ChatCompletionRequest.chunk_generator(conv, response_id, model)
        options = conv.parsing_options
        self.proc = StreamProcessor(generator, options)  # text in: see the module docstring
        table, detokenizer = codec.token_bytes, codec.detokenizer
        self.text = _TableText(table) if table is not None else _StreamText(cast(HFTokenizer, detokenizer))
        self.text_ids = 0  # token IDs fed since the last text went out: that text's token count
        stage = options.thinking_initial_stage
        # Reasoning tokens: None outside thinking mode; counted until the engine's </think> when it starts in one.
        self.reasoning: int | None = None if stage is None else 0
        in_reasoning = stage is not None and stage.starts_in_reasoning()
        self.think_end_id: int | None = codec.think_end_id if in_reasoning else None
        self.stream: bool = conv.stream
        self.final = None if self.stream else ChatCompletionResponse(response_id, model, int(time.time()), n_prompt, 0)
        self.n_prompt = n_prompt
        self.n_out = 0
        self.dropped_eos = 0
        self.eos_id = codec.eos_id
        self.fingerprint = codec.fingerprint
        self.ignore_eos = ignore_eos
        self.include_usage = include_usage
        self.continuous = continuous_usage and include_usage
        self.done = False

    def start(self) -> list[str]:
        """Chunks to send before any token: the role delta (streams only)."""
        usage = PromptUsage(prompt_tokens=self.n_prompt, prompt_cache_hit_tokens=0)
        ready = InferenceChunk.ready(prompt_usage=usage, system_fingerprint=self.fingerprint)
        out = self._emit(self.proc.push(ready), last=False)
        return out if isinstance(out, list) else []

    def push(self, tokens: list[int], finish: int) -> tuple[int, list[str] | str]:
        """Feed one batch of engine tokens (and the engine's finish code) and return (state, output).

        Output is a list of chunk JSON strings for a stream, or the whole response JSON once a non-stream finishes.
        """
        if self.done:
            return FINISHED, []
        if self.ignore_eos:
            if self.eos_id in tokens:
                kept = [t for t in tokens if t != self.eos_id]
                self.dropped_eos += len(tokens) - len(kept)
                tokens = kept
        elif finish == _native.FINISH_STOP and tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]  # the engine's EOS is never text
        proc = self.proc
        chunks: list[object] = []
        if tokens:
            self.n_out += len(tokens)
            self._count_reasoning(tokens)
            chunks.extend(self._push_text(tokens))
        state = RUNNING
        if proc.finished:  # a stop sequence matched: the rank must be told to abort
            chunks += proc.finish()
            state = FINISHED if finish in _ENGINE_FINISH else STOPPED_EARLY
        elif finish in _ENGINE_FINISH:
            rest = self.text.flush()  # the output ends inside a character: its bytes become U+FFFD
            if rest or self.text_ids:
                chunks += proc.push(InferenceChunk.text(rest, self.text_ids))
            flushed = proc.push(InferenceChunk.finish(_ENGINE_FINISH[finish])) + proc.finish()
            # Streams: what the finish flushes is where a cut-off tool call's held-back tag would surface.
            chunks += [_trim_tool_arguments(ch.to_json()) for ch in flushed] if self.stream else flushed
            state = FINISHED
        if state != RUNNING:
            self.done = True
            proc.close()
        return state, self._emit(chunks, last=state != RUNNING)

    def _push_text(self, tokens: list[int]) -> Sequence[object]:
        """Detokenize one batch and push the text that is complete, with the token IDs it came from."""
        text = self.text.feed(tokens)
        self.text_ids += len(tokens)
        if not text:
            return []
        n, self.text_ids = self.text_ids, 0
        return self.proc.push(InferenceChunk.text(text, n))

    def _count_reasoning(self, tokens: list[int]) -> None:
        end_id = self.think_end_id
        if end_id is None:
            return
        if end_id in tokens:
            self.reasoning = (self.reasoning or 0) + tokens.index(end_id)
            self.think_end_id = None
        else:
            self.reasoning = (self.reasoning or 0) + len(tokens)

    def _emit(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        """Chunk objects (or, from a stream's finish, their JSON already) -> the wire output of this batch."""
        if self.final is not None:  # non-stream: accumulate, answer once
            for ch in chunks:
                if isinstance(ch, ChatCompletionChunk):
                    self.final.accumulate(ch)
            if not last:
                return []
            body = _conform_response(self.final.to_json())
            spliced = self._splice_usage(body)
            if spliced is not None:
                return spliced
            d = json.loads(body)
            self._fix_usage(d["usage"])
            return _dumps(d)
        out = [
            ch if isinstance(ch, str) else ch.to_json() for ch in chunks if isinstance(ch, (str, ChatCompletionChunk))
        ]
        if last:
            return self._finish_stream(out)
        if self.continuous:
            tail = self._usage_tail()
            out = [js[:-13] + tail if js.endswith('"usage":null}') else js for js in out]
        return out

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
        parsing can apply it (kept EOS tokens change numbers). Only usage holds an unescaped
        '"prompt_cache_hit_tokens":' (strings escape '"'): reasoning_tokens goes in just before it."""
        if self.dropped_eos == 0 and self.reasoning is None:
            return js
        k = js.find('"prompt_cache_hit_tokens":') if self.dropped_eos == 0 else -1
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
        """Add the EOS tokens that ignore_eos kept out of the text, and the counted reasoning tokens."""
        if self.dropped_eos:
            for key in ("completion_tokens", "total_tokens"):
                usage[key] = int(usage[key]) + self.dropped_eos  # type: ignore[call-overload]
        if self.reasoning is not None:
            tail = {k: usage.pop(k) for k in list(usage) if k.startswith("prompt_cache_")}
            usage["completion_tokens_details"] = {"reasoning_tokens": self.reasoning}
            usage.update(tail)
        return usage


_MESSAGE_START = '"message":{"role":"assistant",'
# What a DSML tag starts with: a tool call cut off inside one leaves its start held back by deepseek-recipe, which
# flushes it into the arguments at the finish.
_DSML_TAGS = ("<" + SpecialToken.Dsml.default_str(), "</" + SpecialToken.Dsml.default_str())


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
    """`refusal` in each message; a message's tool calls carry no `index` (that is a stream delta's field)."""
    for choice in cast(list[dict[str, dict[str, object]]], d.get("choices") or []):
        message = choice.get("message", {})
        message.setdefault("refusal", None)
        for call in cast(list[dict[str, object]], message.get("tool_calls") or []):
            call.pop("index", None)
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
                function["arguments"] = _cut_partial_tag(function["arguments"])
    return d


def _cut_partial_tag(text: str) -> str:
    """`text` without a trailing, unfinished DSML tag (`</｜DSML｜param`, `</`, `<`): model markup, not arguments."""
    k = text.rfind("<")
    tail = text[k:]
    if k < 0 or ">" in tail:
        return text
    if any(tag.startswith(tail) or tail.startswith(tag) for tag in _DSML_TAGS):
        return text[:k]
    return text


def _dumps(d: object) -> str:
    return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


def decode_batch(items: list[tuple[Decoder, list[int], int]]) -> list[tuple[int, list[str] | str]]:
    """One call per batch of rank outputs: (decoder, new tokens, engine finish code) -> (state, output)."""
    return [decoder.push(tokens, finish) for decoder, tokens, finish in items]
