"""What the simulated model says, and how it reads the prompt: corpus text (deterministic for the same prompt and
seed), a reasoning part when the prompt ends in `<think>`, a well-formed DSML tool call when it offers tools (and
its last turn is not a tool result), the engine's EOS at a plausible length, and for a prompt that asks
`sim:images`, what the rank received of its images."""

from __future__ import annotations

import hashlib
import json
import random
import re
import zlib
from array import array
from pathlib import Path

from tokenizers import Tokenizer

from deepinfer_server.engine.base import Images, Submit
from deepinfer_server.vocabulary import Vocabulary

CORPUS = Path(__file__).with_name("sim_corpus.txt")
_TOOLS_SECTION = re.compile(r"### Available Tool Schemas\n\n(.*?)\n\nYou MUST strictly follow", re.S)


class Script:
    """The serving tokenizer, the corpus in its tokens, and each request's scripted output (`plan`)."""

    def __init__(self, tokenizer_path: str, vocab: Vocabulary, seed: int = 0) -> None:
        self.tok = Tokenizer.from_file(tokenizer_path)
        self.seed = seed  # the checkpoint's (engine/sim_config.py `script_seed`): another seed, other answers
        self.eos = vocab.eos_id
        self.think_start = vocab.think_start_id
        self.think_end: int | None = vocab.think_end_id
        self.dsml: int | None = vocab.dsml_id
        self.corpus = self.tok.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False).ids
        # Starting points at sentence boundaries, past any line breaks, so every answer begins with a word. (An answer
        # that began with a newline would show its first token one step late: the parser drops leading newlines.)
        self.starts = []
        for i, t in enumerate(self.corpus[:-1]):
            if self.tok.id_to_token(t) in (".", ".Ċ"):
                j = i + 1
                while j < len(self.corpus) and not (self.tok.id_to_token(self.corpus[j]) or "").strip("Ċ"):
                    j += 1
                self.starts.append(j % len(self.corpus))
        self.words = [w for w in re.findall(r"[A-Za-z]{4,}", CORPUS.read_text(encoding="utf-8"))]
        self._entropy = random.Random()  # seeds unseeded requests without an os.urandom read each

    def wants_images(self, prompt: list[int]) -> bool:
        """Whether the prompt asks for what the rank received of its images (`sim:images`)."""
        return "sim:images" in self.tok.decode(prompt, skip_special_tokens=False)

    def free_text(self, plan: list[int]) -> int:
        """Where a plan's free text ends (a tool call's markup, which a stray token would break, starts)."""
        if self.dsml is None or self.dsml not in plan:
            return len(plan)
        k = plan.index(self.dsml)
        return max(0, k - 4)  # the call's opening "\n\n<" comes just before

    def rng(self, req: Submit) -> random.Random:
        """The request's random stream: from its prompt and seed, so the same request gets the same answer."""
        if req.seed is None and req.temperature > 0:
            return self._entropy  # unseeded: not reproducible, as with a real model
        digest = zlib.crc32(array("I", req.prompt).tobytes())
        return random.Random(digest * 1_000_003 + (req.seed or 0) + self.seed * 1_000_000_007 * 1_000_003)

    def text(self, rng: random.Random, n: int) -> list[int]:
        """`n` tokens of corpus text, from a sentence's start."""
        start = rng.choice(self.starts) if self.starts else 0
        c = self.corpus
        out = c[start : start + n]
        while len(out) < n:  # wraps around the corpus
            out += c[: n - len(out)]
        return out

    def plan(self, prompt: list[int], rng: random.Random, ignore_eos: bool) -> list[int]:
        """The request's scripted output: reasoning if the prompt opens it, a tool call or text, then the EOS."""
        plan: list[int] = []
        if self.think_start is not None and prompt[-1] == self.think_start and self.think_end is not None:
            plan += self.text(rng, rng.randint(8, 96))
            plan.append(self.think_end)
        call = self._tool_call(prompt, rng) if self.dsml is not None and self.dsml in prompt else None
        plan += call if call is not None else self.text(rng, rng.randint(16, 200))
        if not ignore_eos:
            plan.append(self.eos)
        return plan

    def describe(self, images: Images) -> list[int]:
        """What the rank received, for tests to check the images arrived intact."""
        seen = [
            f"{w}x{h}/{len(d)}/{hashlib.sha256(d).hexdigest()[:16]}"
            for (w, h), d in zip(images.sizes, images.data, strict=True)
        ]
        text = f"images={len(seen)} " + " ".join(seen) + f" extra_tokens={images.extra_tokens}"
        return self.tok.encode(text, add_special_tokens=False).ids

    def _tool_call(self, prompt: list[int], rng: random.Random) -> list[int] | None:
        """A DSML tool call for one of the offered tools, unless the last turn is already a tool result."""
        text = self.tok.decode(prompt, skip_special_tokens=False)
        last_user = text.rfind("<｜User｜>")
        if "</tool_result>" in text[last_user:]:
            return None
        m = _TOOLS_SECTION.search(text)
        if not m:
            return None
        tools = []
        for line in m.group(1).splitlines():
            try:
                tools.append(json.loads(line))
            except ValueError:
                continue
        if not tools:
            return None
        tool = tools[rng.randrange(len(tools))]
        schema = tool.get("parameters") or {}
        props = schema.get("properties") or {}
        names = list(schema.get("required") or props)[:4]
        d = "｜DSML｜"
        lines = [f"\n\n<{d} calls>", f'<{d} invoke name="{tool.get("name", "tool")}">']
        for name in names:
            value, is_string = self._argument(name, (props.get(name) or {}).get("type"), rng)
            lines.append(
                f'<{d} parameter name="{name}" string="{"true" if is_string else "false"}">{value}</{d} parameter>'
            )
        lines += [f"</{d} invoke>", f"</{d} calls>"]
        return self.tok.encode("\n".join(lines), add_special_tokens=False).ids

    def _argument(self, name: str, kind: object, rng: random.Random) -> tuple[str, bool]:
        if kind == "integer":
            return str(rng.randint(1, 10)), False
        if kind == "number":
            return f"{rng.randint(1, 99) / 4}", False
        if kind == "boolean":
            return rng.choice(("true", "false")), False
        if kind == "array":
            return "[]", False
        if kind == "object":
            return "{}", False
        if "city" in name.lower():
            return "Paris", True
        return rng.choice(self.words) if self.words else "value", True
