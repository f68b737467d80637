"""deepseek-recipe codec: request body -> prompt token IDs and sampling; token batches -> the protocol's output.

The Rust front end calls `Codec.prepare` on a codec thread (conversion and encoding release the GIL) and
`decode_batch` once per batch of rank outputs, so Python runs once per batch, never per token (rust/codec/).
What crosses is typed records Rust defines (rust/codec/seam.rs, decode.rs; stubs in `_native.pyi`): `PrepareInput`
in, `Prepared` or `Refusal` out; a `DecodeBatch` (a column per field, a row per request), answered in place.
Each call names the request's door by its protocol code (rust/doors/ `Spec::CODE`), and the codec hands
it to the door registered under that code (`doors.DOORS`): what a protocol does its own way (its conversion, where
its response format is, its output's wire format) is in its module under doors/. The shared parts are the
vocabulary (vocabulary.py), prompt encoding and its length guard (prompt_encoder.py), the path every conversation
door shares (doors/conversation.py), the grammar (request_grammar.py), refusals (refusals.py) and the decoders'
core (decoding.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from deepseek_recipe import (
    ConversionOptions,
    DeepseekV4Encoding,
    DeepseekV41Encoding,
    ModelVersion,
    Tokenizer,
)

from deepinfer_server import _native, aborted, refusals
from deepinfer_server._native import CallInput, ConstraintInput, DecodeBatch, PrepareInput
from deepinfer_server.decoding import FINISHED, RUNNING, STOPPED_EARLY
from deepinfer_server.doors import DOORS, ChatDoor, CompletionsDoor, MessagesDoor, ResponsesDoor
from deepinfer_server.doors.base import Context, Prepared, Prompt
from deepinfer_server.grammar import GrammarLimits
from deepinfer_server.images import Images
from deepinfer_server.prompt_encoder import LengthGuard, PromptTooLong, RecipeEncoder
from deepinfer_server.prompt_encoder import build as build_prompt_encoder
from deepinfer_server.refusals import Refusal, error_body, too_long
from deepinfer_server.request_grammar import RequestGrammars
from deepinfer_server.vocabulary import Vocabulary, system_fingerprint

__all__ = [
    "CHAT",
    "COMPLETIONS",
    "FINISHED",
    "MESSAGES",
    "RESPONSES",
    "RUNNING",
    "STOPPED_EARLY",
    "CallInput",
    "Codec",
    "ConstraintInput",
    "PrepareInput",
    "Prepared",
    "decode_batch",
    "with_param",
]

# The protocol codes Rust passes (rust/doors/, `Spec::CODE`): each door's own.
CHAT, COMPLETIONS, MESSAGES, RESPONSES = ChatDoor.code, CompletionsDoor.code, MessagesDoor.code, ResponsesDoor.code


def with_param(body: str, protocol: int = CHAT) -> str:
    """A deepseek-recipe error envelope with `param` filled in from its message, in the door's field names."""
    return refusals.with_param(body, DOORS[protocol].schema_param)


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
        self.images = images  # None: image input is refused
        # Requests with logprobs need deepseek-recipe's tokenizer (vocabulary.py). The deepseek-recipe prompt encoder
        # holds one anyway: share it. Otherwise (fastokens encodes the prompts) it is loaded on first use.
        if isinstance(self.encoder, RecipeEncoder):
            vocab.share_recipe_tokenizer(tokenizer)
        grammars = RequestGrammars(vocab, grammar_limits)
        self.ctx = Context(vocab, options, self.encoder, max_model_len, images, grammars)

    def prepare(self, request: PrepareInput) -> Prepared | Refusal:
        """Convert and encode one request. Returns `Prepared`, or the `Refusal` of a bad request.

        `request.body` was validated and normalized by the Rust front end (model checked, developer -> system,
        max_completion_tokens -> max_tokens, unsupported features rejected). Error envelopes are OpenAI's; Rust
        re-wraps them for the Messages door.
        """
        return DOORS[request.door].prepare(self.ctx, request.body, request)

    def check_constraint(self, request: ConstraintInput) -> Refusal | None:
        """A request's grammar checked (compiled, cached) before it waits for a slot: None, or its refusal. Its
        prepare then finds the grammar in the cache."""
        return DOORS[request.door].check_constraint(self.ctx, request.body, request.forced_tool, request.parallel_tools)

    def tokenize(self, request: CallInput) -> str | Refusal:
        """vLLM's `POST /tokenize`: a chat body's prompt IDs (what its request would count), or a raw prompt's. An
        image is one placeholder ID in `tokens`; `count` adds the tokens the engine expands it to."""
        body, images = request.body, request.images
        d = json.loads(body)
        extra = 0
        if "messages" in d:
            prompt = DOORS[CHAT].prompt_tokens(self.ctx, body, images)
            if not isinstance(prompt, Prompt):
                return prompt
            ids, extra = prompt.ids, prompt.image_tokens
        else:
            raw = d.get("prompt")
            if not isinstance(raw, str):
                return Refusal(400, error_body("'prompt' (a string) or 'messages' is required", param="prompt"))
            try:
                text = self.encoder.encode_text(raw)
            except PromptTooLong as e:
                return Refusal(400, too_long(self.max_model_len, f"at least {e.at_least}", "prompt"))
            ids = [self.vocab.bos_id, *text] if d.get("add_special_tokens", True) else text
        out = {"count": len(ids) + extra, "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        return json.dumps(out)

    def detokenize(self, request: CallInput) -> str | Refusal:
        """vLLM's `POST /detokenize`."""
        tokens, n = json.loads(request.body).get("tokens"), self.vocab.vocab_size
        if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < n for t in tokens):
            return Refusal(400, error_body(f"'tokens' must be a list of token IDs below {n}", param="tokens"))
        return json.dumps({"prompt": self.vocab.text_of(tokens)}, ensure_ascii=False)

    def count_tokens(self, request: CallInput) -> str | Refusal:
        """`POST /v1/messages/count_tokens`: the prompt length of a request (its images' tokens included), from the
        encoder that serves it."""
        prompt = DOORS[request.door].prompt_tokens(self.ctx, request.body, request.images)
        if not isinstance(prompt, Prompt):
            return prompt
        return json.dumps({"input_tokens": len(prompt.ids) + prompt.image_tokens})


def decode_batch(batch: DecodeBatch) -> None:
    """One call per batch of rank outputs: each request's decoder fed its row, and the answers (each request's state
    and output) set on the batch, which Rust reads back."""
    rows = zip(batch.decoders, batch.tokens, batch.finishes, batch.logprobs, batch.prompt_logprobs, strict=True)
    abort = _native.FINISH_ABORT  # only the server's own abort reaches a decoder with it (`aborted`)
    answers = [
        decoder.push(tokens, finish, lps, plps) if finish != abort else aborted.end(decoder, tokens, lps, plps)
        for decoder, tokens, finish, lps, plps in rows
    ]
    batch.states = [state for state, _ in answers]
    batch.outputs = [output for _, output in answers]
