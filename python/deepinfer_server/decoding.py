"""The output side shared by every protocol: engine token IDs -> text (the vocabulary's detokenizer) -> the
deepseek-recipe StreamProcessor, with the engine's EOS, `ignore_eos` and reasoning-token counting around it. Each
door's decoder (doors/) turns the processor's chunks into its wire output.

Output tokens are detokenized here and fed to the StreamProcessor as text with their token counts. With a tokenizer
attached, the processor re-tokenizes the whole reasoning text at the finish to report `reasoning_tokens` (about
0.8 us per output token, in one call that stalls the rank's other streams); counting the engine's reasoning token
IDs gives the true figure for free. How tokens become text is the vocabulary's business (vocabulary.py).
"""

from __future__ import annotations

import codecs
import json
import struct
from collections.abc import Callable, Sequence
from typing import Protocol, Union, cast

from deepseek_recipe import (
    ChatCompletionChunk,
    ChatCompletionChunkGenerator,
    ConversationRequest,
    InferenceChunk,
    InferenceFinishReason,
    MessagesChunkGenerator,
    MessagesStreamEvent,
    PromptUsage,
    ResponsesChunkGenerator,
    ResponsesStreamEvent,
    SpecialToken,
    StreamProcessor,
)

from deepinfer_server import _native
from deepinfer_server.engine.base import TokenLogprob
from deepinfer_server.vocabulary import Vocabulary

# Decode results, read by Rust (rust/codec/decode.rs `DecodeState`, which defines them).
RUNNING, FINISHED, STOPPED_EARLY = _native.DECODE_RUNNING, _native.DECODE_FINISHED, _native.DECODE_STOPPED_EARLY

_ENGINE_FINISH = {
    _native.FINISH_STOP: InferenceFinishReason.Stop,
    _native.FINISH_LENGTH: InferenceFinishReason.Length,
}

Generator = Union[ChatCompletionChunkGenerator, MessagesChunkGenerator, ResponsesChunkGenerator]  # noqa: UP007
Chunk = Union[ChatCompletionChunk, MessagesStreamEvent, ResponsesStreamEvent]  # noqa: UP007


class Decoder(Protocol):
    """One request's output side, as Rust drives it: `start` once, then `push` per batch (`codec.decode_batch`)."""

    def start(self) -> list[str]:
        """Events to send before any token (streams only)."""

    def push(
        self,
        tokens: list[int],
        finish: int,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[float] | None = None,
    ) -> tuple[int, list[str] | str]:
        """One batch of engine tokens -> (state, output): a stream's events, or a non-stream's whole body."""


