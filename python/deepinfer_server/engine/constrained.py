"""The simulated engine's structured output: DeepInfer's so_args honoured token by token with llguidance.

`SimGrammars` compiles a request's so_args with the same mapping the server checked it with
(`deepinfer_server.grammar.llguidance_grammar`: xgrammar's strict JSON-schema mode, regex, EBNF) over the sim's own
tokenizer, and keeps compiled matchers in a bounded cache keyed by grammar. `GrammarRun` is one request's
matcher with DeepInfer's trigger semantics (structure_output/matcher.py): tokens are free until the trigger
sequence (`</think>`) has appeared in full; after a bound token, the rest of the trigger is forced; from then on every
token is one the grammar allows, and once the grammar is complete only EOS is. The output is therefore valid by
construction.

Which allowed token the sim picks: the one its script has next if the grammar allows it (the scripted tool call,
the corpus's words in strings), else a short or random allowed one; past a few tokens without structure, or a
longer run in all, it prefers tokens that close what is open (quotes, brackets, EOS), so every output ends. It
samples among the allowed candidates with the request's temperature, top-k and top-p, and the logprobs it returns
are that distribution's.
"""

from __future__ import annotations

import json
import random
from collections import OrderedDict
from pathlib import Path

from llguidance import LLMatcher, LLTokenizer

from deepinfer_server.engine.base import TokenLogprob
from deepinfer_server.engine.sampling import IMPOSSIBLE, Spelling, distribution, draw
from deepinfer_server.grammar import GrammarError, llguidance_grammar

# What DeepInfer reports when a grammar fails to compile or to run (csrc/engine/sequence.hpp).
GRAMMAR_FAILED = "xgrammar runtime errors or timeout"
# Added tokens that a grammar writes as text: DeepSeek's 128k vocabulary has them as ordinary (non-special) tokens,
# which xgrammar matches by their bytes; the bundled tokenizer marks them special.
TEXT_TOKENS = ("<think>", "</think>", "｜DSML｜")
STRUCTURE = frozenset(b'"{}[],:<>\n')
CLOSERS = ('"', "}", "]", "<", "/")
PUNCTUATION = ('"', ":", ",", "{", "[", "}", "]", "0", "1")  # tried after the script's hint, before random tokens
RUN_LIMIT = 8  # tokens without structure before closing is preferred
TOTAL_LIMIT = 96  # grammar tokens in all before closing is preferred
OFF_SCRIPT_LIMIT = 32  # the same, once the output has left the script
CANDIDATES = 24  # random vocabulary tokens tried before the whole mask is scanned


class SimGrammars:
    """One rank's grammar compiler: an llguidance tokenizer of the serving vocabulary and compiled matchers by
    grammar (bounded LRU)."""

    def __init__(self, tokenizer_path: str | Path, eos: int, vocab: Spelling, capacity: int = 64) -> None:
        tj = json.loads(Path(tokenizer_path).read_text(encoding="utf-8"))
        for added in tj.get("added_tokens") or []:
            if added.get("content") in TEXT_TOKENS:
                added["special"] = False
        self.tokenizer = LLTokenizer(json.dumps(tj), eos_token=eos)
        self.eos = eos
        self.vocab = vocab
        self.capacity = capacity
        self.cache: OrderedDict[tuple[str, str], LLMatcher | str] = OrderedDict()
        singles = {vocab.bytes[t]: t for t in vocab.plain if len(vocab.bytes[t]) == 1}
        self.closers = [singles[c.encode()] for c in CLOSERS if c.encode() in singles]
        self.punctuation = [singles[c.encode()] for c in PUNCTUATION if c.encode() in singles]
        self.blank = {t for t, b in enumerate(vocab.bytes) if b and not b.strip()}

    def compile(self, so_args: dict[str, object]) -> LLMatcher | str:
        """A fresh matcher for the request's so_args, or why the grammar cannot be compiled."""
        key = (str(so_args.get("schema_type")), str(so_args.get("schema")))
        hit = self.cache.get(key)
        if hit is None:
            try:
                grammar = llguidance_grammar(*key)
                hit = LLMatcher(self.tokenizer, grammar, log_level=0)
                if hit.is_error():
                    hit = hit.get_error()
            except GrammarError as e:
                hit = str(e)
            self.cache[key] = hit
            while len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(key)
        return hit if isinstance(hit, str) else hit.deep_copy()

    def run(self, so_args: dict[str, object]) -> GrammarRun | str:
        matcher = self.compile(so_args)
        if isinstance(matcher, str):
            return matcher
        triggers = [int(t) for t in so_args.get("trigger_token_ids") or []]  # type: ignore[attr-defined]
        bound = so_args.get("bound_token_id")
        return GrammarRun(self, matcher, triggers, None if bound is None else int(bound))  # type: ignore[call-overload]


