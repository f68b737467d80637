"""A weight reload on DeepInfer's adapter (issue 42, point 5), over real HTTP against the fake engine
(tests/fake_deepinfer), two DP ranks that step together: `POST /update_weights_from_disk` closes each rank's engine
and builds another on the new checkpoint, every rank at the same lockstep iteration (engine/deepinfer_build.py).

The fake reads its "weights" from the checkpoint's config.json: `fake_weights_seed` changes what every prompt
generates (so the tests see which checkpoint wrote an answer) and `fake_load_fails` makes the load fail."""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, start_server

TOKDIR = Path(__file__).resolve().parent.parent / "python" / "deepinfer_server" / "tokenizer"
PROMPTS = ["The river", "In the morning the", "A short note on"]
ENV = {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7", "DEEPINFER_USE_NEXTN_DECODE": "0", "FAKE_DEEPINFER_STEP_MS": "2"}


def checkpoint(d: Path, **config: Any) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKDIR / f, d / f)
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "vocab_size": 129280, **config}))
    return d


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {
        "v1": checkpoint(root / "v1", fake_weights_seed=1),
        "v2": checkpoint(root / "v2", fake_weights_seed=2),
        "broken": checkpoint(root / "broken", fake_weights_seed=3, fake_load_fails=True),
    }


@pytest.fixture(scope="module")
def srv(ckpts: dict[str, Path]) -> Iterator[Server]:
    args = ("--served-model-name", MODEL, "--engine", "fake-deepinfer", "--dp", "2", "--max-num-seqs", "4")
    s = start_server(*args, "--", str(ckpts["v1"]), env=ENV)
    yield s
    assert s.stop() == 0, s.log()


@pytest.fixture
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


def answer(c: httpx.Client, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "seed": 7}
    r = c.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def answers(c: httpx.Client) -> dict[str, str]:
    return {p: answer(c, p) for p in PROMPTS}


def reload(c: httpx.Client, path: Path, status: int = 200) -> dict[str, Any]:
    r = c.post("/update_weights_from_disk", json={"model_path": str(path)})
    assert r.status_code == status, r.text  # SGLang's: 200 when it loaded, else 400
    return dict(r.json())


def test_each_checkpoint_is_served_whole_after_its_reload(srv: Server, http: httpx.Client, ckpts: dict) -> None:
    v1 = answers(http)
    assert answers(http) == v1  # the fake is deterministic per checkpoint: a change below is the reload's
    out = reload(http, ckpts["v2"])
    assert out["success"] is True and out["num_paused_requests"] == 0, out
    v2 = answers(http)
    assert all(v2[p] != v1[p] for p in PROMPTS), (v1, v2)
    assert http.get("/get_weight_version").json()["weight_version"] == "v2"
    assert reload(http, ckpts["v1"])["success"] is True
    assert answers(http) == v1  # back on the first weights: the same answers as before
    # Each rank closed its engine and built one on each checkpoint, the group together.
    log = srv.log()
    for rank in (0, 1):
        assert f"rank {rank} closed: steps=" in log
        assert log.count(f"rank {rank}/2: ") >= 3, log  # the start, then one build per reload
    assert "lockstep=ok" in log and "lockstep violation" not in log


def test_a_checkpoint_that_fails_to_load_leaves_the_old_one_serving(
    srv: Server, http: httpx.Client, ckpts: dict
) -> None:
    before = answers(http)
    version = http.get("/get_weight_version").json()["weight_version"]
    out = reload(http, ckpts["broken"], 400)
    assert out["success"] is False, out
    assert "could not load" in out["message"] and "still serves" in out["message"], out
    assert "the checkpoint's weights do not load" in srv.log()
    assert answers(http) == before
    assert http.get("/get_weight_version").json()["weight_version"] == version
    assert http.get("/health").status_code == 200


def test_requests_sent_during_a_reload_wait_and_come_from_one_checkpoint(
    http: httpx.Client, srv: Server, ckpts: dict
) -> None:
    assert reload(http, ckpts["v1"])["success"] is True
    v1 = answers(http)
    assert reload(http, ckpts["v2"])["success"] is True
    v2 = answers(http)
    assert reload(http, ckpts["v1"])["success"] is True
    results: list[tuple[str, str]] = []
    done = threading.Event()

    def send(i: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while not done.is_set():
                p = PROMPTS[i % len(PROMPTS)]
                results.append((p, answer(c, p)))
                i += 1

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    try:
        out = reload(http, ckpts["v2"])
    finally:
        done.set()
        for t in threads:
            t.join(timeout=60)
    assert out["success"] is True, out
    assert results, "no request ran around the reload"
    # Every answer is one checkpoint's, whole; none is a mix of the two.
    assert all(text in (v1[p], v2[p]) for p, text in results), results
