"""Prompt token IDs: deepseek-recipe renders the conversation, and the BPE runs in fastokens when fastokens is
verified to give deepseek-recipe's IDs for this tokenizer; otherwise deepseek-recipe encodes the whole conversation.

Encoding the prompt is most of the CPU a request costs the front end (Hugging Face tokenizers, which deepseek-recipe
uses, takes ~1 us per prompt token here; fastokens ~0.015, and it releases the GIL while it works; BENCHMARKS.md).
The fast path mirrors deepseek-recipe's own encoding: the rendered prompt is split at its special ranges, plain text
is encoded without the added vocabulary (so user text that spells a special token stays text) and each special range
maps through the added vocabulary. A reimplementation is exact only where it has been shown to be, so at start-up it
must reproduce deepseek-recipe on a probe set; if it does not, cannot load the tokenizer, or is not installed,
deepseek-recipe encodes every prompt.

Either way a prompt whose rendered text is so long that it cannot fit the context is refused before any BPE runs
(`LengthGuard`): a body of megabytes would otherwise cost the codec thread a second of encoding to learn that.
"""

from __future__ import annotations

import json
import logging
import math
import random
from typing import Protocol

from deepseek_recipe import ChatCompletionRequest, Conversation, ConversionOptions, Tokenizer

log = logging.getLogger("deepinfer_server.prompt_encoder")

CHOICES = ("auto", "fastokens", "recipe")
# Pre-tokenizers that only split the text (keep every character); with any other one the guard is off.
_SPLITTING_PRE_TOKENIZERS = {"Sequence", "Split", "ByteLevel", "Digits", "Punctuation", "UnicodeScripts"}


class PromptTooLong(Exception):
    """The rendered prompt has at least `at_least` tokens, which leaves no room for a completion."""

    def __init__(self, at_least: int) -> None:
        super().__init__(f"at least {at_least} tokens")
        self.at_least = at_least


class LengthGuard:
    """Refuses a rendered prompt that cannot fit `max_model_len` tokens, from its length alone.

    With byte-level BPE and nothing that drops characters before it, every byte of the prompt lands in some token
    and no token stands for more than `longest` bytes, so a prompt of n characters (at least n bytes) has at least
    n / `longest` tokens. The bound never refuses a prompt that fits."""

    def __init__(self, longest: int, max_model_len: int) -> None:
        self.longest = longest
        self.max_chars = (max_model_len - 1) * longest  # more characters than this: at least max_model_len tokens

    @classmethod
    def for_tokenizer(
        cls, tokenizer_json: dict[str, object], token_bytes: list[bytes] | None, max_model_len: int
    ) -> LengthGuard | None:
        """The guard for this tokenizer, given each token ID's bytes (byte-level tokenizers only), or None when its
        pipeline could drop characters (then the bound is void)."""
        if not token_bytes:
            return None
        normalizer = tokenizer_json.get("normalizer")
        if normalizer is not None and not (
            isinstance(normalizer, dict) and normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
        ):
            return None
        if not _only_splits(tokenizer_json.get("pre_tokenizer")):
            return None
        longest = max(len(b) for b in token_bytes)
        return cls(longest, max_model_len) if longest > 0 else None

    def check(self, text: str) -> None:
        if len(text) > self.max_chars:
            raise PromptTooLong(math.ceil(len(text) / self.longest))


def _only_splits(pre: object) -> bool:
    if pre is None:
        return True
    if not isinstance(pre, dict) or pre.get("type") not in _SPLITTING_PRE_TOKENIZERS:
        return False
    if pre.get("type") == "Split" and str(pre.get("behavior", "")).lower() == "removed":
        return False
    inner = pre.get("pretokenizers") or []
    return isinstance(inner, list) and all(_only_splits(p) for p in inner)


class PromptEncoder(Protocol):
    def encode(self, conversation: Conversation) -> list[int]: ...


class Encoder(PromptEncoder, Protocol):
    """What serves requests: conversations, and raw text (completion prompts)."""

    def encode_text(self, text: str) -> list[int]:
        """Plain text without the added vocabulary: a special-token spelling stays text."""
        ...


