"""OpenAI Completions output: raw text, no reasoning or tool parsing, with stop strings matched here (the text is
not the model's chat turn, so deepseek-recipe's stream processor has nothing to parse)."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from deepinfer_server import _native
from deepinfer_server.decoding import FINISHED, RUNNING, STOPPED_EARLY, detokenizer

if TYPE_CHECKING:
    from deepinfer_server.codec import Codec


def _json(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


class CompletionDecoder:
    """One Completions request's output: the same interface as `decoding.BaseDecoder` (`start`, `push`)."""

    __slots__ = (
        "continuous",
        "done",
        "dropped_eos",
        "echo",
        "eos_id",
        "head",
        "ignore_eos",
        "include_usage",
        "n_out",
        "n_prompt",
        "pending",
        "sent",
        "stop",
        "stream",
        "text",
        "usage_head",
    )

    def __init__(
        self,
        codec: Codec,
        response_id: str,
        model: str,
        n_prompt: int,
        stream: bool,
        ignore_eos: bool,
        include_usage: bool,
        continuous_usage: bool,
        stop: list[str],
        echo: str,
    ) -> None:
        self.text = detokenizer(codec)
        created = int(time.time())
        common = f'"id":{_json(response_id)},"object":"text_completion","created":{created},"model":{_json(model)}'
        fingerprint = f'"system_fingerprint":{_json(codec.fingerprint)}'
        self.head = f'{{{common},{fingerprint},"choices":[{{"index":0,"text":'
        self.usage_head = f'{{{common},{fingerprint},"choices":[],"usage":'
        self.n_prompt, self.n_out, self.dropped_eos = n_prompt, 0, 0
        self.stream, self.ignore_eos, self.eos_id = stream, ignore_eos, codec.eos_id
        self.include_usage = include_usage
        self.continuous = continuous_usage and include_usage
        self.stop = [s for s in stop if s]
        self.pending = ""  # text not sent yet: held back while it could still begin a stop string
        self.sent: list[str] = [echo]  # a non-stream's text so far (`echo`: the prompt first)
        self.echo = echo
        self.done = False

    def start(self) -> list[str]:
        """A stream's echoed prompt, before any token (stop strings apply to generated text only)."""
        if not self.stream or not self.echo:
            return []
        return [f'{self.head}{_json(self.echo)},"logprobs":null,"finish_reason":null}}]}}']

    def push(self, tokens: list[int], finish: int) -> tuple[int, list[str] | str]:
        if self.done:
            return FINISHED, []
        if self.ignore_eos:
            kept = [t for t in tokens if t != self.eos_id]
            self.dropped_eos += len(tokens) - len(kept)
            tokens = kept
        elif finish == _native.FINISH_STOP and tokens and tokens[-1] == self.eos_id:
            tokens = tokens[:-1]  # the engine's EOS is never text
        self.n_out += len(tokens)
        ended = finish in (_native.FINISH_STOP, _native.FINISH_LENGTH)
        self.pending += self.text.feed(tokens) if tokens else ""
        if ended:
            self.pending += self.text.flush()
        out, reason = self._take(ended)
        state = RUNNING
        if reason == "stop" and not ended:
            state = STOPPED_EARLY  # a stop string matched: the rank must be told to abort
        elif ended:
            state, reason = FINISHED, reason or ("length" if finish == _native.FINISH_LENGTH else "stop")
        if state != RUNNING:
            self.done = True
        return state, self._emit(out, reason)

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
        if not self.stream:
            self.sent.append(text)
            if reason is None:
                return []
            whole = "".join(self.sent)
            return f'{self.head}{_json(whole)},"logprobs":null,"finish_reason":"{reason}"}}],"usage":{self._usage()}}}'
        out = []
        if text or reason is not None:
            finish = "null" if reason is None else f'"{reason}"'
            usage = f',"usage":{self._usage()}' if self.continuous else ""
            out.append(f'{self.head}{_json(text)},"logprobs":null,"finish_reason":{finish}}}]{usage}}}')
        if reason is not None and self.include_usage:
            out.append(f"{self.usage_head}{self._usage()}}}")
        return out

    def _usage(self) -> str:
        n = self.n_out + self.dropped_eos
        return f'{{"prompt_tokens":{self.n_prompt},"completion_tokens":{n},"total_tokens":{self.n_prompt + n}}}'


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `stop`."""
    for n in range(min(len(text), len(stop) - 1), 0, -1):
        if stop.startswith(text[-n:]):
            return n
    return 0
