"""vLLM's token-ID extensions on the OpenAI doors (Chat, Completions): `return_token_ids` (the prompt's IDs and the
generated IDs beside the text) and `return_tokens_as_token_ids` (logprob tokens named `token_id:N`).

The IDs are the engine's own: the prompt exactly as it was sent to the engine (chat template, special tokens), and
every generated token as the engine made it, thinking, `</think>`, tool-call markup and the final EOS included (vLLM
keeps the EOS in `token_ids` too). A stop string ends the IDs as vLLM does: they run through the token that
completed the stop string (the text is cut before the stop string); tokens the engine made after it, before its
abort arrived, are not returned. So the IDs are what a training client must append to the prompt to rebuild the
context the model saw, and a stream's chunks add up to the same list as a response (IDs once sent stay sent).

With logprobs asked for and either switch on, Chat's `logprobs.content` is vLLM's: one entry per generated token
(the same tokens as `token_ids`, in order), rather than DeepSeek's split into `reasoning_content` and `content`
(which leaves `</think>`, tool-call markup and the EOS without one). A door decoder calls `take` with each raw
batch, `stop_cut` when a stop string ended the output, and `dress_*` on what it sends."""

from __future__ import annotations

import codecs
import json
from dataclasses import dataclass

from deepinfer_server.decoding import _f32, dumps
from deepinfer_server.engine.base import TokenLogprob
from deepinfer_server.vocabulary import Vocabulary


@dataclass(frozen=True)
class Asked:
    """What a request asked for: `return_token_ids`, `return_tokens_as_token_ids` (the front end checked both)."""

    ids: bool = False
    as_ids: bool = False

    @staticmethod
    def of(body: bytes) -> Asked:
        """From the body; the raw text test spares most requests a parse."""
        if b'"return_token' not in body:
            return Asked()
        d = json.loads(body)
        return Asked(d.get("return_token_ids") is True, d.get("return_tokens_as_token_ids") is True)

    @property
    def any(self) -> bool:
        return self.ids or self.as_ids


