"""The simulated engine's sampler, for the requests that need one (logprobs, a grammar): a distribution over a few
candidate tokens per step, sampled with the request's temperature, top-k and top-p, whose logprobs are what the
request gets back.

The candidates at each step are the token the script (or, under a grammar, the scripted valid output) has next,
which is the most likely; its shorter spellings, tokens whose bytes begin it, which are less likely and, when
sampled, leave the rest of its bytes for the next steps, so the text stays the script's; and a few other tokens
for the alternatives list, which in free text are possible (unlikely) and elsewhere impossible (a stray token in
a tool call's markup would break it). As in DeepInfer, an impossible token's logprob is clamped at -9999.
"""

from __future__ import annotations

import itertools
import math
import random
import zlib
from collections import deque
from collections.abc import Callable

from deepinfer_server.engine.base import Submit, TokenLogprob
from deepinfer_server.vocabulary import Vocabulary

# DeepInfer clamps token logprobs at -9999: what an impossible token reports.
IMPOSSIBLE = -9999.0
# Below this temperature DeepInfer samples greedily (sampling_params.py: 1e-5).
GREEDY_BELOW = 1e-5
DISTRACTORS = 4  # other tokens per step, at least (more when more alternatives are asked for)


class Spelling:
    """The vocabulary's token bytes both ways, and which tokens are special (a grammar or the sampler never splits
    those)."""

    def __init__(self, vocab: Vocabulary) -> None:
        table = vocab.token_bytes
        if table is None:
            raise ValueError("the simulated engine's sampler needs a byte-level BPE tokenizer")
        self.vocab = vocab
        self.bytes = table
        self.special = vocab.special
        self.by_bytes = {b: i for i, b in enumerate(table) if b and i not in self.special}
        self.plain = sorted(self.by_bytes.values())
        # Other tokens offered as alternatives: whole characters (a lone continuation byte is no likely guess).
        self.others = [t for t in self.plain if _whole_text(table[t])]
        self.longest = max(len(b) for b in self.by_bytes)

    def spell(self, data: bytes) -> list[int]:
        """Tokens for `data`, longest match first (every single byte is a token in a byte-level vocabulary)."""
        out, i = [], 0
        while i < len(data):
            for n in range(min(self.longest, len(data) - i), 0, -1):
                t = self.by_bytes.get(data[i : i + n])
                if t is not None:
                    out.append(t)
                    i += n
                    break
            else:
                raise ValueError(f"byte {data[i]:#x} has no token")
        return out


Allowed = Callable[[int], bool]


class Sampler:
    """One request's sampling, step by step, along its scripted tokens (`plan`; past it, the corpus)."""

    __slots__ = ("cursor", "free_end", "pending", "plan", "rng", "temperature", "top", "top_k", "top_p", "vocab")

    def __init__(self, vocab: Spelling, plan: list[int], free_end: int, req: Submit, rng: random.Random) -> None:
        self.vocab = vocab
        self.plan = plan
        self.free_end = free_end  # scripted tokens from here on are markup: no stray alternatives
        self.cursor = 0
        self.pending: deque[int] = deque()  # the rest of a token whose shorter spelling was sampled
        self.rng = rng
        self.top = req.logprobs or 0
        self.temperature = req.temperature
        self.top_k = req.top_k
        self.top_p = req.top_p

    def scripted(self, corpus_at: Callable[[int], int]) -> tuple[int, bool]:
        """The token the script has next, and whether it is the script's own (not the corpus past its end)."""
        if self.pending:
            return self.pending[0], False
        if self.cursor < len(self.plan):
            return self.plan[self.cursor], True
        return corpus_at(self.cursor), False

    def next(self, corpus_at: Callable[[int], int], allowed: Allowed | None = None) -> tuple[int, TokenLogprob, bool]:
        """Sample one token: (token, its logprob entry, whether it is the script's EOS-or-last token)."""
        scripted, own = self.scripted(corpus_at)
        vocab, rng = self.vocab, self.rng
        free = scripted not in vocab.special and (self.cursor >= len(self.plan) or self.cursor < self.free_end)
        logits: dict[int, float] = {}
        if allowed is None or allowed(scripted):
            logits[scripted] = 0.0
        data = vocab.bytes[scripted] if scripted not in vocab.special else b""
        for n in range(len(data) - 1, 0, -1):
            t = vocab.by_bytes.get(data[:n])
            if t is not None and t not in logits and (allowed is None or allowed(t)):
                logits[t] = -(2.0 + 0.75 * (len(data) - n) + rng.random())
        # Enough distinct others that every step offers `top` alternatives, as an engine does: a draw that repeats a
        # candidate draws again (a bounded number of times; the vocabulary has thousands of others).
        want, j, draws = len(logits) + max(DISTRACTORS, self.top), 0, 0
        while len(logits) < want and draws < 4 * want:
            draws += 1
            t = vocab.others[rng.randrange(len(vocab.others))]
            if t not in logits:
                ok = free and (allowed is None or allowed(t))
                logits[t] = -(6.0 + j + rng.random()) if ok else IMPOSSIBLE
                j += 1
        if not any(v > IMPOSSIBLE for v in logits.values()):
            raise NoCandidate(scripted)
        logprobs = self._distribution(logits)
        token = self._draw(logprobs)
        self._advance(scripted, token, data)
        ranked = sorted(logprobs.items(), key=lambda kv: -kv[1])[: self.top]
        return token, (logprobs[token], ranked), own and token == scripted

    def _distribution(self, logits: dict[int, float]) -> dict[int, float]:
        return distribution(logits, self.temperature, self.top_k, self.top_p)

    def _draw(self, logprobs: dict[int, float]) -> int:
        return draw(logprobs, self.rng)

    def _advance(self, scripted: int, token: int, data: bytes) -> None:
        if self.pending:
            self.pending.popleft()
        else:
            self.cursor += 1
        if token != scripted and data and data.startswith(self.vocab.bytes[token]):
            # A shorter spelling: the rest of the scripted token's bytes come next.
            self.pending.extendleft(reversed(self.vocab.spell(data[len(self.vocab.bytes[token]) :])))