class GrammarRun:
    """One request's grammar, with DeepInfer's trigger and bound (structure_output/matcher.py)."""

    __slots__ = (
        "aligned",
        "bound",
        "bound_fired",
        "boundaries",
        "grammars",
        "matcher",
        "pos",
        "progress",
        "run",
        "script",
        "total",
        "triggers",
    )

    def __init__(self, grammars: SimGrammars, matcher: LLMatcher, triggers: list[int], bound: int | None) -> None:
        self.grammars = grammars
        self.matcher = matcher
        self.triggers = triggers
        self.progress = 0  # of the trigger sequence (KMP, as the engine's)
        self.bound_fired = False
        self.bound = bound
        self.run = self.total = 0
        # The script's bytes from where the grammar starts, and its token at each token boundary: the hint follows
        # the script by bytes, so a different spelling of the same text stays on it; a different text leaves it.
        self.script = b""
        self.boundaries: dict[int, int] = {}
        self.pos = 0
        self.aligned = True

    def follow(self, tokens: list[int]) -> None:
        """The script the grammar's tokens are hinted from (the plan past the trigger)."""
        table = self.grammars.vocab.bytes
        parts, at = [], 0
        for t in tokens:
            self.boundaries[at] = t
            data = table[t] if t < len(table) else b""
            parts.append(data)
            at += len(data)
        self.script = b"".join(parts)

    def hint(self) -> int | None:
        """The script's next token where the output still follows it (None past it, or off it)."""
        if not self.aligned or self.pos >= len(self.script):
            return None
        at = self.boundaries.get(self.pos)
        if at is not None:
            return at
        try:
            return self.grammars.vocab.spell(self.script[self.pos : self.pos + self.grammars.vocab.longest])[0]
        except ValueError:
            return None

    @property
    def constrained(self) -> bool:
        return self.progress >= len(self.triggers)

    @property
    def forced(self) -> int | None:
        """The token the engine forces now: the trigger's next one after the bound fired."""
        return self.triggers[self.progress] if self.bound_fired and not self.constrained else None

    def free(self, token: int) -> None:
        """A token generated before the grammar applies: advance the trigger."""
        t, p = self.triggers, self.progress
        if self.bound_fired:
            self.progress += 1
            return
        while p > 0 and token != t[p]:
            p = _failure(t, p - 1)
        if token == t[p]:
            p += 1
        self.progress = p
        if self.bound is not None and token == self.bound:
            self.bound_fired = True

    def choose(
        self,
        hint: int,
        rng: random.Random,
        temperature: float,
        top_k: int,
        top_p: float,
        top: int | None,
    ) -> tuple[int, TokenLogprob | None] | None:
        """The next token under the grammar, and its logprob entry when `top` asks for logprobs (then it is
        sampled from that distribution; without, the most likely candidate is taken, as the script is followed);
        None if the grammar allows nothing (an error)."""
        m, g = self.matcher, self.grammars
        eos = g.eos
        mask = m.compute_bitmask()

        def ok(t: int) -> bool:
            return t >= 0 and (t >> 3) < len(mask) and bool((mask[t >> 3] >> (t & 7)) & 1)

        accepting = m.is_accepting()
        closing = self.run >= RUN_LIMIT or self.total >= (TOTAL_LIMIT if self.aligned else OFF_SCRIPT_LIMIT)
        sample = rng.sample(g.vocab.others, min(CANDIDATES, len(g.vocab.others)))
        others = [t for t in sample if ok(t)]
        # Free text (a string, a raw parameter): most words fit. There punctuation is no progress, and of the
        # closing tokens only those that end the free text are.
        free = len(others) * 2 >= len(sample)
        preferred: list[int] = []
        if accepting and ok(eos) and (hint == eos or closing or m.is_stopped()):
            preferred.append(eos)
        if closing:
            closers = [t for t in g.closers if ok(t)]
            if free:
                closers = [t for t in closers if not self._keeps_free(t, sample)] or closers
            preferred += closers
        if hint != eos and ok(hint):
            preferred.append(hint)
        if not free:
            preferred += [t for t in g.punctuation if ok(t)]
        if not preferred and not others:
            allowed = [t for t in _allowed(mask) if t != eos or accepting]
            others = [t for t in allowed if t not in g.blank] or allowed  # whitespace only if nothing else fits
            if not others:
                return None
            rng.shuffle(others)
        candidates = list(dict.fromkeys([*preferred, *others]))
        if top is None:
            return candidates[0], None
        logits = {t: -(4.0 + 2.0 * j + rng.random()) if j else 0.0 for j, t in enumerate(candidates[: 1 + max(3, top)])}
        for t in rng.sample(g.vocab.others, min(max(4, top), len(g.vocab.others))):
            logits.setdefault(t, IMPOSSIBLE)
        logprobs = distribution(logits, temperature, top_k, top_p)
        token = draw(logprobs, rng)
        ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])[:top]
        return token, (logprobs[token], ranked)

    def _keeps_free(self, token: int, sample: list[int]) -> bool:
        """Whether the text is still free text after `token` (most of `sample` still fits)."""
        m = self.matcher.deep_copy()
        if not m.consume_token(token):
            return True
        mask = m.compute_bitmask()
        fits = sum(1 for t in sample if (t >> 3) < len(mask) and (mask[t >> 3] >> (t & 7)) & 1)
        return fits * 2 >= len(sample)

    def accept(self, token: int) -> bool:
        """Consume a token the grammar allowed."""
        data = self.grammars.vocab.bytes[token] if token < len(self.grammars.vocab.bytes) else b""
        if self.aligned and self.script[self.pos : self.pos + len(data)] == data:
            self.pos += len(data)
        else:
            self.aligned = False
        self.total += 1
        self.run = 0 if STRUCTURE & set(data) else self.run + 1
        return bool(self.matcher.consume_token(token))


def _failure(seq: list[int], i: int) -> int:
    """KMP failure value at i (the engine's `_kmp_failure`, computed on demand: triggers are a few tokens)."""
    k = 0
    for j in range(1, i + 1):
        while k and seq[j] != seq[k]:
            k = _failure(seq, k - 1)
        if seq[j] == seq[k]:
            k += 1
    return k


def _allowed(mask: bytes) -> list[int]:
    out = []
    for i, byte in enumerate(mask):
        if byte:
            out += [i * 8 + b for b in range(8) if byte >> b & 1]
    return out
