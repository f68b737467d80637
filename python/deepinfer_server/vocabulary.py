"""The serving tokenizer's vocabulary, as the server reads it: each token's bytes, incremental detokenizers, the
special tokens' IDs, and the fingerprint of what serves it.

Decoders, the prompt's logprobs and the simulated engine's sampler take a `Vocabulary`, not the codec that converts
requests: a decoder needs none of the conversion, and the sim's ranks load this module without the server's output
side. It is built once from tokenizer.json (`Vocabulary.load`) and never changes after.

A byte-level BPE tokenizer (DeepSeek's) detokenizes by table: each token is a fixed byte string, so a batch is one
join and an incremental UTF-8 decode. Any other tokenizer goes through `tokenizers.DecodeStream`, one Rust call per
batch, and its `tokenizers` object (about 50 MB for DeepSeek's vocabulary) is loaded only then.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from deepinfer_server import __version__

if TYPE_CHECKING:  # deepseek-recipe's tokenizer is loaded by the server only (`recipe_tokenizer`), never by the sim
    from deepseek_recipe import Tokenizer as RecipeTokenizer

# DeepSeek's spellings of the special tokens the server and the sim act on (deepseek-recipe's `SpecialToken`; a
# test holds them equal).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
FIM = ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>")


def system_fingerprint(*parts: object) -> str:
    """`system_fingerprint`: names the server build and backend configuration (OpenAI types it as a string)."""
    digest = hashlib.sha256("|".join(map(str, (__version__, *parts))).encode()).hexdigest()
    return f"fp_{digest[:10]}"


class Vocabulary:
    """The tokenizer's tokens as bytes and text, and its special IDs. Thread-safe (read-only after start-up, but for
    the deepseek-recipe tokenizer loaded on first use)."""

    __slots__ = (
        "_recipe_lock",
        "_recipe_tokenizer",
        "bos_id",
        "detokenizer",
        "dsml_id",
        "eos_id",
        "fim",
        "fingerprint",
        "special",
        "think_end_id",
        "think_start_id",
        "token_bytes",
        "tokenizer_path",
        "vocab_size",
    )

    def __init__(
        self,
        tokenizer_path: str | Path,
        tokenizer_json: dict[str, Any],
        fingerprint: str = "",
    ) -> None:
        """`tokenizer_json`: the parsed tokenizer.json at `tokenizer_path` (the caller has it already)."""
        self.tokenizer_path = str(tokenizer_path)
        added = {str(t["content"]): int(t["id"]) for t in tokenizer_json.get("added_tokens") or []}
        vocab: dict[str, int] = tokenizer_json.get("model", {}).get("vocab") or {}
        self.vocab_size = max([*vocab.values(), *added.values(), -1]) + 1
        self.special = frozenset(added.values())  # added tokens: never split by a grammar or the sampler
        self.token_bytes = byte_level_table(tokenizer_json)
        # Loaded only when there is no byte table (DeepSeek's vocabulary costs ~50 MB as a tokenizers object).
        self.detokenizer = HFTokenizer.from_file(self.tokenizer_path) if self.token_bytes is None else None

        def id_of(spelling: str) -> int | None:  # as the tokenizer matches a spelling: an added token first
            i = added.get(spelling)
            return i if i is not None else vocab.get(spelling)

        def required(spelling: str) -> int:
            i = id_of(spelling)
            if i is None:
                raise ValueError(f"{tokenizer_path}: the tokenizer has no {spelling} token, which DeepSeek's have")
            return i

        self.bos_id, self.eos_id = required(BOS), required(EOS)
        self.think_end_id, self.dsml_id = required(THINK_END), required(DSML)
        self.think_start_id = id_of(THINK_START)
        fim = [i for s in FIM if (i := added.get(s)) is not None]  # fill-in-the-middle, if it has all three
        self.fim = (fim[0], fim[1], fim[2]) if len(fim) == 3 else None
        self.fingerprint = fingerprint
        # Requests with logprobs feed deepseek-recipe's processor token IDs, which needs its tokenizer (about 50 MB
        # for DeepSeek's 128k vocabulary): the one the server shares, else loaded on first use.
        self._recipe_tokenizer: RecipeTokenizer | None = None
        self._recipe_lock = threading.Lock()

    @classmethod
    def load(cls, tokenizer_path: str | Path, fingerprint: str = "") -> Vocabulary:
        """The vocabulary of a tokenizer.json file."""
        return cls(tokenizer_path, json.loads(Path(tokenizer_path).read_text(encoding="utf-8")), fingerprint)

    def share_recipe_tokenizer(self, tokenizer: RecipeTokenizer) -> None:
        """deepseek-recipe's tokenizer of the same file, which the server keeps anyway (its prompt encoder's)."""
        self._recipe_tokenizer = tokenizer

    @property
    def recipe_tokenizer(self) -> RecipeTokenizer:
        """deepseek-recipe's tokenizer, loaded on first use (a codec thread, on the first request with logprobs)."""
        tok = self._recipe_tokenizer
        if tok is None:
            with self._recipe_lock:
                if self._recipe_tokenizer is None:
                    from deepseek_recipe import Tokenizer  # the server's side only: see the TYPE_CHECKING import

                    self._recipe_tokenizer = Tokenizer.from_file(self.tokenizer_path)
                tok = self._recipe_tokenizer
        return tok

    def text(self) -> TableText | StreamText:
        """An incremental detokenizer for one request: by byte table where the tokenizer has one."""
        if self.token_bytes is not None:
            return TableText(self.token_bytes)
        assert self.detokenizer is not None
        return StreamText(self.detokenizer)

    def text_of(self, ids: list[int]) -> str:
        """The text of whole token IDs (an unfinished character at the end becomes U+FFFD)."""
        text = self.text()
        return text.feed(ids) + text.flush()

    def bytes_of(self, token: int) -> bytes:
        """A token's bytes: from the byte-level table, else as the tokenizer decodes it alone."""
        table = self.token_bytes
        if table is not None:
            return table[token] if token < len(table) else b""
        assert self.detokenizer is not None
        return str(self.detokenizer.decode([token], False)).encode()


