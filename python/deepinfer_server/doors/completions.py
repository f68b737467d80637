"""OpenAI (legacy) Completions (`POST /v1/completions`): a raw prompt, text or token IDs, with `suffix` as
fill-in-the-middle; `echo`, and the prompt's logprobs (the echo's, or vLLM's `prompt_logprobs`). deepseek-recipe has
no conversion for it: the text is not the model's chat turn, so nothing is parsed out of the output either (no
reasoning or tool calls), and stop strings are matched here."""

from __future__ import annotations

import codecs
import json
import time
from typing import cast

from deepinfer_server import _native
from deepinfer_server.decoding import FINISHED, RUNNING, STOPPED_EARLY
from deepinfer_server.doors.base import Context, Door, Prepared, PrepareInput, Prompt
from deepinfer_server.engine.base import TokenLogprob
from deepinfer_server.prompt_encoder import PromptTooLong
from deepinfer_server.prompt_logprobs import LegacyEntry, PromptTokens
from deepinfer_server.refusals import Refusal, error_body, too_long
from deepinfer_server.token_ids import Asked, TokenIds
from deepinfer_server.vocabulary import Vocabulary


class CompletionsDoor(Door):
    code = _native.DOOR_COMPLETIONS

    def prepare(self, ctx: Context, body: bytes, req: PrepareInput) -> Prepared | Refusal:
        """A raw prompt (text, or token IDs that Rust checked), with `suffix` as fill-in-the-middle."""
        d = json.loads(body)
        prompt, suffix = d["prompt"], d.get("suffix")
        ids = self._ids(ctx, prompt, suffix)
        if isinstance(ids, Refusal):
            return ids
        vocab = ctx.vocab
        n_prompt, max_tokens = len(ids), int(d["max_tokens"])
        if n_prompt + max(1, max_tokens) > ctx.max_model_len:
            return Refusal(
                400,
                error_body(
                    f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
                    f"{n_prompt + max_tokens} tokens ({n_prompt} in the prompt, {max_tokens} for the completion). "
                    "Please reduce the length of the prompt or the completion.",
                    code="context_length_exceeded",
                    param="max_tokens",
                ),
            )
        stop = d.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        echo = "" if not d.get("echo") else prompt if isinstance(prompt, str) else vocab.text_of(ids)
        stream = bool(d.get("stream"))
        logprobs = d.get("logprobs")
        # The prompt's logprobs: the echo's (`echo` with `logprobs`, OpenAI's scoring idiom) or vLLM's extension.
        vllm_prompt = d.get("prompt_logprobs") is not None
        scored = (bool(echo) and logprobs is not None) or vllm_prompt
        decoder = CompletionDecoder(
            vocab,
            req.response_id,
            req.model,
            n_prompt,
            stream,
            req.ignore_eos,
            req.include_usage,
            req.continuous_usage,
            stops,
            echo,
            logprobs,
            prompt=PromptTokens(vocab, ids, hide_first=isinstance(prompt, str) and ids[:1] == [vocab.bos_id])
            if scored
            else None,
            vllm_prompt_logprobs=vllm_prompt,
            discard=max_tokens == 0,
        )
        if (asked := Asked.of(body)).any:
            decoder.token_ids = TokenIds(vocab, ids, asked, False, stops, None)
            if decoder.logprobs is not None:
                decoder.logprobs.as_ids = asked.as_ids
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

    def prompt_tokens(self, ctx: Context, body: bytes, images: dict[str, bytes] | None) -> Prompt | Refusal:
        d = json.loads(body)
        prompt = d.get("prompt")
        if not isinstance(prompt, (str, list)):
            return Refusal(400, error_body("'prompt' (a string or token IDs) is required", param="prompt"))
        ids = self._ids(ctx, prompt, d.get("suffix"))
        return ids if isinstance(ids, Refusal) else Prompt(ids)

    @staticmethod
    def _ids(ctx: Context, prompt: str | list[int], suffix: str | None) -> list[int] | Refusal:
        try:
            ids = completion_prompt(ctx, prompt, suffix)
        except PromptTooLong as e:
            return Refusal(400, too_long(ctx.max_model_len, f"at least {e.at_least}", "prompt"))
        except ValueError as e:
            return Refusal(400, error_body(str(e), param="suffix" if suffix is not None else "prompt"))
        vocab_size = ctx.vocab.vocab_size
        if any(i >= vocab_size for i in ids):
            return Refusal(400, error_body(f"token IDs must be below the vocabulary size {vocab_size}", param="prompt"))
        return ids


