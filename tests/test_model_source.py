"""MODEL as a local checkpoint directory or a Hugging Face repo id (fetched into HF_HOME), with the sim engine."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from conftest import start_server

TOKDIR = Path(__file__).resolve().parent.parent / "python" / "deepinfer_server" / "tokenizer"


def checkpoint(d: Path, model_type: str = "deepseek_v41") -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKDIR / f, d / f)
    (d / "config.json").write_text(json.dumps({"model_type": model_type}))
    return d


def test_local_checkpoint_directory(tmp_path: Path) -> None:
    ckpt = checkpoint(tmp_path / "DeepSeek-V4.1-Flash")
    srv = start_server(str(ckpt))
    try:
        models = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert [m["id"] for m in models] == [str(ckpt)]  # like vLLM, MODEL is the default served name
        r = srv.client().chat.completions.create(
            model=str(ckpt), messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert r.usage.completion_tokens == 4 or r.choices[0].finish_reason == "stop"
    finally:
        assert srv.stop() == 0


def test_repo_id_from_the_hugging_face_cache(tmp_path: Path) -> None:
    """A repo id resolves through huggingface_hub into HF_HOME; offline, an already fetched snapshot is used."""
    repo = tmp_path / "hf" / "hub" / "models--deepseek-ai--DeepSeek-V4.1-Flash-1017"
    commit = "0123456789abcdef0123456789abcdef01234567"
    checkpoint(repo / "snapshots" / commit)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    srv = start_server("deepseek-ai/DeepSeek-V4.1-Flash-1017", env=env)
    try:
        models = httpx.get(f"{srv.url}/v1/models").json()["data"]
        assert models[0]["id"] == "deepseek-ai/DeepSeek-V4.1-Flash-1017"
        assert "Hugging Face cache" in srv.log()
    finally:
        assert srv.stop() == 0


@pytest.mark.parametrize(
    ("model", "message"),
    [("deepseek-ai/not-in-the-cache", "cannot fetch MODEL"), ("./no/such/dir/x", "neither a checkpoint directory")],
)
def test_unusable_model_exits_with_a_clear_error(tmp_path: Path, model: str, message: str) -> None:
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin"}
    r = subprocess.run(
        [sys.executable, "-m", "deepinfer_server", model, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert r.returncode == 1
    assert message in r.stderr
