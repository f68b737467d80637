"""The prompt tokens' logprobs, as each door shows them: Completions' `echo` with `logprobs` (OpenAI's legacy
logprobs object over the echoed prompt, the first token's null) and vLLM's `prompt_logprobs` extension (a list of
`{token id: {logprob, rank, decoded_token}}`, the first null).

DeepInfer computes each prompt token's own logprob and no alternatives (`SamplingParams.prompt_logprobs`): the
alternatives shown at a prompt position are that token alone, and its rank is unknown (null)."""

from __future__ import annotations

import codecs
import json

from deepinfer_server.vocabulary import Vocabulary

# One legacy logprobs entry: (token text, logprob or None, alternatives {text: logprob} or None, text offset).
LegacyEntry = tuple[str, float | None, dict[str, float] | None, int]


class PromptTokens:
    """A prompt's tokens and the text each adds (a character split across tokens belongs to the one that completes
    it), for showing the prompt's logprobs beside them."""

    __slots__ = ("ids", "texts")

    def __init__(self, vocab: Vocabulary, ids: list[int], hide_first: bool = False) -> None:
        utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.ids = ids
        self.texts = [str(utf8.decode(vocab.bytes_of(t))) for t in ids]
        if hide_first and self.texts:
            self.texts[0] = ""  # the BOS the server put before a text prompt: not part of the echoed text

    def _values(self, values: list[float]) -> list[float | None]:
        """One value per prompt token: none for the first (nothing comes before it). DeepInfer computes them for
        the tokens it prefills (`prompt_len - 1` in all, over every chunk): when it reused a cached prefix, the
        values it returns are the last ones, and the positions before them have none."""
        n = len(self.ids)
        if n == 0:
            return []
        tail: list[float | None] = list(values[max(0, len(values) - (n - 1)) :])
        return [None] * (n - len(tail)) + tail

    def values(self, values: list[float]) -> list[float | None]:
        """One value per prompt token, the first (and any the engine reused from its cache) None."""
        return self._values(values)

    def legacy(self, values: list[float], top: int) -> list[LegacyEntry]:
        """Completions' entries for the echoed prompt, offsets from 0; `top` 0 shows no alternatives."""
        out: list[LegacyEntry] = []
        offset = 0
        for text, value in zip(self.texts, self._values(values), strict=True):
            alternatives = None if value is None else ({text: value} if top > 0 else {})
            out.append((text, value, alternatives, offset))
            offset += len(text)
        return out

    def vllm(self, values: list[float]) -> str:
        """vLLM's `prompt_logprobs` list, as JSON."""
        out: list[dict[str, dict[str, object]] | None] = []
        for token, text, value in zip(self.ids, self.texts, self._values(values), strict=True):
            out.append(None if value is None else {str(token): {"logprob": value, "rank": None, "decoded_token": text}})
        return json.dumps(out, ensure_ascii=False, separators=(",", ":"))
