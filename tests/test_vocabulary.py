"""The vocabulary module (python/deepinfer_server/vocabulary.py): its special IDs are deepseek-recipe's, and what
takes it instead of the codec (the sim's ranks) loads none of the server's output side."""

from __future__ import annotations

import json
import subprocess
import sys

from deepseek_recipe import SpecialToken, Tokenizer

from deepinfer_server import vocabulary
from deepinfer_server.launcher import BUNDLED_TOKENIZER
from deepinfer_server.vocabulary import Vocabulary


def test_the_spellings_are_deepseek_recipes() -> None:
    ours = [vocabulary.BOS, vocabulary.EOS, vocabulary.THINK_START, vocabulary.THINK_END, vocabulary.DSML]
    t = SpecialToken
    assert ours == [s.default_str() for s in (t.Bos, t.Eos, t.ThinkingStart, t.ThinkingEnd, t.Dsml)]


def test_the_special_ids_are_the_ones_deepseek_recipe_encodes() -> None:
    vocab = Vocabulary.load(BUNDLED_TOKENIZER)
    recipe = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    for spelling, got in [
        (vocabulary.BOS, vocab.bos_id),
        (vocabulary.EOS, vocab.eos_id),
        (vocabulary.THINK_START, vocab.think_start_id),
        (vocabulary.THINK_END, vocab.think_end_id),
        (vocabulary.DSML, vocab.dsml_id),
    ]:
        assert recipe.encode(spelling) == [got], spelling
    assert vocab.fim is not None and [recipe.encode(s) for s in vocabulary.FIM] == [[i] for i in vocab.fim]
    added = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))["added_tokens"]
    assert vocab.special == {t["id"] for t in added}


def test_the_text_of_ids_is_the_tokenizers_decoding() -> None:
    vocab = Vocabulary.load(BUNDLED_TOKENIZER)
    recipe = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    ids = recipe.encode("Hello 🎉 wörld 中文")
    assert vocab.text_of(ids) == "Hello 🎉 wörld 中文"
    assert b"".join(vocab.bytes_of(i) for i in ids).decode() == "Hello 🎉 wörld 中文"


def test_the_sim_loads_none_of_the_servers_output_side() -> None:
    """The sim's ranks take the vocabulary, not the codec: importing the engine loads no codec, door or decoder."""
    code = "import sys, deepinfer_server.engine.sim, deepinfer_server.engine.rank; print('\\n'.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(out.stdout.split())
    server_side = {
        m
        for m in loaded
        if m.startswith(("deepinfer_server.doors", "deepinfer_server.codec", "deepinfer_server.decoding"))
        or m.endswith(("_output", ".conversation"))
    }
    assert not server_side, server_side
    assert "deepinfer_server.vocabulary" in loaded