class Rendered(Protocol):
    """deepseek-recipe's RenderedPrompt: the prompt text and the (start, end) character spans of special tokens."""

    @property
    def prompt(self) -> str: ...

    @property
    def special_ranges(self) -> list[tuple[int, int]]: ...


class Renderer(Protocol):
    """deepseek-recipe's DeepseekV4Encoding / DeepseekV41Encoding: renders the prompt text without a tokenizer."""

    def render_conversation(self, conversation: Conversation) -> Rendered: ...

    def with_tokenizer(self, tokenizer: Tokenizer) -> Encoding: ...


class Encoding(PromptEncoder, Protocol):
    """A `Renderer` with deepseek-recipe's tokenizer attached: it encodes too."""

    def render_conversation(self, conversation: Conversation) -> Rendered: ...


def plain_bpe_json(tokenizer_json: dict[str, object]) -> str:
    """The tokenizer without its added vocabulary, for BPE on plain text only.

    fastokens wants the model's IDs dense (0..n-1). An added token may also sit in the model vocabulary at a far
    ID (the bundled tokenizer pins <｜image｜> at DeepSeek's 129264); BPE on plain text never yields an added
    token, so such entries are left out of this copy."""
    model = tokenizer_json.get("model")
    added = tokenizer_json.get("added_tokens") or []
    if not isinstance(model, dict) or not isinstance(added, list):
        raise ValueError("tokenizer.json: no model or a malformed added_tokens")
    spellings = {str(t["content"]) for t in added}
    vocab = model.get("vocab") or {}
    vocab = {k: i for k, i in vocab.items() if k not in spellings or i < len(vocab)}
    plain = {**tokenizer_json, "added_tokens": [], "model": {**model, "vocab": vocab}}
    return json.dumps(plain, ensure_ascii=False)


class RecipeEncoder:
    """deepseek-recipe renders and encodes; the guard sees the rendered text first. Plain text goes through a
    deepseek-recipe tokenizer without the added vocabulary (`plain_bpe_json`)."""

    def __init__(self, encoding: Encoding, guard: LengthGuard | None, plain: Tokenizer) -> None:
        self.encoding, self.guard, self.plain = encoding, guard, plain

    def encode_text(self, text: str) -> list[int]:
        if self.guard is not None:
            self.guard.check(text)
        return self.plain.encode(text)

    def encode(self, conversation: Conversation) -> list[int]:
        if self.guard is not None:
            self.guard.check(self.encoding.render_conversation(conversation).prompt)
        return self.encoding.encode(conversation)


class FastEncoder:
    """Render with deepseek-recipe, split at the special ranges, BPE in fastokens."""

    def __init__(self, renderer: Renderer, tokenizer_json: dict[str, object], guard: LengthGuard | None = None) -> None:
        from fastokens import Tokenizer as Fastokens  # optional at import time: `build` falls back without it

        added = tokenizer_json.get("added_tokens") or []
        if not isinstance(added, list):
            raise ValueError("tokenizer.json: added_tokens is not a list")
        self.special = {str(t["content"]): int(t["id"]) for t in added}
        self.bpe = Fastokens.from_json_str(plain_bpe_json(tokenizer_json))
        self.renderer, self.guard = renderer, guard

    def encode_text(self, text: str) -> list[int]:
        """BPE of plain text (the GIL is released while fastokens works)."""
        if self.guard is not None:
            self.guard.check(text)
        return self._bpe(text)

    def _bpe(self, text: str) -> list[int]:
        ids: list[int] = self.bpe.encode(text).ids
        return ids

    def encode(self, conversation: Conversation) -> list[int]:
        rendered = self.renderer.render_conversation(conversation)
        text = rendered.prompt
        if self.guard is not None:
            self.guard.check(text)
        ids: list[int] = []
        pos = 0
        for start, end in rendered.special_ranges:
            if start > pos:
                ids += self._bpe(text[pos:start])
            piece = text[start:end]
            special = self.special.get(piece)
            if special is None:  # not an added token: the model vocabulary, as deepseek-recipe looks it up
                special = self.bpe.token_to_id(piece)
            if special is None:  # the template uses a token this tokenizer lacks (deepseek-recipe raises too)
                raise RuntimeError(f"the special token {piece!r} is not in the tokenizer's vocabulary")
            ids.append(special)
            pos = end
        if pos < len(text):
            ids += self._bpe(text[pos:])
        return ids


