"""SGLang's native `/generate`: one sequence of a request (Rust split a batch, and `n`, into one request per
sequence: rust/doors/generate/). The prompt is raw, as Completions' is: `text` is plain text after the BOS (no chat
template, special-token spellings stay text) and `input_ids` are the prompt as given. The answer is SGLang's:
`text`, `output_ids` and `meta_info`, whose `output_ids` are exactly the tokens the engine produced (a stop token
and the EOS included), so a rollout trains on what was sampled. Streams are cumulative, as SGLang's are by default
(its `--incremental-streaming-output` off): each event holds the text, the IDs and the logprobs so far.
"""

from __future__ import annotations

import json
import time
from typing import Any

from deepinfer_server import _native
from deepinfer_server.decoding import FINISHED, RUNNING, STOPPED_EARLY
from deepinfer_server.doors.base import Context, Door, Prepared, PrepareInput, Prompt
from deepinfer_server.doors.completions import _overlap, completion_prompt
from deepinfer_server.engine.base import TokenLogprob
from deepinfer_server.grammar import SCHEMA_JSON, SCHEMA_REGEX, GrammarError, GrammarTooCostly
from deepinfer_server.grammar.base import Constraint
from deepinfer_server.prompt_encoder import PromptTooLong
from deepinfer_server.prompt_logprobs import PromptTokens
from deepinfer_server.refusals import Refusal, error_body, too_long
from deepinfer_server.vocabulary import Vocabulary


class GenerateDoor(Door):
    code = _native.DOOR_GENERATE
    schema_param = "sampling_params.json_schema"

    def prepare(self, ctx: Context, body: bytes, req: PrepareInput) -> Prepared | Refusal:
        d = json.loads(body)
        ids = self._ids(ctx, d)
        if isinstance(ids, Refusal):
            return ids
        sp: dict[str, Any] = d["sampling_params"]
        n_prompt, max_new = len(ids), int(sp["max_new_tokens"])
        if n_prompt + max(1, max_new) > ctx.max_model_len:
            return Refusal(
                400,
                error_body(
                    f"This model's maximum context length is {ctx.max_model_len} tokens. However, you requested "
                    f"{n_prompt + max_new} tokens ({n_prompt} in the prompt, {max_new} new tokens). Please reduce "
                    "the length of the prompt or max_new_tokens.",
                    code="context_length_exceeded",
                    param="sampling_params.max_new_tokens",
                ),
            )
        constraint = self._constraint(ctx, sp)
        if isinstance(constraint, Refusal):
            return constraint
        want = bool(d.get("return_logprob"))
        start = int(d.get("logprob_start_len", -1)) if want else -1
        if start >= n_prompt:
            return Refusal(
                400,
                error_body(
                    f"'logprob_start_len' ({start}) must be below the prompt's length ({n_prompt} tokens).",
                    param="logprob_start_len",
                ),
            )
        top = int(d.get("top_logprobs_num") or 0)
        decoder = GenerateDecoder(
            ctx.vocab,
            d,
            ids,
            stream=bool(d.get("stream")),
            logprobs=want,
            top=top,
            start=start,
        )
        temperature, top_p = sp.get("temperature"), sp.get("top_p")
        if start >= 0:  # the model's own distribution (the front end turned top-k off and checked the rest)
            temperature = top_p = None
        return Prepared(
            prompt_ids=ids,
            max_tokens=max(1, max_new),  # 0 new tokens: the engine makes one, which is dropped
            temperature=round(1.0 if temperature is None else float(temperature), 6),
            top_p=round(1.0 if top_p is None else float(top_p), 6),
            decoder=decoder,
            first_chunks=[],
            incremental=bool(d.get("stream") or sp.get("stop") or sp.get("stop_token_ids")),
            logprobs=top if want else None,
            prompt_logprobs=start >= 0,
            constraint=None if constraint is None else constraint.record(),
        )

    def check_constraint(
        self, ctx: Context, body: bytes, forced_tool: str | None, parallel_tools: bool
    ) -> Refusal | None:
        got = self._constraint(ctx, json.loads(body)["sampling_params"])
        return got if isinstance(got, Refusal) else None

    def prompt_tokens(self, ctx: Context, body: bytes, images: dict[str, bytes] | None) -> Prompt | Refusal:
        ids = self._ids(ctx, json.loads(body))
        return ids if isinstance(ids, Refusal) else Prompt(ids)

    @staticmethod
    def _ids(ctx: Context, d: dict[str, Any]) -> list[int] | Refusal:
        param = "text" if "text" in d else "input_ids"
        try:
            ids = completion_prompt(ctx, d[param], None)
        except PromptTooLong as e:
            return Refusal(400, too_long(ctx.max_model_len, f"at least {e.at_least}", param))
        vocab_size = ctx.vocab.vocab_size
        if any(i >= vocab_size for i in ids):
            return Refusal(400, error_body(f"token IDs must be below the vocabulary size {vocab_size}", param=param))
        return ids

    @staticmethod
    def _constraint(ctx: Context, sp: dict[str, Any]) -> Constraint | Refusal | None:
        """`json_schema` or `regex`, held from the first new token (a raw prompt has no reasoning before it)."""
        if sp.get("json_schema") is not None:
            schema_type, schema, param = SCHEMA_JSON, str(sp["json_schema"]), "sampling_params.json_schema"
        elif sp.get("regex") is not None:
            schema_type, schema, param = SCHEMA_REGEX, str(sp["regex"]), "sampling_params.regex"
        else:
            return None
        try:
            return ctx.grammars.raw(schema_type, schema)
        except GrammarError as e:
            code = "grammar_too_complex" if isinstance(e, GrammarTooCostly) else "invalid_grammar"
            message = f"Invalid '{param}': the grammar cannot be enforced: {e}"
            return Refusal(400, error_body(message, code=code, param=param))


