"""Prompt token IDs: deepseek-recipe renders the conversation, and the BPE runs in fastokens when fastokens is
verified to give deepseek-recipe's IDs for this tokenizer; otherwise deepseek-recipe encodes the whole conversation.

Encoding the prompt is most of the CPU a request costs the front end (Hugging Face tokenizers, which deepseek-recipe
uses, takes ~1 us per prompt token here; fastokens ~0.015, and it releases the GIL while it works; BENCHMARKS.md).
The fast path mirrors deepseek-recipe's own encoding: the rendered prompt is split at its special ranges, plain text
is encoded without the added vocabulary (so user text that spells a special token stays text) and each special range
maps through the added vocabulary. A reimplementation is exact only where it has been shown to be, so at start-up it
must reproduce deepseek-recipe on a probe set; if it does not, cannot load the tokenizer, or is not installed,
deepseek-recipe encodes every prompt.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Protocol

from deepseek_recipe import ChatCompletionRequest, Conversation, ConversionOptions, Tokenizer

log = logging.getLogger("deepinfer_server.prompt_encoder")

CHOICES = ("auto", "fastokens", "recipe")


class PromptEncoder(Protocol):
    def encode(self, conversation: Conversation) -> list[int]: ...


class Rendered(Protocol):
    """deepseek-recipe's RenderedPrompt: the prompt text and the (start, end) character spans of special tokens."""

    @property
    def prompt(self) -> str: ...

    @property
    def special_ranges(self) -> list[tuple[int, int]]: ...


class Encoding(PromptEncoder, Protocol):
    """deepseek-recipe's DeepseekV4Encoding / DeepseekV41Encoding with a tokenizer attached."""

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


class FastEncoder:
    """Render with deepseek-recipe, split at the special ranges, BPE in fastokens."""

    def __init__(self, encoding: Encoding, tokenizer_json: dict[str, object]) -> None:
        from fastokens import Tokenizer as Fastokens  # optional at import time: `build` falls back without it

        added = tokenizer_json.get("added_tokens") or []
        if not isinstance(added, list):
            raise ValueError("tokenizer.json: added_tokens is not a list")
        self.special = {str(t["content"]): int(t["id"]) for t in added}
        self.bpe = Fastokens.from_json_str(plain_bpe_json(tokenizer_json))
        self.encoding = encoding

    def encode_text(self, text: str) -> list[int]:
        """BPE of plain text (the GIL is released while fastokens works)."""
        ids: list[int] = self.bpe.encode(text).ids
        return ids

    def encode(self, conversation: Conversation) -> list[int]:
        rendered = self.encoding.render_conversation(conversation)
        text = rendered.prompt
        ids: list[int] = []
        pos = 0
        for start, end in rendered.special_ranges:
            if start > pos:
                ids += self.encode_text(text[pos:start])
            special = self.special.get(text[start:end])
            if special is None:  # not in the added vocabulary: deepseek-recipe raises the error the client gets
                return self.encoding.encode(conversation)
            ids.append(special)
            pos = end
        if pos < len(text):
            ids += self.encode_text(text[pos:])
        return ids


def build(
    choice: str,
    tokenizer_path: str | Path,
    tokenizer: Tokenizer,
    encoding: Encoding,
    options: ConversionOptions,
    model: str,
) -> PromptEncoder:
    """The prompt encoder for `choice` (auto, fastokens, recipe). `tokenizer` is deepseek-recipe's, loaded from
    `tokenizer_path`; the probe conversations are converted as requests for `model` are, with `options`."""
    if choice == "recipe":
        log.info("prompt encoder: deepseek-recipe")
        return encoding
    try:
        fast = FastEncoder(encoding, json.loads(Path(tokenizer_path).read_text(encoding="utf-8")))
        problem = verify(fast, encoding, tokenizer, options, model)
    except Exception as e:  # not installed, or cannot read this tokenizer
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        log.info("prompt encoder: fastokens (matches deepseek-recipe on the start-up probes)")
        return fast
    if choice == "fastokens":
        raise SystemExit(f"--prompt-encoder fastokens: {problem}")
    log.warning("prompt encoder: deepseek-recipe (fastokens not used: %s)", problem)
    return encoding


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