def distribution(logits: dict[int, float], temperature: float, top_k: int, top_p: float) -> dict[int, float]:
    """Logprobs of the distribution sampled from: temperature, then top-k and top-p, renormalized."""
    ranked = sorted(logits.items(), key=lambda kv: -kv[1])
    keep = len(ranked) if top_k < 1 else min(top_k, len(ranked))
    keep = 1 if temperature < GREEDY_BELOW else keep
    live = [(t, v / max(temperature, GREEDY_BELOW)) for t, v in ranked[:keep] if v > IMPOSSIBLE]
    peak = live[0][1]
    weights = [(t, math.exp(v - peak)) for t, v in live]
    total = sum(w for _, w in weights)
    probs = [(t, w / total) for t, w in weights]
    if top_p < 1.0:
        cut, mass = [], 0.0
        for t, p in probs:
            cut.append((t, p))
            mass += p
            if mass >= top_p:
                break
        total = sum(p for _, p in cut)
        probs = [(t, p / total) for t, p in cut]
    out = dict.fromkeys(logits, IMPOSSIBLE)
    for t, p in probs:
        out[t] = max(IMPOSSIBLE, math.log(p)) if p > 0 else IMPOSSIBLE
    return out


def draw(logprobs: dict[int, float], rng: random.Random) -> int:
    """One token drawn from a distribution of logprobs."""
    x = rng.random()
    last = None
    for t, lp in sorted(logprobs.items(), key=lambda kv: -kv[1]):
        if lp <= IMPOSSIBLE:
            break
        last = t
        x -= math.exp(lp)
        if x < 0:
            return t
    assert last is not None
    return last


def _whole_text(data: bytes) -> bool:
    try:
        return data.decode("utf-8").isprintable()
    except UnicodeDecodeError:
        return False


class NoCandidate(Exception):
    """No token the grammar allows is left to the sampler."""


def prompt_logprobs(prompt: list[int], temperature: float) -> list[float]:
    """The simulated model's logprob of each prompt token after the first, as DeepInfer returns them (one per
    position, at the request's temperature). At each position the model weighs the token that follows against
    three others: the token's logit falls with how unusual the pair (previous token, token) is, a hash of the pair
    standing in for a model's knowledge, so the same text always scores the same and different texts differ."""
    t = max(temperature, GREEDY_BELOW)
    out = []
    for prev, tok in itertools.pairwise(prompt):
        h = zlib.crc32(prev.to_bytes(4, "little") + tok.to_bytes(4, "little"))
        actual = -4.0 * (h & 0xFFFF) / 0xFFFF  # in [-4, 0]
        rival = -1.0 - ((h >> 16) & 0xFF) / 0xFF  # the best other token, in [-2, -1]
        logits = (actual, rival, rival - 1.0, rival - 2.5)
        peak = max(logits)
        total = sum(math.exp((x - peak) / t) for x in logits)
        out.append((actual - peak) / t - math.log(total))
    return out
