"""A weight reload without dropping the listener (issue 42, point 5), over real HTTP against the sim: SGLang's
`POST /update_weights_from_disk`. A checkpoint's config.json sets the sim's script seed, so different checkpoints
answer a greedy prompt differently, as different weights would: the tests see which checkpoint wrote each answer."""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server, start_server

from deepinfer_server import _native
from deepinfer_server.engine.base import Ability
from deepinfer_server.engine.loop import take_requests

TOKDIR = Path(__file__).resolve().parent.parent / "python" / "deepinfer_server" / "tokenizer"
KEY = "sekrit"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = ["The river", "In the morning the", "A short note on"]
STEP_MS = 10
TOKENS = 30  # a request lasts about TOKENS * STEP_MS


def checkpoint(d: Path, seed: int, **config: Any) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKDIR / f, d / f)
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "sim_script_seed": seed, **config}))
    return d


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("ckpts")
    return {name: checkpoint(root / name, seed) for name, seed in (("v1", 1), ("v2", 2))}


@pytest.fixture(scope="module")
def srv(ckpts: dict[str, Path]) -> Iterator[Server]:
    args = ("--served-model-name", MODEL, "--dp", "2", "--max-num-seqs", "4", "--sim-decode-step-ms", str(STEP_MS))
    s = start_server(str(ckpts["v1"]), *args, "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture
def http(srv: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c:
        yield c


def answer(http: httpx.Client, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def answers(http: httpx.Client) -> dict[str, str]:
    return {p: answer(http, p) for p in PROMPTS}


def reload(http: httpx.Client, path: Path, **body: Any) -> httpx.Response:
    return http.post("/update_weights_from_disk", json={"model_path": str(path), **body})


class Load:
    """Greedy requests sent one after another on threads, and /health polled, until `stop`: every answer and
    status code, for a test to check that each answer came whole from one checkpoint."""

    def __init__(self, srv: Server, threads: int = 3) -> None:
        self.results: list[tuple[str, int, str]] = []
        self.health: list[int] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self.send, args=(srv, i), daemon=True) for i in range(threads)]
        self.threads.append(threading.Thread(target=self.poll, args=(srv,), daemon=True))
        for t in self.threads:
            t.start()

    def send(self, srv: Server, i: int) -> None:
        with httpx.Client(base_url=srv.url, timeout=60, headers=AUTH) as c:
            n = i
            while not self.done.is_set():
                prompt = PROMPTS[n % len(PROMPTS)]
                body = {"model": MODEL, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
                r = c.post("/v1/completions", json=body)
                text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
                self.results.append((prompt, r.status_code, text))
                n += 1

    def poll(self, srv: Server) -> None:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            while not self.done.is_set():
                self.health.append(c.get("/health").status_code)
                time.sleep(0.02)

    def stop(self) -> None:
        self.done.set()
        for t in self.threads:
            t.join(timeout=60)


def test_a_reload_switches_every_new_answer_and_none_is_a_mix(
    srv: Server, http: httpx.Client, ckpts: dict[str, Path]
) -> None:
    reload(http, ckpts["v1"], weight_version="v1")
    old = answers(http)
    load = Load(srv)
    time.sleep(0.5)  # requests running on both ranks when the reload comes
    t0 = time.monotonic()
    r = reload(http, ckpts["v2"], weight_version="step-2")
    took = time.monotonic() - t0
    time.sleep(0.5)
    load.stop()
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["num_paused_requests"] >= 1, body
    assert set(body) == {"success", "message", "num_paused_requests"}
    new = answers(http)
    assert all(new[p] != old[p] for p in PROMPTS), (old, new)
    # Every answer, during the reload too, is wholly the old checkpoint's or wholly the new one's; none failed.
    kinds = []
    for prompt, status, text in load.results:
        assert status == 200, text  # no 429, no 503: requests that came during the reload waited
        assert text in (old[prompt], new[prompt]), (prompt, text)
        kinds.append(text == new[prompt])
    assert True in kinds and False in kinds, kinds
    assert kinds == sorted(kinds)  # one switch: no old answer after a new one (one sender each; ordered overall)
    assert load.health and set(load.health) == {200}
    assert took < 10
    # The version shows wherever SGLang shows it.
    assert http.get("/get_weight_version").json() == {"weight_version": "step-2"}
    g = http.post("/generate", json={"text": "The river", "sampling_params": {"max_new_tokens": 4}}).json()
    assert g["meta_info"]["weight_version"] == "step-2"
    assert http.get("/server_info").json()["weight_version"] == "step-2"


def test_requests_sent_during_a_reload_wait_and_then_get_the_new_weights(
    srv: Server, http: httpx.Client, ckpts: dict[str, Path]
) -> None:
    reload(http, ckpts["v1"])
    old = answer(http, PROMPTS[0])
    # A running request holds the reload in its drain; requests sent meanwhile wait at the gate.
    long = threading.Thread(target=answer, args=(http, PROMPTS[1]))
    long.start()
    time.sleep(0.1)
    done: dict[str, httpx.Response] = {}
    reloader = threading.Thread(target=lambda: done.setdefault("r", reload(http, ckpts["v2"])))
    reloader.start()
    deadline = time.monotonic() + 5
    while not http.get("/is_paused").json()["is_paused"] and time.monotonic() < deadline:
        time.sleep(0.005)
    assert http.get("/is_paused").json()["is_paused"] is True
    # A continue in the middle does not let requests reach ranks that are loading: the reload resumes.
    cont = http.post("/continue_generation").json()
    assert "weight reload is running" in cont["message"], cont
    assert http.get("/is_paused").json()["is_paused"] is True
    during = answer(http, PROMPTS[0])  # sent while paused: waits, then runs on the new checkpoint
    reloader.join()
    long.join()
    assert done["r"].status_code == 200 and done["r"].json()["success"] is True
    assert during != old and during == answer(http, PROMPTS[0])
    # Without weight_version the version is the checkpoint directory's name.
    assert http.get("/get_weight_version").json() == {"weight_version": "v2"}


def test_abort_all_requests_ends_the_running_ones_at_once(
    srv: Server, http: httpx.Client, ckpts: dict[str, Path]
) -> None:
    reload(http, ckpts["v1"])
    got: dict[str, Any] = {}

    def long() -> None:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 3000, "ignore_eos": True}
        got["r"] = http.post("/v1/completions", json=body).json()

    t = threading.Thread(target=long)
    t.start()
    time.sleep(0.3)
    t0 = time.monotonic()
    r = reload(http, ckpts["v2"], abort_all_requests=True)
    assert time.monotonic() - t0 < 5  # not the 30 s the request would have taken
    t.join()
    assert r.json()["success"] is True and r.json()["num_paused_requests"] == 1
    assert got["r"]["choices"][0]["finish_reason"] == "abort"


def test_another_tokenizer_or_architecture_is_refused_before_anything_stops(
    srv: Server, http: httpx.Client, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    reload(http, ckpts["v1"], weight_version="v1")
    old = answers(http)
    other_tok = checkpoint(tmp_path / "other-tokenizer", 5)
    tok = json.loads((other_tok / "tokenizer.json").read_text())
    tok["added_tokens"] = tok["added_tokens"][:-1]
    (other_tok / "tokenizer.json").write_text(json.dumps(tok))
    other_arch = checkpoint(tmp_path / "other-arch", 5, model_type="llama")
    for ckpt, what in ((other_tok, "tokenizer"), (other_arch, "architecture"), (tmp_path / "missing", "directory")):
        # A request running meanwhile is not paused: the refusal comes long before it ends.
        running = threading.Thread(target=answer, args=(http, PROMPTS[0]))
        running.start()
        time.sleep(0.05)
        r = reload(http, ckpt)
        assert running.is_alive()
        running.join()
        assert r.status_code == 400, r.text
        body = r.json()
        assert body["success"] is False and body["num_paused_requests"] == 0 and what in body["message"], body
    assert answers(http) == old
    assert http.get("/get_weight_version").json() == {"weight_version": "v1"}
    assert http.get("/is_paused").json()["is_paused"] is False


def test_a_checkpoint_that_fails_to_load_rolls_back(
    srv: Server, http: httpx.Client, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    reload(http, ckpts["v1"], weight_version="v1")
    old = answers(http)
    broken = checkpoint(tmp_path / "broken", 9, sim_load_error="shard 3 of 8 is truncated")
    r = reload(http, broken)
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["success"] is False and "could not load" in body["message"], body
    assert "every rank still serves" in body["message"] and str(ckpts["v1"].resolve()) in body["message"], body
    assert answers(http) == old
    assert http.get("/get_weight_version").json() == {"weight_version": "v1"}
    assert "shard 3 of 8 is truncated" in srv.log()  # the rank's log says why
    assert httpx.get(f"{srv.url}/health").status_code == 200
    # And the server still reloads afterwards.
    assert reload(http, ckpts["v2"]).json()["success"] is True


def test_when_one_rank_fails_the_ranks_that_loaded_go_back(
    srv: Server, http: httpx.Client, ckpts: dict[str, Path], tmp_path: Path
) -> None:
    reload(http, ckpts["v1"], weight_version="v1")
    old = answers(http)
    half = checkpoint(tmp_path / "half", 9, sim_load_error="rank 1's shard is gone", sim_load_error_ranks=[1])
    r = reload(http, half)
    assert r.status_code == 400 and "[1]" in r.json()["message"] and "rolled back" in r.json()["message"], r.text
    log = srv.log()
    assert f"rank0 weights reloaded from {half.resolve()}" in log  # rank 0 loaded it...
    assert log.rindex(f"rank0 weights reloaded from {ckpts['v1'].resolve()}") > log.rindex(str(half.resolve()))
    # ...and went back: every rank answers as before, whichever takes a request.
    for _ in range(2):
        assert answers(http) == old
    assert http.get("/get_weight_version").json() == {"weight_version": "v1"}


def test_the_reload_needs_the_api_key(srv: Server, ckpts: dict[str, Path]) -> None:
    r = httpx.post(f"{srv.url}/update_weights_from_disk", json={"model_path": str(ckpts["v2"])})
    assert r.status_code == 401
    bad = httpx.post(f"{srv.url}/update_weights_from_disk", json={}, headers=AUTH)
    assert bad.status_code == 400 and "model_path" in bad.text


def test_ranks_in_lockstep_reload_too(ckpts: dict[str, Path]) -> None:
    """Ranks that step together at the server's barrier (--sim-lockstep) reload between two steps of the group."""
    s = start_server(str(ckpts["v1"]), "--served-model-name", MODEL, "--dp", "2", "--sim-lockstep")
    try:
        with httpx.Client(base_url=s.url, timeout=60) as c:
            old = answers(c)
            r = reload(c, ckpts["v2"])
            assert r.status_code == 200 and r.json()["success"] is True, r.text
            new = answers(c)
            assert all(new[p] != old[p] for p in PROMPTS), (old, new)
    finally:
        assert s.stop() == 0


class NoReload:
    """An engine without `Ability.RELOAD`: it must never be asked to reload."""

    def add(self, req: Any) -> list[Any]:
        raise AssertionError("no request was sent")

    def abort(self, request_ids: list[int]) -> None:
        raise AssertionError("no abort was sent")


def test_an_engine_that_cannot_reload_says_so_and_keeps_serving(ring_path: Any) -> None:
    req = _native.Ring.create(ring_path(), 1 << 16)
    out = _native.Ring.create(ring_path(), 1 << 16)
    for _ in range(2):
        req.push_reload("/ckpt/step-2")
        published, stop = take_requests(NoReload(), req, out, frozenset({Ability.COLLECTIVES}))  # type: ignore[arg-type]
        assert (published, stop) == ([], False)
    # Two reloads done, the last one failed: what rust/path/reload.rs waits for.
    assert out.aux(_native.AUX_RELOADS) == 2 << 32 | _native.RELOAD_FAILED