def completion_prompt(ctx: Context, prompt: str | list[int], suffix: str | None) -> list[int]:
    """Prompt IDs of a raw prompt: BOS and the text as plain text (special-token spellings stay text), or the IDs
    as given; with a suffix, DeepSeek's fill-in-the-middle layout."""
    bos = ctx.vocab.bos_id
    ids = list(prompt) if isinstance(prompt, list) else [bos, *ctx.encoder.encode_text(prompt)]
    if suffix is None:
        return ids
    if ctx.vocab.fim is None:
        raise ValueError("'suffix' (fill-in-the-middle) needs FIM tokens, and this model's tokenizer has none")
    begin, hole, end = ctx.vocab.fim
    head = ids[1:] if ids[:1] == [bos] else ids
    return [bos, begin, *head, hole, *ctx.encoder.encode_text(suffix), end]


def _json(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


class CompletionDecoder:
    """One Completions request's output: the same interface as `decoding.BaseDecoder` (`start`, `push`)."""

    __slots__ = (
        "continuous",
        "discard",
        "done",
        "dropped_eos",
        "echo",
        "echo_due",
        "eos_id",
        "head",
        "ignore_eos",
        "include_usage",
        "logprobs",
        "n_out",
        "n_prompt",
        "pending",
        "prompt",
        "prompt_json",
        "scored",
        "sent",
        "stop",
        "stream",
        "text",
        "token_ids",
        "top",
        "usage_head",
    )

    def __init__(
        self,
        vocab: Vocabulary,
        response_id: str,
        model: str,
        n_prompt: int,
        stream: bool,
        ignore_eos: bool,
        include_usage: bool,
        continuous_usage: bool,
        stop: list[str],
        echo: str,
        logprobs: int | None = None,
        prompt: PromptTokens | None = None,
        vllm_prompt_logprobs: bool = False,
        discard: bool = False,
    ) -> None:
        self.text = vocab.text()
        self.logprobs = _Logprobs(vocab, len(echo)) if logprobs is not None else None
        self.top = logprobs or 0
        # The prompt's tokens when its logprobs were asked for: in the echo's logprobs (`echo` with `logprobs`),
        # and/or as vLLM's `prompt_logprobs` (`vllm_prompt_logprobs`). They come with the first tokens.
        self.prompt = prompt
        self.scored = bool(echo) and logprobs is not None and prompt is not None
        self.prompt_json = "null" if vllm_prompt_logprobs else ""
        self.discard = discard  # max_tokens 0: the engine's one token is not part of the answer
        created = int(time.time())
        common = f'"id":{_json(response_id)},"object":"text_completion","created":{created},"model":{_json(model)}'
        fingerprint = f'"system_fingerprint":{_json(vocab.fingerprint)}'
        self.head = f'{{{common},{fingerprint},"choices":[{{"index":0,"text":'
        self.usage_head = f'{{{common},{fingerprint},"choices":[],"usage":'
        self.n_prompt, self.n_out, self.dropped_eos = n_prompt, 0, 0
        self.stream, self.ignore_eos, self.eos_id = stream, ignore_eos, vocab.eos_id
        self.include_usage = include_usage
        self.continuous = continuous_usage and include_usage
        self.stop = [s for s in stop if s]
        self.pending = ""  # text not sent yet: held back while it could still begin a stop string
        self.sent: list[str] = [echo]  # a non-stream's text so far (`echo`: the prompt first)
        self.echo = echo
        # A stream's echo waits for the prompt's logprobs when they were asked for (they come with the first token).
        self.echo_due = stream and bool(echo) and self.scored
        self.done = False
        self.token_ids: TokenIds | None = None  # vLLM's `return_token_ids`, when asked for

    def _dress(self, out: list[str] | str) -> list[str] | str:
        ids = self.token_ids
        if ids is None:
            return out
        return ids.dress_completion_body(out) if isinstance(out, str) else ids.dress_completion_chunks(out)

    def start(self) -> list[str]:
        """A stream's echoed prompt, before any token (stop strings apply to generated text only)."""
        if not self.stream or not self.echo or self.echo_due:
            return []
        return cast(
            list[str], self._dress([f'{self.head}{_json(self.echo)},"logprobs":null,"finish_reason":null}}]}}'])
        )

    def push(
        self,
        tokens: list[int],
        finish: int,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[float] | None = None,
    ) -> tuple[int, list[str] | str]:
        if self.done:
            return FINISHED, []
        echoed: list[str] = []
        if prompt_logprobs is not None and self.prompt is not None:
            echoed = self._prompt_logprobs(prompt_logprobs)
        elif self.echo_due:  # the engine sent no prompt logprobs: the echo goes out without them
            self.echo_due = False
            echoed = [f'{self.head}{_json(self.echo)},"logprobs":null,"finish_reason":null}}]}}']
        if self.discard:
            tokens, logprobs = [], None
            finish = _native.FINISH_LENGTH if finish == _native.FINISH_STOP else finish
        if self.token_ids is not None:  # the engine's own IDs, EOS included
            self.token_ids.take(tokens, None)
        if self.ignore_eos:
            keep = [i for i, t in enumerate(tokens) if t != self.eos_id]
            self.dropped_eos += len(tokens) - len(keep)
            tokens = [tokens[i] for i in keep]
            logprobs = [logprobs[i] for i in keep] if logprobs is not None else None
        elif finish == _native.FINISH_STOP and tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]  # the engine's EOS is never text
            if logprobs is not None and (self.scored or self.token_ids is not None) and self.logprobs is not None:
                # The EOS keeps its entry, with no text, as vLLM's does: when scoring (`echo` with `logprobs`),
                # lm-eval drops the last entry as the generated token's (without it, a prompt's last token would
                # go); with `return_token_ids`, a rollout reads one logprob per ID in `token_ids`.
                self.logprobs.add(tokens, logprobs[:-1])
                self.logprobs.add([self.eos_id], logprobs[-1:], silent=True)
                logprobs = None
            logprobs = logprobs[:-1] if logprobs is not None else None
        if self.logprobs is not None and logprobs is not None:
            self.logprobs.add(tokens, logprobs)
        self.n_out += len(tokens)
        ended = finish in (_native.FINISH_STOP, _native.FINISH_LENGTH)
        self.pending += self.text.feed(tokens) if tokens else ""
        if ended:
            self.pending += self.text.flush()
            if self.logprobs is not None:
                self.logprobs.end()
        out, reason = self._take(ended)
        if reason == "stop" and self.token_ids is not None:  # a stop string matched
            self.token_ids.stop_cut()
        state = RUNNING
        if reason == "stop" and not ended:
            state = STOPPED_EARLY  # a stop string matched: the rank must be told to abort
        elif ended:
            state, reason = FINISHED, reason or ("length" if finish == _native.FINISH_LENGTH else "stop")
        if state != RUNNING:
            self.done = True
        emitted = self._emit(out, reason)
        if echoed and isinstance(emitted, list):
            emitted = echoed + emitted
        return state, self._dress(emitted)

    def _prompt_logprobs(self, values: list[float]) -> list[str]:
        """Take the prompt's logprobs: into the echo's logprobs, and/or vLLM's `prompt_logprobs`. A stream's
        echo goes out now, with them (its event is returned)."""
        assert self.prompt is not None
        if self.prompt_json:
            self.prompt_json = self.prompt.vllm(values)
        if not self.scored or self.logprobs is None:
            return []
        entries = self.prompt.legacy(values, self.top)
        if not self.echo_due:
            self.logprobs.visible_prompt(entries)
            return []
        self.echo_due = False
        lps = _Logprobs.render(entries)
        return [f'{self.head}{_json(self.echo)},"logprobs":{lps},"finish_reason":null}}]}}']

    def _take(self, ended: bool) -> tuple[str, str | None]:
        """The text that can go out now, and "stop" if a stop string ended the output."""
        text = self.pending
        hits = [k for k in (text.find(s) for s in self.stop) if k >= 0]
        if hits:
            self.pending = ""
            return text[: min(hits)], "stop"
        keep = 0 if ended else max((_overlap(text, s) for s in self.stop), default=0)
        self.pending = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep], None

    def _emit(self, text: str, reason: str | None) -> list[str] | str:
        lp = self.logprobs
        if not self.stream:
            self.sent.append(text)
            if lp is not None:
                lp.sent(len(text), reason is not None)
            if reason is None:
                return []
            whole = "".join(self.sent)
            lps = lp.take() if lp is not None else "null"
            prompt = f',"prompt_logprobs":{self.prompt_json}' if self.prompt_json else ""
            return (
                f'{self.head}{_json(whole)},"logprobs":{lps},"finish_reason":"{reason}"{prompt}}}],'
                f'"usage":{self._usage()}}}'
            )
        out = []
        if text or reason is not None:
            finish = "null" if reason is None else f'"{reason}"'
            usage = f',"usage":{self._usage()}' if self.continuous else ""
            lps = "null"
            if lp is not None:
                lp.sent(len(text), reason is not None)
                lps = lp.take()
            out.append(f'{self.head}{_json(text)},"logprobs":{lps},"finish_reason":{finish}}}]{usage}}}')
        if reason is not None and self.include_usage:
            out.append(f"{self.usage_head}{self._usage()}}}")
        return out

    def _usage(self) -> str:
        n = self.n_out + self.dropped_eos
        return f'{{"prompt_tokens":{self.n_prompt},"completion_tokens":{n},"total_tokens":{self.n_prompt + n}}}'


