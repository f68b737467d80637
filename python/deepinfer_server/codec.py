"""deepseek-recipe codec: request body -> prompt token IDs and sampling; token batches -> chat completion chunks.

The Rust front end calls `Codec.prepare` on a codec thread (conversion and encoding release the GIL) and
`decode_batch` once per batch of rank outputs, so Python runs once per batch, never per token.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

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

from deepinfer_server import _native

# Decode results, read by Rust (rust/codec.rs).
RUNNING, FINISHED, STOPPED_EARLY = 0, 1, 2

_ENGINE_FINISH = {
    _native.FINISH_STOP: InferenceFinishReason.Stop,
    _native.FINISH_LENGTH: InferenceFinishReason.Length,
}


def error_body(message: str, etype: str = "invalid_request_error", code: str | None = None) -> str:
    """The OpenAI error envelope."""
    return json.dumps({"error": {"message": message, "type": etype, "param": None, "code": code or etype}})


@dataclass(frozen=True)
class Prepared:
    """What `Codec.prepare` hands to the dispatcher."""

    prompt_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
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
    ) -> None:
        self.tokenizer = Tokenizer.from_file(str(tokenizer_path))
        version = ModelVersion.DeepseekV41Flash if model_version == "v4.1" else ModelVersion.DeepseekV4Pro
        options = ConversionOptions()
        for name in served_model_names:
            options = options.with_model_alias(name, version)
        self.options = options
        encoding = DeepseekV41Encoding() if version == ModelVersion.DeepseekV41Flash else DeepseekV4Encoding()
        self.encoding = encoding.with_tokenizer(self.tokenizer)
        self.max_model_len = max_model_len
        self.eos_id = self.tokenizer.encode(SpecialToken.Eos.default_str())[0]

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
            return e.status_code, e.body
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            return 400, error_body(str(e))
        try:
            ids = self.encoding.encode(conv.conversation)
        except RuntimeError as e:
            return 400, error_body(f"the conversation cannot be encoded: {e}")
        n_prompt = len(ids)
        if n_prompt >= self.max_model_len:
            return 400, error_body(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your messages "
                f"resulted in {n_prompt} tokens, which leaves no room for the completion. Please reduce the "
                "length of the messages.",
                code="context_length_exceeded",
            )
        try:
            max_tokens = conv.resolve_max_tokens(n_prompt, self.max_model_len)
        except ConversionError as e:
            return e.status_code, e.body
        opts = conv.inference_options
        decoder = Decoder(
            self, conv, response_id, model, n_prompt, ignore_eos, include_usage and conv.stream, continuous_usage
        )
        return Prepared(
            prompt_ids=ids,
            max_tokens=max_tokens,
            temperature=round(opts.temperature if opts.temperature is not None else 1.0, 6),
            top_p=round(opts.top_p if opts.top_p is not None else 1.0, 6),
            seed=opts.seed,
            decoder=decoder,
            first_chunks=decoder.start(),
            incremental=conv.stream or bool(conv.parsing_options.stop_sequences),
        )


class Decoder:
    """One request's output side: a deepseek-recipe StreamProcessor plus the OpenAI wire details around it."""

    __slots__ = (
        "continuous",
        "done",
        "dropped_eos",
        "eos_id",
        "final",
        "ignore_eos",
        "include_usage",
        "n_out",
        "n_prompt",
        "proc",
        "stream",
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
        self.proc = StreamProcessor(generator, conv.parsing_options, codec.tokenizer)
        self.stream: bool = conv.stream
        self.final = None if self.stream else ChatCompletionResponse(response_id, model, int(time.time()), n_prompt, 0)
        self.n_prompt = n_prompt
        self.n_out = 0
        self.dropped_eos = 0
        self.eos_id = codec.eos_id
        self.ignore_eos = ignore_eos
        self.include_usage = include_usage
        self.continuous = continuous_usage and include_usage
        self.done = False

    def start(self) -> list[str]:
        """Chunks to send before any token: the role delta (streams only)."""
        ready = InferenceChunk.ready(prompt_usage=PromptUsage(prompt_tokens=self.n_prompt, prompt_cache_hit_tokens=0))
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
        chunks = []
        if tokens:
            self.n_out += len(tokens)
            chunks = proc.push(InferenceChunk.tokens(tokens))
        state = RUNNING
        if proc.finished:  # a stop sequence matched: the rank must be told to abort
            chunks += proc.finish()
            state = FINISHED if finish in _ENGINE_FINISH else STOPPED_EARLY
        elif finish in _ENGINE_FINISH:
            chunks += proc.push(InferenceChunk.finish(_ENGINE_FINISH[finish]))
            chunks += proc.finish()
            state = FINISHED
        if state != RUNNING:
            self.done = True
            proc.close()
        return state, self._emit(chunks, last=state != RUNNING)

    def _emit(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        chat = [ch for ch in chunks if isinstance(ch, ChatCompletionChunk)]
        if self.final is not None:  # non-stream: accumulate, answer once
            for ch in chat:
                self.final.accumulate(ch)
            if not last:
                return []
            body = self.final.to_json()
            return self._fix_usage_json(body) if self.dropped_eos else body
        out = [ch.to_json() for ch in chat]
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
        """OpenAI wire format: usage travels in its own final chunk with empty choices, only if asked for."""
        result = []
        usage_chunk = None
        for js in out:
            if '"usage":{' not in js:
                if self.continuous and js.endswith('"usage":null}'):
                    js = js[:-13] + self._usage_tail()
                result.append(js)
                continue
            d = json.loads(js)
            usage = d.pop("usage")
            if self.dropped_eos:
                usage["completion_tokens"] += self.dropped_eos
                usage["total_tokens"] += self.dropped_eos
            if self.include_usage:
                d["usage"] = usage if self.continuous else None
                usage_chunk = {**d, "choices": [], "usage": usage}
            result.append(json.dumps(d, ensure_ascii=False, separators=(",", ":")))
        if usage_chunk is not None:
            result.append(json.dumps(usage_chunk, ensure_ascii=False, separators=(",", ":")))
        return result

    def _fix_usage_json(self, body: str) -> str:
        d = json.loads(body)
        d["usage"]["completion_tokens"] += self.dropped_eos
        d["usage"]["total_tokens"] += self.dropped_eos
        return json.dumps(d, ensure_ascii=False, separators=(",", ":"))


def decode_batch(items: list[tuple[Decoder, list[int], int]]) -> list[tuple[int, list[str] | str]]:
    """One call per batch of rank outputs: (decoder, new tokens, engine finish code) -> (state, output)."""
    return [decoder.push(tokens, finish) for decoder, tokens, finish in items]