# What the shared decoder tells a request's token IDs (token_ids.py `TokenIds`; the door places them, `_dress`).
class TokenIdsOut(Protocol):
    def take(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None: ...

    def stop_cut(self) -> None: ...


class TokenStrings:
    """Logprob entries' `token` strings that spell the text exactly: a character split across tokens belongs to
    the token that completes it (the ones before it spell ""), while `bytes` keeps each token's own bytes.
    deepseek-recipe writes a partial character as `\\xNN` escapes, which would not add up to the text."""

    __slots__ = ("utf8",)

    def __init__(self) -> None:
        self.utf8: dict[str, codecs.IncrementalDecoder] = {}

    def fix(self, logprobs: object) -> None:
        """Rewrite the `token` of each entry of a logprobs object (`{"content": [...], "reasoning_content": ...}`)."""
        if not isinstance(logprobs, dict):
            return
        for field, entries in logprobs.items():
            if not isinstance(entries, list):
                continue
            utf8 = self.utf8.get(field)
            if utf8 is None:
                utf8 = self.utf8[field] = codecs.getincrementaldecoder("utf-8")("replace")
            for entry in entries:
                self.fix_entry(entry, utf8)

    def fix_list(self, entries: object, key: str | None = None) -> None:
        """Entries of one list: continuing the text of earlier lists under `key` (a stream's deltas), or on
        their own (`key` None: a list that holds the whole text, as a done event or a response does)."""
        if not isinstance(entries, list):
            return
        fresh: codecs.IncrementalDecoder = codecs.getincrementaldecoder("utf-8")("replace")
        utf8 = fresh if key is None else self.utf8.setdefault(key, fresh)
        for entry in entries:
            if isinstance(entry, dict):
                self.fix_entry(entry, utf8)

    def fix_all(self, d: object) -> None:
        """Every `logprobs` list anywhere in `d`, each on its own."""
        if isinstance(d, dict):
            for k, v in d.items():
                if k == "logprobs" and isinstance(v, list):
                    self.fix_list(v)
                else:
                    self.fix_all(v)
        elif isinstance(d, list):
            for v in d:
                self.fix_all(v)

    @staticmethod
    def fix_entry(entry: dict[str, object], utf8: codecs.IncrementalDecoder) -> None:
        data = entry.get("bytes")
        if not isinstance(data, list):
            return
        raw = bytes(data)
        old = entry.get("token")
        entry["token"] = text = str(utf8.decode(raw))
        for alt in cast(list[dict[str, object]], entry.get("top_logprobs") or []):
            if alt.get("token") == old and alt.get("bytes") == data:
                alt["token"] = text


class Tail:
    """The tokens at the end of the output so far whose bytes end inside a character, kept from deepseek-recipe.

    deepseek-recipe holds back a token chunk that ends inside a character until more bytes come, and drops it
    at the finish if none do: the whole chunk's text, logprob entries and token count are lost. So it gets only
    chunks that end on a character boundary; the unfinished tail waits here for the next batch, and at the
    finish the door adds it to its output itself (`entries`, `text`), as the non-logprobs path would have: its
    unfinished character becomes U+FFFD, spelled (`TokenStrings`' 'replace' rule) by the last token."""

    __slots__ = ("bytes_of", "logprobs", "tokens")

    def __init__(self, bytes_of: Callable[[int], bytes]) -> None:
        self.bytes_of = bytes_of
        self.tokens: list[int] = []
        self.logprobs: list[TokenLogprob] | None = []

    def take(
        self, tokens: list[int], logprobs: list[TokenLogprob] | None
    ) -> tuple[list[int], list[TokenLogprob] | None]:
        """This batch after the pending tail, cut after its last whole character: what deepseek-recipe may have.
        The rest becomes the pending tail."""
        tokens = self.tokens + tokens
        if logprobs is not None and self.logprobs is not None:
            logprobs = self.logprobs + logprobs
        elif self.tokens:
            logprobs = None  # the engine sent a batch without its logprobs: none can line up
        k = len(tokens) - self._unfinished(tokens)
        self.tokens = tokens[k:]
        self.logprobs = logprobs[k:] if logprobs is not None else None
        return tokens[:k], logprobs[:k] if logprobs is not None else None

    def _unfinished(self, tokens: list[int]) -> int:
        """How many tokens at the end carry the bytes of an unfinished character (0: it ends on a boundary)."""
        bytes_of = self.bytes_of
        cut = _unfinished_bytes(b"".join([bytes_of(t) for t in tokens[-4:]]))  # a character has 4 bytes at most
        n = 0
        while cut > 0:
            n += 1
            cut -= len(bytes_of(tokens[-n]))
        return n

    def text(self) -> str:
        """The tail's text as the detokenizer flushes it: the unfinished character is U+FFFD."""
        return b"".join([self.bytes_of(t) for t in self.tokens]).decode("utf-8", "replace")

    def entries(self) -> list[dict[str, object]]:
        """The tail's logprob entries, as deepseek-recipe writes them (`bytes` included) with the token strings
        `TokenStrings` gives: "" for the unfinished character's bytes, but the last token spells the U+FFFD that
        the end of the output makes of them (so the strings still add up to the text)."""
        if not self.logprobs:
            return []
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        last = len(self.tokens) - 1
        out: list[dict[str, object]] = []
        for i, (token, (value, alternatives)) in enumerate(zip(self.tokens, self.logprobs, strict=True)):
            data = self.bytes_of(token)
            text = str(utf8.decode(data, i == last))
            top = [self._alternative(alt, alt_value, token, text) for alt, alt_value in alternatives]
            out.append({"token": text, "logprob": _f32(value), "bytes": list(data), "top_logprobs": top})
        return out

    def _alternative(self, alt: int, value: float, token: int, text: str) -> dict[str, object]:
        data = self.bytes_of(alt)
        # The sampled token spells what its entry does; another is spelled alone, escaping partial bytes as
        # deepseek-recipe does.
        name = text if alt == token else data.decode("utf-8", "backslashreplace")
        return {"token": name, "logprob": _f32(value), "bytes": list(data)}


def _unfinished_bytes(data: bytes) -> int:
    """How many bytes at the end of `data` begin a character they do not finish."""
    utf8 = codecs.getincrementaldecoder("utf-8")("replace")
    utf8.decode(data[-3:])  # the unfinished character begins in the last 3 bytes, at most
    return len(utf8.getstate()[0])


def _f32(value: float) -> float:
    """A logprob as deepseek-recipe writes it: the engine's value as a float32, in the fewest digits that keep it."""
    (single,) = struct.unpack("f", struct.pack("f", value))
    for digits in range(1, 10):
        short = float(f"{single:.{digits}g}")
        if struct.unpack("f", struct.pack("f", short))[0] == single:
            return short
    return float(single)


class BaseDecoder:
    """One request's output side, whatever its protocol: engine tokens -> text -> a deepseek-recipe StreamProcessor.
    A subclass turns the processor's chunks into its protocol's wire output (`_emit`).

    A request with logprobs goes to the processor as token IDs with their logprobs instead (it needs the tokenizer
    then), and deepseek-recipe writes the logprobs objects; `TokenStrings` mends their token strings. An output
    that ends inside a character leaves a `Tail` that the processor never sees: `ended_tail` is it, once the
    engine finished, and a subclass adds it to its output (`_emit`)."""

    __slots__ = (
        "calls_id",
        "done",
        "dropped_eos",
        "ended_tail",
        "eos_id",
        "fingerprint",
        "ignore_eos",
        "in_calls",
        "logprobs",
        "n_out",
        "n_prompt",
        "proc",
        "reasoning",
        "stream",
        "tail",
        "text",
        "text_ids",
        "think_end_id",
        "token_ids",
        "token_strings",
    )

    def __init__(
        self, vocab: Vocabulary, conv: ConversationRequest, generator: Generator, n_prompt: int, ignore_eos: bool
    ) -> None:
        options = conv.parsing_options
        opts = conv.inference_options
        self.logprobs: int | None = (opts.top_logprobs or 0) if opts.logprobs else None
        self.token_strings = TokenStrings() if self.logprobs is not None else None
        self.tail = Tail(vocab.bytes_of)
        self.ended_tail: Tail | None = None  # the tail the output ended with (the engine finished), if any
        if self.logprobs is None:
            self.proc = StreamProcessor(generator, options)  # text in: see the module docstring
        else:
            self.proc = StreamProcessor(generator, options, vocab.recipe_tokenizer)
        self.text = vocab.text()
        self.text_ids = 0  # token IDs fed since the last text went out: that text's token count
        stage = options.thinking_initial_stage
        # Reasoning tokens: None outside thinking mode; counted until the engine's </think> when it starts in one.
        self.reasoning: int | None = None if stage is None else 0
        in_reasoning = stage is not None and stage.starts_in_reasoning()
        self.think_end_id: int | None = vocab.think_end_id if in_reasoning else None
        # Whether the output is in tool calls, where a `Tail`'s text goes (logprobs only): from the start (a forced
        # call), or from the first DSML token (tool-call markup) after the reasoning, `calls_id` while awaited.
        calls = options.parse_tool_calls and self.logprobs is not None
        self.in_calls: bool = calls and options.starts_in_tool_calls
        self.calls_id: int | None = vocab.dsml_id if calls and not self.in_calls else None
        self.stream: bool = conv.stream
        self.n_prompt = n_prompt
        self.n_out = 0
        self.dropped_eos = 0
        self.eos_id = vocab.eos_id
        self.fingerprint = vocab.fingerprint
        self.ignore_eos = ignore_eos
        self.done = False
        self.token_ids: TokenIdsOut | None = None  # vLLM's token-ID extensions, when asked for (a door sets it)

    def start(self) -> list[str]:
        """Events to send before any token (streams only): the role delta, `message_start`, `response.created`."""
        usage = PromptUsage(prompt_tokens=self.n_prompt, prompt_cache_hit_tokens=0)
        ready = InferenceChunk.ready(prompt_usage=usage, system_fingerprint=self.fingerprint)
        out = self._dress(self._emit(self.proc.push(ready), last=False))
        return out if isinstance(out, list) else []

    def push(
        self,
        tokens: list[int],
        finish: int,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[float] | None = None,
    ) -> tuple[int, list[str] | str]:
        """Feed one batch of engine tokens (and the engine's finish code, the tokens' logprobs and, with the first
        tokens, the prompt's, if the request asked for them) and return (state, output).

        Output is a list of events for a stream (JSON text, or `event: <name>\ndata: <JSON>` for named events), or
        the whole response JSON once a non-stream finishes.
        """
        if self.done:
            return FINISHED, []
        if prompt_logprobs is not None:
            self._take_prompt_logprobs(prompt_logprobs)
        if self.token_ids is not None:  # the engine's own IDs, EOS included
            self.token_ids.take(tokens, logprobs)
        if self.ignore_eos:
            if self.eos_id in tokens:
                keep = [i for i, t in enumerate(tokens) if t != self.eos_id]
                self.dropped_eos += len(tokens) - len(keep)
                tokens = [tokens[i] for i in keep]
                logprobs = [logprobs[i] for i in keep] if logprobs is not None else None
        elif finish == _native.FINISH_STOP and tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]  # the engine's EOS is never text
            logprobs = logprobs[:-1] if logprobs is not None else None
        proc = self.proc
        chunks: list[object] = []
        if tokens:
            self.n_out += len(tokens)
            self._count_reasoning(tokens)
            if self.logprobs is None:
                chunks.extend(self._push_text(tokens))
            else:
                if self.calls_id is not None and self.think_end_id is None and self.calls_id in tokens:
                    self.in_calls, self.calls_id = True, None
                chunks.extend(self._push_tokens(tokens, logprobs))
        state = RUNNING
        if proc.finished:  # a stop sequence matched: the rank must be told to abort
            if self.token_ids is not None:
                self.token_ids.stop_cut()
            chunks += proc.finish()
            state = FINISHED if finish in _ENGINE_FINISH else STOPPED_EARLY
        elif finish in _ENGINE_FINISH:
            rest = self.text.flush()  # the output ends inside a character: its bytes become U+FFFD
            if self.logprobs is None and (rest or self.text_ids):
                chunks += proc.push(InferenceChunk.text(rest, self.text_ids))
            if self.tail.tokens:
                self.ended_tail = self.tail
            chunks += self._flushed(proc.push(InferenceChunk.finish(_ENGINE_FINISH[finish])) + proc.finish())
            state = FINISHED
        if state != RUNNING:
            self.done = True
            proc.close()
        return state, self._dress(self._emit(chunks, last=state != RUNNING))

    def _push_tokens(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> Sequence[object]:
        """Push one batch's token IDs up to its last whole character (`Tail` says why)."""
        tokens, logprobs = self.tail.take(tokens, logprobs)
        return self.proc.push(InferenceChunk.tokens(tokens, logprobs)) if tokens else []

    @property
    def tail_field(self) -> str:
        """Where the ended tail's text goes: the reasoning, if the output ended in it, a tool call's arguments
        ("tool_calls") if it ended in one, else the answer's content."""
        if self.think_end_id is not None:
            return "reasoning_content"
        return "tool_calls" if self.in_calls else "content"

    @property
    def uncounted(self) -> int:
        """Generated tokens that deepseek-recipe's usage leaves out: the EOS tokens `ignore_eos` kept out of the
        text, and the tail the output ended with."""
        return self.dropped_eos + (len(self.ended_tail.tokens) if self.ended_tail is not None else 0)

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

    def _take_prompt_logprobs(self, values: list[float]) -> None:
        """The prompt's logprobs, for a door that shows them (Chat, with vLLM's `prompt_logprobs`)."""

    def _flushed(self, chunks: list[Chunk]) -> Sequence[object]:
        """What the finish flushed, as `_emit` takes it (a protocol may mend it first)."""
        return chunks

    def _emit(self, chunks: Sequence[object], last: bool) -> list[str] | str:
        raise NotImplementedError

    def _dress(self, out: list[str] | str) -> list[str] | str:
        return out  # a door adds the token IDs asked for (`token_ids`) where its wire format has them


# What a DSML tag starts with: a tool call cut off inside one leaves its start held back by deepseek-recipe, which
# flushes it into the arguments at the finish.
_DSML_TAGS = ("<" + SpecialToken.Dsml.default_str(), "</" + SpecialToken.Dsml.default_str())


def cut_partial_tag(text: str) -> str:
    """`text` without a trailing, unfinished DSML tag (`</｜DSML｜param`, `</`, `<`): model markup, not arguments."""
    k = text.rfind("<")
    tail = text[k:]
    if k < 0 or ">" in tail:
        return text
    if any(tag.startswith(tail) or tail.startswith(tag) for tag in _DSML_TAGS):
        return text[:k]
    return text


def dumps(d: object) -> str:
    """Compact JSON, as deepseek-recipe writes it."""
    return json.dumps(d, ensure_ascii=False, separators=(",", ":"))
