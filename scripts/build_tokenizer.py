#!/usr/bin/env python3
"""Build the bundled DeepSeek-V4.1 special-token tokenizer used when no MODEL is given.

A byte-level BPE trained with the `tokenizers` package on a small inline corpus (the simulated engine's text, the
chat-template boilerplate and JSON/tool-call markup), plus every special token deepseek-recipe renders or parses.
IDs pinned as the libraries expect: BOS=0, EOS=1, PAD=2 (DeepInfer's tokenizer checks) and <｜image｜>=129264
(deepseek_recipe.IMAGE_SPECIAL_TOKEN_ID). The other special IDs are arbitrary and are NOT the real model's IDs.

Reproducible: no download, fixed corpus and trainer settings.

    python scripts/build_tokenizer.py [OUT_DIR]   # default: python/deepinfer_server/tokenizer
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "python" / "deepinfer_server" / "engine" / "sim_corpus.txt"
DEFAULT_OUT = ROOT / "python" / "deepinfer_server" / "tokenizer"

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
IMAGE, IMAGE_ID = "<｜image｜>", 129264
# Everything deepseek-recipe 0.2.0 renders or parses (SpecialToken.*.default_str()), besides BOS/EOS.
SPECIALS = [
    "<think>",
    "</think>",
    "<｜System｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜latest_reminder｜>",
    "｜DSML｜",
    IMAGE,
    "<｜ref｜>",
    "<｜/ref｜>",
    "<｜box｜>",
    "<｜/box｜>",
    "<｜point｜>",
    "<｜/point｜>",
    "<｜polygon｜>",
    "<｜/polygon｜>",
    # Fill-in-the-middle, for /v1/completions' `suffix` (DeepSeek's spellings).
    "<｜fim▁begin｜>",
    "<｜fim▁hole｜>",
    "<｜fim▁end｜>",
]
TEMPLATE_TEXT = [
    "Reasoning Effort: 75 (range 1-100, the higher the value, the more thorough the reasoning)",
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a",
    'invoke name="get_weather" parameter name="city" string="true" string="false" calls tool_calls',
    'String parameters should be specified as is and set `string="true"`. For all other types (numbers, '
    'booleans, arrays, objects), pass the value in JSON format and set `string="false"`.',
    "### Available Tool Schemas You MUST strictly follow the above defined tool name and parameter schemas",
    '{"name": "get_weather", "description": "Get the weather", "parameters": {"type": "object", '
    '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}',
    "<tool_result>sunny, 21 C</tool_result> Request nonce the of and to in is as be he have an you more",
    "weather Paris tool call reasoning Hello! How can I help you today?",
]


# DeepSeek V3/V4's pre-tokenizer (from their tokenizer.json): digits in runs of up to three, CJK and kana runs on
# their own, then a GPT-4-like split of words, punctuation and whitespace; ByteLevel maps bytes without a regex.
DEEPSEEK_PRE_TOKENIZER = pre_tokenizers.Sequence(
    [
        pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
        pre_tokenizers.Split(Regex("[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"), behavior="isolated"),
        pre_tokenizers.Split(
            Regex(
                "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
                " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"
            ),
            behavior="isolated",
        ),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ]
)


def build(out_dir: Path) -> Path:
    text = CORPUS.read_text(encoding="utf-8")
    # ASCII lines only: the sim's accented text stays split into byte tokens, which logprobs tests need.
    corpus = [line for line in text.splitlines() if line.strip() and line.isascii()] * 8 + TEMPLATE_TEXT * 8
    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = DEEPSEEK_PRE_TOKENIZER
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=[BOS, EOS, PAD],  # IDs 0, 1, 2 in the model vocab
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 byte symbols: any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    data = json.loads(tok.to_str())
    # `tokenizers` renumbers added tokens on load unless the spelling is also in the model vocab, so pin
    # <｜image｜> in both places.
    for added in data["added_tokens"]:
        if added["content"] == IMAGE:
            added["id"] = IMAGE_ID
    data["model"]["vocab"][IMAGE] = IMAGE_ID
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "tokenizer.json"
    check = Tokenizer.from_str(json.dumps(data, ensure_ascii=False))
    path.write_text(check.to_str(), encoding="utf-8")  # re-saved: file IDs equal the IDs used at load time
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 131072,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=1) + "\n")
    loaded = Tokenizer.from_file(str(path))
    for s, want in ((BOS, 0), (EOS, 1), (PAD, 2), (IMAGE, IMAGE_ID)):
        got = loaded.token_to_id(s)
        if got != want:
            raise SystemExit(f"{s} has id {got}, expected {want}")
    return path


if __name__ == "__main__":
    p = build(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_OUT)
    t = Tokenizer.from_file(str(p))
    print(f"wrote {p}: vocab {t.get_vocab_size(with_added_tokens=False)}, with added {t.get_vocab_size()}")