class TokenIds:
    """One request's token IDs (and, for Chat, its logprob entries per token) as they go out."""

    __slots__ = (
        "answer",
        "answering",
        "as_ids",
        "entries",
        "ids",
        "logprobs",
        "pending",
        "pending_lp",
        "prompt",
        "prompt_sent",
        "speller",
        "stops",
        "think_end_id",
        "utf8",
        "vocab",
        "want_ids",
    )

    def __init__(
        self,
        vocab: Vocabulary,
        prompt: list[int],
        asked: Asked,
        logprobs: bool,
        stops: list[str],
        think_end_id: int | None,
    ) -> None:
        self.vocab = vocab
        self.prompt = prompt
        self.want_ids = asked.ids
        self.as_ids = asked.as_ids
        self.logprobs = logprobs  # Chat: write vLLM's one-entry-per-token `logprobs.content`
        self.ids: list[int] = []  # every ID returned so far
        self.pending: list[int] = []  # IDs not sent yet (a stream sends them with its next chunk)
        self.pending_lp: list[TokenLogprob] = []
        self.entries: list[dict[str, object]] = []  # a non-stream's logprob entries
        self.prompt_sent = False
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # the answer's text, for `stop_cut`
        self.speller = codecs.getincrementaldecoder("utf-8")("replace")  # the logprob entries' token strings
        # Stop strings are matched in the answer: its text so far (after `</think>` when the output starts in
        # reasoning), kept only when there are stop strings.
        self.stops = [s for s in stops if s]
        self.think_end_id = think_end_id
        self.answering = think_end_id is None
        self.answer = ""

    def take(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        """One batch as the engine made it (before any EOS is dropped from the text)."""
        self.pending += tokens
        if self.logprobs and logprobs is not None:
            self.pending_lp += logprobs

    def stop_cut(self) -> None:
        """A stop string matched in this batch: keep its tokens through the one that completed it (vLLM's rule)."""
        if not self.stops:
            return
        answer, answering, longest = self.answer, self.answering, max(len(s) for s in self.stops)
        bytes_of = self.vocab.bytes_of
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        utf8.setstate(self.utf8.getstate())
        for k, token in enumerate(self.pending):
            if not answering:
                answering = token == self.think_end_id
                continue
            piece = str(utf8.decode(bytes_of(token)))
            answer += piece
            window = answer[-(longest + len(piece)) :]
            if any(s in window for s in self.stops):
                del self.pending[k + 1 :]
                del self.pending_lp[k + 1 :]
                return

    def _advance(self, tokens: list[int]) -> None:
        """Keep the answer's text for `stop_cut` (only with stop strings)."""
        if not self.stops:
            return
        for token in tokens:
            if not self.answering:
                self.answering = token == self.think_end_id
                continue
            self.answer += str(self.utf8.decode(self.vocab.bytes_of(token)))
        longest = max(len(s) for s in self.stops)
        self.answer = self.answer[-longest:]

    def _flush(self) -> tuple[list[int], list[dict[str, object]] | None]:
        """The pending IDs (and their logprob entries), now sent."""
        ids, self.pending = self.pending, []
        values, self.pending_lp = self.pending_lp, []
        self._advance(ids)
        self.ids += ids
        entries = None
        if self.logprobs:
            entries = [self._entry(t, v) for t, v in zip(ids, values, strict=False)]
        return ids, entries

    def name(self, token: int, spelled: str | None = None) -> str:
        """A logprob token's name: `token_id:N` when asked, else its text (`spelled`, or its bytes alone)."""
        if self.as_ids:
            return f"token_id:{token}"
        if spelled is not None:
            return spelled
        return self.vocab.bytes_of(token).decode("utf-8", "backslashreplace")

    def _entry(self, token: int, lp: TokenLogprob) -> dict[str, object]:
        """Chat's logprob entry for one generated token; its string spells the text as `TokenStrings` does."""
        value, alternatives = lp
        data = self.vocab.bytes_of(token)
        text = self.name(token, str(self.speller.decode(data)))
        top = [
            {
                "token": text if alt == token else self.name(alt),
                "logprob": _f32(alt_value),
                "bytes": list(self.vocab.bytes_of(alt)),
            }
            for alt, alt_value in alternatives
        ]
        return {"token": text, "logprob": _f32(value), "bytes": list(data), "top_logprobs": top}

    # -- Chat ---------------------------------------------------------------------------------------------------

    def dress_chat_chunks(self, out: list[str]) -> list[str]:
        """A stream's chunks of one batch: the prompt's IDs at the root of the first chunk ever, the pending IDs
        (and their logprob entries) on the first chunk with a choice; the other chunks carry none."""
        if not out:
            return out
        dressed = []
        ids: list[int] | None = None
        for js in out:
            d = json.loads(js)
            if self.want_ids and not self.prompt_sent:
                d["prompt_token_ids"] = self.prompt
                self.prompt_sent = True
            for choice in d.get("choices") or []:
                if ids is None:
                    ids, entries = self._flush()
                    if self.logprobs:  # none for a chunk without tokens (the role's), as before
                        choice["logprobs"] = {"content": entries, "refusal": None} if entries else None
                    here = ids
                else:
                    if self.logprobs:
                        choice["logprobs"] = None
                    here = []
                if self.want_ids:
                    choice["token_ids"] = here
            dressed.append(dumps(d))
        return dressed

    def dress_chat_body(self, body: str) -> str:
        """A response: `prompt_token_ids` at its root, `token_ids` (and vLLM's logprobs) in its choice."""
        ids, entries = self._flush()
        d = json.loads(body)
        for choice in d.get("choices") or []:
            if self.want_ids:
                choice["token_ids"] = ids
            if self.logprobs:
                choice["logprobs"] = {"content": entries, "refusal": None}
        if self.want_ids:
            d["prompt_token_ids"] = self.prompt
        return dumps(d)

    # -- Completions --------------------------------------------------------------------------------------------

    def dress_completion_chunks(self, out: list[str]) -> list[str]:
        """A stream's chunks: the prompt's IDs on the first chunk's choice, the pending IDs on the first chunk with
        a choice."""
        if not self.want_ids:
            return out
        dressed, flushed = [], False
        for js in out:
            d = json.loads(js)
            for choice in d.get("choices") or []:
                if not self.prompt_sent:
                    choice["prompt_token_ids"] = self.prompt
                    self.prompt_sent = True
                choice["token_ids"] = [] if flushed else self._flush()[0]
                flushed = True
            dressed.append(dumps(d))
        return dressed

    def dress_completion_body(self, body: str) -> str:
        """A response: `prompt_token_ids` and `token_ids` in its choice, as vLLM places them."""
        if not self.want_ids:
            return body
        ids = self._flush()[0]
        d = json.loads(body)
        for choice in d.get("choices") or []:
            choice["prompt_token_ids"] = self.prompt
            choice["token_ids"] = ids
        return dumps(d)
