"""Prompt token IDs: deepseek-recipe renders the conversation, and the BPE runs in kitoken when kitoken is verified
to give deepseek-recipe's IDs for this tokenizer; otherwise deepseek-recipe encodes the whole conversation.

Encoding the prompt is most of the CPU a request costs the front end (Hugging Face tokenizers, which deepseek-recipe
uses, takes ~0.7 us per prompt token here; kitoken is 3-5x faster on DeepSeek's tokenizer, BENCHMARKS.md). The fast
path mirrors deepseek-recipe's own encoding: the rendered prompt is split at its special ranges, plain text is
encoded without the added vocabulary (so user text that spells a special token stays text) and each special range
maps through the added vocabulary. kitoken is not bit-exact for every tokenizer (it splits GPT-2's `'s` after a
newline differently), so at start-up it must reproduce deepseek-recipe on a probe set; if it does not, or is not
installed, deepseek-recipe encodes every prompt.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path
from typing import Protocol

from deepseek_recipe import ChatCompletionRequest, Conversation, ConversionOptions, Tokenizer

log = logging.getLogger("deepinfer_server.prompt_encoder")

CHOICES = ("auto", "kitoken", "recipe")


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


class KitokenEncoder:
    """Render with deepseek-recipe, split at the special ranges, BPE in kitoken."""

    def __init__(self, encoding: Encoding, tokenizer_json: dict[str, object]) -> None:
        from kitoken import Kitoken  # optional at import time: `build` falls back without it

        added = tokenizer_json.get("added_tokens") or []
        if not isinstance(added, list):
            raise ValueError("tokenizer.json: added_tokens is not a list")
        self.special = {str(t["content"]): int(t["id"]) for t in added}
        plain = json.dumps({**tokenizer_json, "added_tokens": []}, ensure_ascii=False).encode()
        self.bpe = Kitoken.from_tokenizers(plain)
        self.encoding = encoding

    def encode(self, conversation: Conversation) -> list[int]:
        rendered = self.encoding.render_conversation(conversation)
        text = rendered.prompt
        ids: list[int] = []
        pos = 0
        for start, end in rendered.special_ranges:
            if start > pos:
                ids += self.bpe.encode(text[pos:start], False)
            special = self.special.get(text[start:end])
            if special is None:  # not in the added vocabulary: deepseek-recipe raises the error the client gets
                return self.encoding.encode(conversation)
            ids.append(special)
            pos = end
        if pos < len(text):
            ids += self.bpe.encode(text[pos:], False)
        return ids


def build(
    choice: str,
    tokenizer_path: str | Path,
    tokenizer: Tokenizer,
    encoding: Encoding,
    options: ConversionOptions,
    model: str,
) -> PromptEncoder:
    """The prompt encoder for `choice` (auto, kitoken, recipe). `tokenizer` is deepseek-recipe's, loaded from
    `tokenizer_path`; the probe conversations are converted as requests for `model` are, with `options`."""
    if choice == "recipe":
        log.info("prompt encoder: deepseek-recipe")
        return encoding
    try:
        fast = KitokenEncoder(encoding, json.loads(Path(tokenizer_path).read_text(encoding="utf-8")))
        problem = verify(fast, encoding, tokenizer, options, model)
    except Exception as e:  # not installed, or cannot read this tokenizer
        problem = f"{type(e).__name__}: {e}"
    if problem is None:
        log.info("prompt encoder: kitoken (matches deepseek-recipe on the start-up probes)")
        return fast
    if choice == "kitoken":
        raise SystemExit(f"--prompt-encoder kitoken: {problem}")
    log.warning("prompt encoder: deepseek-recipe (kitoken not used: %s)", problem)
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
    fast: KitokenEncoder, encoding: Encoding, tokenizer: Tokenizer, options: ConversionOptions, model: str
) -> str | None:
    """None if `fast` gives deepseek-recipe's IDs on every probe, else what differed."""
    specials = tuple(fast.special)
    for text in probe_texts():
        if any(s in text for s in specials):
            continue  # deepseek-recipe's Tokenizer.encode maps special spellings; the conversations cover them
        want = tokenizer.encode(text)
        if fast.bpe.encode(text, False) != want:
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