def _matched(value: int | str) -> dict[str, Any]:
    return {"type": "stop", "matched": value}


class GenerateDecoder:
    """One sequence's output, SGLang's shape: the same interface as `decoding.BaseDecoder` (`start`, `push`)."""

    handles_abort = True  # an abort is pushed as it is: SGLang has a finish reason of its own for it (`aborted`)

    __slots__ = (
        "discard",
        "done",
        "eos_id",
        "extra",
        "ids",
        "ignore_eos",
        "in_lp",
        "in_top",
        "keep_stop",
        "logprobs",
        "n_prompt",
        "out_lp",
        "out_top",
        "prompt",
        "prompt_from",
        "received",
        "rid",
        "scan",
        "skip",
        "stop_ids",
        "stops",
        "stream",
        "text",
        "texts",
        "top",
        "version",
        "words",
    )

    def __init__(
        self,
        vocab: Vocabulary,
        d: dict[str, Any],
        prompt_ids: list[int],
        stream: bool,
        logprobs: bool,
        top: int,
        start: int,
    ) -> None:
        sp: dict[str, Any] = d["sampling_params"]
        self.rid, self.version = str(d["rid"]), str(d.get("weight_version", "default"))
        self.received = float(d.get("received_time") or time.time())
        self.extra: dict[str, Any] = {}
        if "index" in d:
            self.extra["index"] = d["index"]
        if d.get("return_prompt_token_ids"):
            self.extra["prompt_token_ids"] = prompt_ids
        self.n_prompt, self.stream, self.eos_id = len(prompt_ids), stream, vocab.eos_id
        self.ignore_eos = bool(sp.get("ignore_eos"))
        self.stops: list[str] = list(sp.get("stop") or [])
        # As SGLang's: ignore_eos turns the stop tokens off too (stop strings still apply).
        self.stop_ids = frozenset(() if self.ignore_eos else (int(i) for i in sp.get("stop_token_ids") or []))
        self.keep_stop = bool(sp.get("no_stop_trim"))
        self.skip = vocab.special if sp.get("skip_special_tokens", True) else frozenset()
        self.words = vocab.text()
        self.text = ""  # the output's text so far (a stop string and what follows it cut off at the end)
        self.scan = 0  # where the next stop-string search starts
        self.ids: list[int] = []
        self.done = False
        self.discard = int(sp["max_new_tokens"]) == 0
        # Logprobs in SGLang's shape: [logprob, token id, token text or null] per token.
        self.logprobs, self.top, self.prompt_from = logprobs, top, start
        self.texts: Vocabulary | None = vocab if d.get("return_text_in_logprobs") else None
        self.out_lp: list[list[Any]] = []
        self.out_top: list[list[list[Any]] | None] = []
        self.in_lp: list[list[Any]] = []
        self.in_top: list[list[list[Any]] | None] = []
        self.prompt = PromptTokens(vocab, prompt_ids) if start >= 0 else None

    def start(self) -> list[str]:
        return []

    def push(
        self,
        tokens: list[int],
        finish: int,
        logprobs: list[TokenLogprob] | None = None,
        prompt_logprobs: list[float] | None = None,
    ) -> tuple[int, list[str] | str]:
        if self.done:
            return FINISHED, []
        if prompt_logprobs is not None and self.prompt is not None:
            self._prompt_logprobs(prompt_logprobs)
        if self.discard:  # max_new_tokens 0: the engine's one token is not output
            tokens, logprobs = [], None
            finish = _native.FINISH_LENGTH if finish == _native.FINISH_STOP else finish
        reason = self._take(tokens, logprobs)
        state = RUNNING
        if reason is not None:
            state = FINISHED if finish != _native.FINISH_NONE else STOPPED_EARLY
        elif finish == _native.FINISH_STOP:
            last = self.ids[-1] if self.ids else None
            reason, state = _matched(last) if last == self.eos_id else {"type": "stop", "matched": None}, FINISHED
        elif finish == _native.FINISH_LENGTH:
            reason, state = {"type": "length", "length": len(self.ids)}, FINISHED
        elif finish == _native.FINISH_ABORT:  # ended by the server (an abort): what it had, SGLang's reason
            reason, state = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}, FINISHED
        if state != RUNNING:
            self.done = True
            self.text += self.words.flush() if not isinstance(reason.get("matched") if reason else None, str) else ""
        if not self.stream:
            return state, [] if state == RUNNING else self._json(self.text, reason)
        if not tokens and state == RUNNING:
            return state, []
        held = 0 if state != RUNNING else max((_overlap(self.text, s) for s in self.stops), default=0)
        return state, [self._json(self.text[: len(self.text) - held], reason)]

    def _take(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
        """Take new tokens into the output, up to a stop token or the token that completes a stop string; the
        reason it stopped, if it did."""
        if not self.stops and not self.stop_ids:  # nothing to find: the whole batch at once
            self.ids += tokens
            self._logprobs(tokens, logprobs)
            self.text += self.words.feed([t for t in tokens if t not in self.skip]) if tokens else ""
            return None
        for k, t in enumerate(tokens):
            self.ids.append(t)
            self._logprobs([t], None if logprobs is None else logprobs[k : k + 1])
            if t in self.stop_ids:
                if self.keep_stop and t not in self.skip:
                    self.text += self.words.feed([t])
                return _matched(t)
            if t in self.skip:
                continue
            self.text += self.words.feed([t])
            for s in self.stops:
                at = self.text.find(s, max(0, self.scan - len(s) + 1))
                if at >= 0:
                    self.text = self.text[: at + len(s) if self.keep_stop else at]
                    return _matched(s)
            self.scan = len(self.text)
        return None

    def _logprobs(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> None:
        if not self.logprobs or logprobs is None:
            return
        for token, (value, alternatives) in zip(tokens, logprobs, strict=True):
            self.out_lp.append([value, token, self._text(token)])
            if self.top > 0:
                self.out_top.append([[v, a, self._text(a)] for a, v in alternatives[: self.top]])

    def _prompt_logprobs(self, values: list[float]) -> None:
        """The prompt's logprobs from `logprob_start_len` on (the first token's null: nothing comes before it);
        DeepInfer computes each token's own and no alternatives, so a position's top logprobs are that token."""
        assert self.prompt is not None
        ids = self.prompt.ids
        for token, value in list(zip(ids, self.prompt.values(values), strict=True))[self.prompt_from :]:
            self.in_lp.append([value, token, self._text(token)])
            if self.top > 0:
                self.in_top.append(None if value is None else [[value, token, self._text(token)]])

    def _text(self, token: int) -> str | None:
        return None if self.texts is None else self.texts.bytes_of(token).decode("utf-8", "replace")

    def _json(self, text: str, reason: dict[str, Any] | None) -> str:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": reason,
            "prompt_tokens": self.n_prompt,
            "weight_version": self.version,
        }
        if self.logprobs:
            meta["input_token_logprobs"] = self.in_lp
            meta["output_token_logprobs"] = self.out_lp
            meta["output_token_logprobs_length"] = len(self.out_lp)
            if self.top > 0:
                meta["input_top_logprobs"] = self.in_top
                meta["output_top_logprobs"] = self.out_top
        meta["completion_tokens"] = len(self.ids)
        meta["cached_tokens"] = 0
        if reason is not None:
            meta["e2e_latency"] = round(time.time() - self.received, 6)
        out = {"text": text, "output_ids": self.ids, "meta_info": meta, **self.extra}
        return json.dumps(out, ensure_ascii=False, separators=(",", ":"))