class _Logprobs:
    """Completions' logprobs object (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) for the text that
    went out. A token's string is the text it adds: a character split across tokens belongs to the token that
    completes it. Tokens past a stop string, whose text never goes out, are not reported."""

    __slots__ = ("_bytes", "as_ids", "done", "entries", "offset", "out", "utf8", "visible")

    def __init__(self, vocab: Vocabulary, echo_len: int) -> None:
        self._bytes = vocab.bytes_of  # a token's bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.offset = echo_len  # where the next token's text starts (the echoed prompt comes first)
        self.visible = echo_len  # how much of the text went out
        self.entries: list[LegacyEntry] = []  # not sent yet
        self.out: list[LegacyEntry] = []
        self.done = False
        self.as_ids = False  # vLLM's `return_tokens_as_token_ids`: tokens named `token_id:N`

    def visible_prompt(self, entries: list[LegacyEntry]) -> None:
        """The echoed prompt's entries (its text went out first): ahead of every token's."""
        self.out[:0] = entries

    def add(self, tokens: list[int], logprobs: list[TokenLogprob], silent: bool = False) -> None:
        """Entries for tokens; `silent` ones (an EOS) add no text."""
        for token, (value, alternatives) in zip(tokens, logprobs, strict=True):
            text = "" if silent else str(self.utf8.decode(self._bytes(token)))
            top: dict[str, float] = {}
            for alt, alt_value in alternatives:
                name = text if alt == token else self._bytes(alt).decode("utf-8", "backslashreplace")
                top.setdefault(f"token_id:{alt}" if self.as_ids else name, alt_value)
            named = f"token_id:{token}" if self.as_ids else text
            if alternatives:  # the sampled token is always among them, as in vLLM (up to `logprobs` + 1 entries)
                top.setdefault(named, value)
            self.entries.append((named, value, top, self.offset))
            self.offset += len(text)

    def end(self) -> None:
        """The output ended: an unfinished character at its end becomes U+FFFD, as in the text, spelled by the last
        token (so the tokens still add up to the text)."""
        rest = str(self.utf8.decode(b"", True))
        if not rest or not self.entries or self.as_ids:  # a `token_id:N` name spells no text
            self.offset += len(rest) if self.as_ids else 0
            return
        text, value, top, offset = self.entries[-1]
        spelled = None if top is None else {(text + rest if name == text else name): v for name, v in top.items()}
        self.entries[-1] = (text + rest, value, spelled, offset)
        self.offset += len(rest)

    def sent(self, n_chars: int, last: bool) -> None:
        """`n_chars` more characters of text went out (`last`: the output ended there)."""
        self.visible += n_chars
        k = 0
        while k < len(self.entries) and self.entries[k][3] < self.visible:
            k += 1
        if last:
            k = len(self.entries) if self.visible >= self.offset else k
        self.out += self.entries[:k]
        del self.entries[:k]

    def take(self) -> str:
        out, self.out = self.out, []
        return self.render(out)

    @staticmethod
    def render(out: list[LegacyEntry]) -> str:
        return json.dumps(
            {
                "tokens": [e[0] for e in out],
                "token_logprobs": [e[1] for e in out],
                "top_logprobs": [e[2] for e in out],
                "text_offset": [e[3] for e in out],
            },
            ensure_ascii=False,
        )


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