def byte_level_table(tokenizer_json: dict[str, Any]) -> list[bytes] | None:
    """Each token ID's bytes when the tokenizer's decoder is plain ByteLevel, else None.

    Mirrors the ByteLevel decoder: a token whose characters all map to bytes (the GPT-2 byte alphabet) becomes
    those bytes; any other token (a special token such as <｜end▁of▁sentence｜>) stays its UTF-8 text. An added
    token's spelling wins over a model token with the same ID, as in the tokenizer's own decoding.
    """
    decoder, model = tokenizer_json.get("decoder"), tokenizer_json.get("model")
    if not isinstance(decoder, dict) or decoder.get("type") != "ByteLevel" or not isinstance(model, dict):
        return None
    added = tokenizer_json.get("added_tokens") or []
    vocab = model.get("vocab") or {}
    if not isinstance(vocab, dict) or not isinstance(added, list):
        return None
    entries = [*vocab.items(), *((str(t["content"]), int(t["id"])) for t in added)]
    char_to_byte = {c: b for b, c in enumerate(_byte_alphabet())}
    table = [b""] * (max((i for _, i in entries), default=-1) + 1)
    for token, i in entries:
        try:
            table[i] = bytes([char_to_byte[c] for c in token])
        except KeyError:
            table[i] = token.encode("utf-8")
    return table


def _byte_alphabet() -> list[str]:
    """The character GPT-2's byte-level BPE uses for each byte 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


class TableText:
    """Byte-level detokenizing: join the tokens' bytes, decode UTF-8 holding back an unfinished character."""

    __slots__ = ("table", "utf8")

    def __init__(self, table: list[bytes]) -> None:
        self.table = table
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def feed(self, tokens: list[int]) -> str:
        table = self.table
        try:
            data = b"".join([table[t] for t in tokens])
        except IndexError:  # an ID past the vocabulary (a padded output layer): no text, as tokenizer.decode does
            data = b"".join([table[t] for t in tokens if t < len(table)])
        return str(self.utf8.decode(data))

    def flush(self) -> str:
        return str(self.utf8.decode(b"", True))  # an unfinished character becomes U+FFFD


class StreamText:
    """Any other tokenizer: `tokenizers.DecodeStream`, which holds a whole batch that ends inside a character."""

    __slots__ = ("held", "stream", "tokenizer")

    def __init__(self, tokenizer: HFTokenizer) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=False)
        self.held: list[int] = []

    def feed(self, tokens: list[int]) -> str:
        text = self.stream.step(self.tokenizer, tokens[0] if len(tokens) == 1 else tokens)  # an int is 2x faster
        if text is None:
            self.held += tokens
            return ""
        self.held = []
        return text

    def flush(self) -> str:
        text, self.held = self.tokenizer.decode(self.held, False) if self.held else "", []
        return text