def build(
    choice: str,
    tokenizer_json: dict[str, object],
    tokenizer: Tokenizer,
    renderer: Renderer,
    options: ConversionOptions,
    model: str,
    guard: LengthGuard | None = None,
) -> Encoder:
    """The prompt encoder for `choice` (auto, fastokens, recipe). `tokenizer` is deepseek-recipe's, loaded from the
    same `tokenizer.json`, which only the deepseek-recipe encoder keeps; the probe conversations are converted as
    requests for `model` are, with `options`."""
    encoding = renderer.with_tokenizer(tokenizer)
    if choice == "recipe":
        log.info("prompt encoder: deepseek-recipe")
        return RecipeEncoder(encoding, guard, Tokenizer.from_str(plain_bpe_json(tokenizer_json)))
    try:
        fast = FastEncoder(renderer, tokenizer_json, guard)
        problem = verify(fast, encoding, tokenizer, options, model)
    except Exception as e:  # not installed, or cannot read this tokenizer
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        log.info("prompt encoder: fastokens (matches deepseek-recipe on the start-up probes)")
        return fast
    if choice == "fastokens":
        raise SystemExit(f"--prompt-encoder fastokens: {problem}")
    log.warning("prompt encoder: deepseek-recipe (fastokens not used: %s)", problem)
    return RecipeEncoder(encoding, guard, Tokenizer.from_str(plain_bpe_json(tokenizer_json)))


# Text that exercises every branch of DeepSeek's and GPT-2's pre-tokenizers: scripts, digits, whitespace runs and
# line breaks, punctuation, contractions, emoji, combining marks, control characters, special-token spellings.
_PIECES = (
    "Hello", " world", "the", " of", "毕老师", "こんにちは", "カタカナ", "한국어", "Привет", "مرحبا", "שלום", "नमस्ते",
    "ไทย", "12345", "3.14159", "2026-11-29", " ", "  ", "\n", "\r\n", "\t", "\n\n", "   \n", " \n ", "😀", "🦀",
    "👍🏽", "é", "ñ", "ß", "Ā", "\u0301", "\u200b", "\x00", "\x7f", "\ufffd", "'s", "'S", "n't", "'ll", "!!!", "?!",
    "#$%", "...", "—", "’", "…", "a-b", "C++", "x_y", "@user", "http://x.org/a?b=c", 'def f(x):\n    return x**2\n',
    '{"a": [1, 2]}', "<｜User｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "｜DSML｜", "<tool_result>",
)  # fmt: skip


def probe_texts(n: int = 1500, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    texts = ["".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 24))) for _ in range(n)]
    ranges = ((32, 0x2FF), (0x370, 0x52F), (0x4E00, 0x9FFF), (0x3040, 0x30FF), (0x1F300, 0x1FAFF), (0, 0xD7FF))
    for _ in range(n // 3):
        chars = [chr(rng.randint(*rng.choice(ranges))) for _ in range(rng.randint(1, 40))]
        texts.append("".join(chars))
    return texts


def verify(
    fast: FastEncoder, encoding: Encoding, tokenizer: Tokenizer, options: ConversionOptions, model: str
) -> str | None:
    """None if `fast` gives deepseek-recipe's IDs on every probe, else what differed."""
    specials = tuple(fast.special)
    for text in probe_texts():
        if any(s in text for s in specials):
            continue  # deepseek-recipe's Tokenizer.encode maps special spellings; the conversations cover them
        want = tokenizer.encode(text)
        if fast.encode_text(text) != want:
            return f"its IDs differ from deepseek-recipe's for {text[:60]!r}"
    rng = random.Random(1)
    for _ in range(40):
        messages = [
            {"role": role, "content": "".join(rng.choice(_PIECES) for _ in range(rng.randint(1, 30)))}
            for role in ("system", "user", "assistant", "user")[: rng.randint(2, 4)]
        ]
        body = {"model": model, "messages": messages, "thinking": {"type": rng.choice(("enabled", "disabled"))}}
        conversation = ChatCompletionRequest(body).convert(options).conversation
        if fast.encode(conversation) != encoding.encode(conversation):
            return "its IDs differ from deepseek-recipe's for a probe conversation"
    return None
