"""DeepInfer's adapter end to end against the fake deepinfer (tests/fake_deepinfer), plus adapter unit tests.

The server runs with `--engine fake-deepinfer`, DeepInfer's entry in the engine registry but for tests/fake_deepinfer
first on its ranks' PYTHONPATH, so they import the fake `deepinfer` and `torch` (whose collectives really run across
the rank processes, and fail loudly when ranks leave lockstep).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from conftest import (
    MODEL,
    BackgroundStream,
    Server,
    group_members,
    idle_wakeups_per_s,
    requests_across_idle_gaps,
    shm_segments,
    sse_has_text,
    wait_for,
    wait_until_gone,
)

from deepinfer_server.engine.base import rows as output_rows

HERE = Path(__file__).resolve().parent
FAKE = HERE / "fake_deepinfer"
BUNDLED = HERE.parent / "python" / "deepinfer_server" / "tokenizer"
NO_THINK = {"thinking": {"type": "disabled"}}


def make_checkpoint(root: Path, vocab_size: int = 129280) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / name).write_bytes((BUNDLED / name).read_bytes())
    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "vocab_size": vocab_size}))
    return root


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("ckpt"))


def fake_env(**extra: str) -> dict[str, str]:
    env = {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",  # the fake needs integer ids, like the real engine
        "DEEPINFER_USE_NEXTN_DECODE": "0",
    }
    env.update(extra)
    return env


def _integrated() -> str | None:
    """The fake's entry in the engine registry, which runs DeepInfer's adapter on the fake; None when present."""
    from deepinfer_server.engine import deepinfer_config
    from deepinfer_server.engine.base import Ability
    from deepinfer_server.engine.registry import ENGINES

    entry = ENGINES.get("fake-deepinfer")
    if entry is None or entry.build != "deepinfer_server.engine.deepinfer_build:build":
        return "engine/registry.py has no --engine fake-deepinfer entry that builds engine/deepinfer.py's engine"
    if Ability.COLLECTIVES not in entry.abilities:
        return "the fake-deepinfer entry does not step its ranks together (lockstep.serve_lockstep)"
    if entry.launch is not deepinfer_config.launch_fake or deepinfer_config.FAKE_DEEPINFER != FAKE:
        return "the fake-deepinfer entry does not launch DeepInfer's ranks on tests/fake_deepinfer"
    return None


@pytest.fixture
def deepinfer_server(make_server, checkpoint):
    missing = _integrated()
    if missing:
        pytest.fail(f"--engine fake-deepinfer is not wired into the rank process: {missing}")

    def start(*args: str, **env: str) -> Server:
        return make_server("--engine", "fake-deepinfer", *args, "--", str(checkpoint), env=fake_env(**env))

    return start


def stop_cleanly(srv: Server) -> str:
    before = {s for s in shm_segments() if f"-{srv.proc.pid}-" in s}
    assert srv.stop() == 0, srv.log()
    left = {s for s in shm_segments() if f"-{srv.proc.pid}-" in s}
    assert not left, (before, left)
    return srv.log()


def chat(client: openai.OpenAI, content: str = "hello", **kw: object) -> object:
    return client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        extra_body={**NO_THINK, **kw.pop("extra", {})},
        **kw,
    )


def stream_text(client: openai.OpenAI, **kw: object) -> tuple[str, str | None, int | None]:
    text, finish, usage = "", None, None
    for ch in client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": kw.pop("content", "hello")}],
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**NO_THINK, **kw.pop("extra", {})},
        **kw,
    ):
        if ch.usage is not None:
            usage = ch.usage.completion_tokens
        for c in ch.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish, usage


# -- end to end ---------------------------------------------------------------------------------------------------


def test_dp2_lockstep_stream_and_non_stream_then_clean_shutdown(deepinfer_server) -> None:
    srv = deepinfer_server("--ep", "2", "--dp", "2", "--max-num-seqs", "8", "--max-model-len", "4096")
    client = srv.client(timeout=30)
    results: list[object] = []
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            if i % 2:
                results.append(stream_text(client, content=f"question {i}", max_tokens=200))
            else:
                r = chat(client, f"question {i}", max_tokens=200)
                results.append((r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert len(results) == 12
    for text, finish, n in results:  # type: ignore[misc]
        assert text and finish in ("stop", "length") and n and n > 0
    assert any(finish == "stop" for _, finish, _ in results)  # type: ignore[misc]
    log = stop_cleanly(srv)
    starts = re.findall(r"fake-deepinfer rank (\d)/2: CUDA_VISIBLE_DEVICES=(\S+) rendezvous=(\S+) nextn=(\d+)", log)
    assert sorted(s[:2] for s in starts) == [("0", "0"), ("1", "1")], log
    assert len({s[2] for s in starts}) == 1  # one rendezvous shared by the ranks
    assert all(s[3] == "0" for s in starts)  # speculative decoding off by default
    assert "prefill_intervals=1/1" in log and "multimodal_pool=0" in log and "log_stats=1" in log
    closed = re.findall(r"rank (\d) closed: steps=(\d+) flushes=(\d+).*? lockstep=ok", log)
    assert len(closed) == 2 and closed[0][1:] == closed[1][1:], log
    assert log.count("ve_round_trips=0 ") == 2, log  # text-only requests never wait for the VE worker


def test_idle_dp_ranks_make_no_collectives_and_wake_for_requests(deepinfer_server) -> None:
    srv = deepinfer_server(
        "--dp", "2", "--max-num-seqs", "8", "--max-model-len", "4096", "--disable-log-stats",
        DEEPINFER_SERVER_IDLE_WAIT_S="60",
    )  # fmt: skip
    requests_across_idle_gaps(srv)
    time.sleep(0.5)
    wakeups = idle_wakeups_per_s(srv)
    assert all(w < 50 for w in wakeups), wakeups  # an all-reduce every 2 ms made ~850 a second
    log = stop_cleanly(srv)  # the shutdown rings the bell: no 60 s wait
    assert log.count("log_stats=0") == 2, log
    closed = re.findall(r"rank (\d) closed: steps=(\d+) flushes=(\d+).*? lockstep=ok", log)
    assert len(closed) == 2 and closed[0][1:] == closed[1][1:], log


def test_speculative_multi_token_steps_keep_exact_ignore_eos_lengths(deepinfer_server) -> None:
    srv = deepinfer_server(
        "--dp", "2", "--max-num-seqs", "8", "--max-model-len", "4096", DEEPINFER_USE_NEXTN_DECODE="3"
    )
    client = srv.client(timeout=30)
    for n in (1, 2, 7, 37, 250):
        r = chat(client, f"count {n}", max_tokens=n, extra={"ignore_eos": True})
        assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length", (n, r)
        _, finish, usage = stream_text(client, content=f"stream {n}", max_tokens=n, extra={"ignore_eos": True})
        assert usage == n and finish == "length", (n, usage, finish)
    # Up to 4 tokens per request per step, each counted once: every generated token, a first token per request.
    metrics = httpx.get(f"{srv.url}/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M)
        assert m, (name, metrics)
        return float(m.group(1))

    assert value("vllm:generation_tokens_total") == 2 * sum((1, 2, 7, 37, 250))
    assert value("vllm:time_to_first_token_seconds_count") == 10
    itl = value("vllm:inter_token_latency_seconds_count")
    assert 2 * sum((1, 2, 7, 37, 250)) - 10 >= itl > 2 * sum((0, 1, 6, 36, 249)) / 2, itl
    # Each decode step of a request proposes 3 draft tokens and emits 1 + the accepted ones; the first token of
    # each request comes from its prefill.
    drafted = value("vllm:spec_decode_num_draft_tokens_total")
    accepted = value("vllm:spec_decode_num_accepted_tokens_total")
    assert 0 < accepted < drafted and drafted % 3 == 0, (drafted, accepted)
    assert drafted / 3 + accepted == 2 * sum((1, 2, 7, 37, 250)) - 10, (drafted, accepted)
    log = stop_cleanly(srv)
    assert "nextn=3" in log
    per_step = [int(x) for x in re.findall(r"max_tokens_per_request_step=(\d+)", log)]
    assert per_step and max(per_step) == 4, log


def test_lost_abort_and_stop_sequence_free_engine_capacity(deepinfer_server) -> None:
    # One engine slot, 5 ms steps, requests spend 40 steps being admitted (aborts in that window are lost).
    srv = deepinfer_server(
        "--dp", "1", "--max-num-seqs", "1", "--max-model-len", "8192",
        FAKE_DEEPINFER_STEP_MS="5", FAKE_DEEPINFER_ADMISSION_STEPS="40",
    )  # fmt: skip
    long = {"max_tokens": 8000, "extra": {"ignore_eos": True}}
    with pytest.raises(openai.APITimeoutError):  # client leaves while the request is still being admitted
        chat(srv.client(timeout=0.05), "long one", **long)
    # Without the re-abort, the lost request would hold the only engine slot for 8000 steps (40 s).
    r = chat(srv.client(timeout=10), "short", max_tokens=5, extra={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    # A stop sequence ends a running request early: the server aborts it and the slot comes back.
    text, finish, _ = stream_text(srv.client(timeout=10), content="stop early", stop=["e"], **long)
    assert finish == "stop" and "e" not in text
    r = chat(srv.client(timeout=10), "after", max_tokens=5, extra={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    wait_for(
        "the re-abort in /metrics",
        lambda: "deepinfer_engine_reaborted_requests_total 1" in httpx.get(f"{srv.url}/metrics").text,
    )
    log = stop_cleanly(srv)
    assert "lost_aborts=1" in log and "reaborted=1" in log, log


def test_engine_rejection_is_an_error_for_that_request_only(deepinfer_server) -> None:
    # KV for 100 prompt tokens: a longer prompt ends with "prompt_length_exceeded" (no token).
    srv = deepinfer_server("--dp", "2", "--gpu-memory-utilization", "0.5", FAKE_DEEPINFER_KV_TOKENS="200")
    client = srv.client(timeout=30)
    big = "lorem ipsum dolor sit amet " * 40
    with pytest.raises(openai.BadRequestError, match="prompt_length_exceeded") as e:
        chat(client, big, max_tokens=5)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.APIError, match="prompt_length_exceeded"):
        stream_text(client, content=big, max_tokens=5)
    for _ in range(4):  # both ranks still serve
        r = chat(client, "short", max_tokens=5, extra={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert re.search(r'deepinfer_aborted_requests_total\{[^}]*reason="prompt_length_exceeded"\} 2', metrics)
    stop_cleanly(srv)


def test_insufficient_system_resource_is_a_503_with_retry_after(deepinfer_server) -> None:
    srv = deepinfer_server("--dp", "2", FAKE_DEEPINFER_NO_MEMORY_OVER="100")
    big = "lorem ipsum dolor sit amet " * 40
    body = {"model": MODEL, "messages": [{"role": "user", "content": big}], "max_tokens": 5, **NO_THINK}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "insufficient_system_resource"
    assert httpx.get(f"{srv.url}/health").status_code == 200  # the server is fine; that request was too big now
    r = chat(srv.client(timeout=30), "short", max_tokens=5, extra={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert re.search(r'deepinfer_aborted_requests_total\{[^}]*reason="insufficient_system_resource"\} 1', metrics)
    stop_cleanly(srv)


def failed_start(checkpoint: Path, *args: str, **env: str) -> str:
    """Run a server expected to fail start-up; returns its output (start_server leaks its pipe on failure)."""
    cmd = [
        sys.executable,
        "-m",
        "deepinfer_server",
        "--port",
        "0",
        "--engine",
        "fake-deepinfer",
        *args,
        str(checkpoint),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **fake_env(**env)})
    assert proc.returncode == 1, proc
    return proc.stdout + proc.stderr


def test_rendezvous_port_in_use_fails_start_up_naming_master_port(deepinfer_server, checkpoint) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        busy = s.getsockname()[1]
        out = failed_start(checkpoint, "--dp", "2", MASTER_PORT=str(busy + 50))
    assert f"MASTER_PORT - 50 + engine_group_rank = {busy + 50} - 50 + 0 = {busy} is already in use" in out, out


def test_gpu_uuids_are_rejected(deepinfer_server, checkpoint) -> None:
    out = failed_start(checkpoint, "--dp", "1", CUDA_VISIBLE_DEVICES="GPU-1234")
    assert "integer GPU ids" in out, out


# -- adapter unit tests, in process ---------------------------------------------------------------------------------


@pytest.fixture
def fake_modules() -> Iterator[None]:
    saved_env = dict(os.environ)
    sys.path.insert(0, str(FAKE))
    try:
        yield
    finally:
        sys.path.remove(str(FAKE))
        for name in [m for m in sys.modules if m.split(".")[0] in ("torch", "deepinfer")]:
            del sys.modules[name]
        os.environ.clear()
        os.environ.update(saved_env)


def build_engine(checkpoint: Path, **env: str):
    from deepinfer_server.engine.deepinfer_build import build

    os.environ.update({"CUDA_VISIBLE_DEVICES": "3", "MASTER_PORT": "29500", **env})
    cfg = {
        "model": str(checkpoint),
        "trust_remote_code": False,
        "expert_parallel_size": 1,
        "data_parallel_size": 1,
        "context_parallel_size": 1,
        "engine_rank": 0,
        "max_model_len": 256,
        "max_num_seqs": 4,
        "max_num_batched_tokens": 256,
        "gpu_memory_utilization": 0.9,
    }
    return build(cfg)


def run_until_idle(e, limit: int = 2000) -> dict[int, tuple[list[int], int, str | None]]:
    done: dict[int, tuple[list[int], int, str | None]] = {}
    flushed = True
    for _ in range(limit):
        busy, _, _ = e.sync(e.has_work(), False)
        if busy:
            out, flushed = output_rows(e.step()), False
        elif not flushed:
            out, flushed = output_rows(e.flush()), True
        else:
            return done
        for o in out:
            rid = o.request_id
            prev = done.get(rid, ([], 0, None))[0]
            assert done.get(rid, ([], 0, None))[1] == 0, f"output after finish for {rid}"
            done[rid] = (prev + o.tokens, o.finish, o.reason)
    raise AssertionError("engine did not go idle")


def sub(rid: int, prompt: list[int], max_tokens: int = 16, ignore_eos: bool = False, seed: int | None = 1):
    from deepinfer_server.engine.base import Submit

    return Submit(rid, prompt, max_tokens, 1.0, 1.0, -1, seed, ignore_eos)


def test_adapter_finish_codes_clamping_and_rejections(fake_modules, checkpoint) -> None:
    from deepinfer_server import _native

    e = build_engine(checkpoint, DEEPINFER_USE_NEXTN_DECODE="5")
    assert os.environ["DEEPINFER_PREFILL_ATTEMPT_INTERVAL"] == "1"
    assert os.environ["DEEPINFER_USE_NEXTN_DECODE"] == "5"  # the environment wins over the serving default
    failed = _native.Output(request_id=1, tokens=[], finish=_native.FINISH_ERROR, reason="empty prompt")
    assert e.add(sub(1, [])) == [failed]
    assert e.add(sub(2, [0, 10**6]))[0].finish == _native.FINISH_ERROR  # add_request returned None
    assert e.add(sub(3, [0, -1]))[0].finish == _native.FINISH_ERROR
    assert e.add(sub(4, [0, 5, 6], max_tokens=10**9, ignore_eos=True)) == []  # clamped to the context
    assert e.add(sub(5, [0, 5, 6], max_tokens=40)) == []
    assert e.add(sub(6, [7] * 250, max_tokens=3, ignore_eos=True)) == []
    done = run_until_idle(e)
    assert len(done[4][0]) == 256 - 3 and done[4][1] == _native.FINISH_LENGTH
    toks, fin, _ = done[5]
    assert (fin == _native.FINISH_STOP and toks[-1] == 1) or (fin == _native.FINISH_LENGTH and len(toks) == 40)
    assert len(done[6][0]) == 3
    assert not e.live
    e.close()


def test_adapter_maps_logprobs_and_so_args(fake_modules, checkpoint) -> None:
    """token_logprobs, top_token_ids and top_logprobs become the ring's logprobs, for the requests that asked only;
    so_args reach SamplingParams as they are."""
    from deepinfer_server.engine.base import Submit

    e = build_engine(checkpoint)
    made: list[object] = []
    real_sp = e._sp
    e._sp = lambda **kw: made.append(real_sp(**kw)) or made[-1]
    so = {"schema_type": "json", "schema": '{"type":"object"}', "trigger_token_ids": [5], "bound_token_id": 1}
    assert e.add(Submit(1, [0, 5, 6], 6, 1.0, 1.0, -1, 1, True, 3, so)) == []
    assert e.add(Submit(2, [0, 5, 6], 6, 1.0, 1.0, -1, 1, True)) == []
    assert (made[0].so_args, made[0].top_logprobs, made[1].so_args, made[1].top_logprobs) == (so, 3, None, 0)
    rows: dict[int, list[object]] = {1: [], 2: []}
    for _ in range(50):
        busy, _, _ = e.sync(e.has_work(), False)
        out = output_rows(e.step() if busy else e.flush())
        for o in out:
            toks, lp = o.tokens, o.logprobs
            if o.request_id == 1:
                assert lp is not None and len(lp) == len(toks)
                for tok, (value, alts) in zip(toks, lp, strict=True):
                    assert len(alts) == 3 and alts[0] == (tok, value) and value <= 0
                rows[1] += lp
            else:
                assert lp is None  # no logprobs asked for: none carried
                rows[2] += toks
        if not busy and not e.has_work():
            break
    assert len(rows[1]) == 6 and len(rows[2]) == 6
    e.close()


def test_adapter_returns_the_prompt_logprobs_once(fake_modules, checkpoint) -> None:
    """SamplingParams(prompt_logprobs=True) for the request that asks only; the engine's values (one per prompt token
    after the first, on the request's first output) ride on its first row alone. Under YoCo prefill truncation,
    where the engine would silently drop them, such a request is refused and others run."""
    from deepinfer_server import _native
    from deepinfer_server.engine.base import Submit

    e = build_engine(checkpoint)
    made: list[object] = []
    real_sp = e._sp
    e._sp = lambda **kw: made.append(real_sp(**kw)) or made[-1]
    prompt = [0, 5, 6, 9, 13]
    assert e.add(Submit(1, prompt, 3, 1.0, 1.0, -1, 1, True, None, None, None, True)) == []
    assert e.add(Submit(2, prompt, 3, 1.0, 1.0, -1, 1, True)) == []
    assert [sp.prompt_logprobs for sp in made] == [True, False]
    seen: list[tuple[int, list[float]]] = []
    for _ in range(50):
        busy, _, _ = e.sync(e.has_work(), False)
        for row in output_rows(e.step() if busy else e.flush()):
            if row.prompt_logprobs is not None:
                seen.append((row.request_id, row.prompt_logprobs))
        if not busy and not e.has_work():
            break
    assert seen == [(1, [-0.25 * (1 + t % 7) for t in prompt[1:]])]
    e.close()
    try:
        e = build_engine(checkpoint, DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE="mask")
        refused = e.add(Submit(3, prompt, 3, 1.0, 1.0, -1, 1, True, None, None, None, True))
        assert refused == [
            _native.Output(request_id=3, tokens=[], finish=_native.FINISH_ERROR, reason="prompt_logprobs_unavailable")
        ]
        assert e.add(sub(4, prompt, max_tokens=3, ignore_eos=True)) == []
        assert len(run_until_idle(e)[4][0]) == 3
        e.close()
    finally:
        os.environ.pop("DEEPINFER_YOCO_PREFILL_TRUNCATION_MODE", None)


def test_adapter_drops_and_re_aborts_lost_aborts(fake_modules, checkpoint) -> None:
    e = build_engine(checkpoint, FAKE_DEEPINFER_ADMISSION_STEPS="3", DEEPINFER_USE_NEXTN_DECODE="2")
    e.add(sub(1, [0, 5, 6], max_tokens=100, ignore_eos=True))
    e.add(sub(2, [0, 5, 7], max_tokens=20, ignore_eos=True))
    e.sync(True, False)
    e.step()
    e.abort([1])  # still being admitted: the engine loses this abort
    assert e.engine.lost_aborts == 1
    done = run_until_idle(e)
    assert 1 not in done and len(done[2][0]) == 20
    assert e.re_aborts == 1 and e.engine.reaborted == 1
    # abort of a running request: nothing more is published for it
    e.add(sub(3, [0, 9], max_tokens=100, ignore_eos=True))
    for _ in range(6):
        e.step()
    e.abort([3])
    assert 3 not in run_until_idle(e)
    e.close()


def test_prompt_length_exceeded_is_an_error_without_token(fake_modules, checkpoint) -> None:
    from deepinfer_server import _native

    e = build_engine(checkpoint, FAKE_DEEPINFER_KV_TOKENS="50")
    e.add(sub(1, [5] * 60))
    e.add(sub(2, [5] * 10, max_tokens=4, ignore_eos=True))
    done = run_until_idle(e)
    assert done[1] == ([], _native.FINISH_ERROR, "prompt_length_exceeded")
    assert len(done[2][0]) == 4
    e.close()


def test_failed_step_marks_the_group_broken_and_close_skips_the_collective(fake_modules, checkpoint) -> None:
    e = build_engine(checkpoint)
    e.add(sub(1, [5] * 10, max_tokens=4, ignore_eos=True))

    def lost_peer() -> None:
        raise RuntimeError("NCCL: peer rank 1 is gone")

    e.engine.step = lost_peer
    with pytest.raises(RuntimeError, match="peer rank 1"):
        e.step()
    assert e.broken
    collective_close = []
    e.engine.close = lambda: collective_close.append(1)
    e.close()
    assert collective_close == [] and e.engine.closed


def test_launcher_helpers_pick_and_check_ports() -> None:
    from deepinfer_server.engine.deepinfer_config import ConfigError, dist_env_for_ranks

    envs = dist_env_for_ranks(2, 2, 8000, {"CUDA_VISIBLE_DEVICES": "4,5,6,7"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert envs[0]["MASTER_PORT"] == envs[1]["MASTER_PORT"]
    assert envs[0]["DEEPINFER_USE_NEXTN_DECODE"] == "0"
    env = dist_env_for_ranks(1, 1, 8000, {"MASTER_PORT": "29650", "DEEPINFER_USE_NEXTN_DECODE": "4"})[0]
    assert env["MASTER_PORT"] == "29650" and env["CUDA_VISIBLE_DEVICES"] == "0"
    assert env["DEEPINFER_USE_NEXTN_DECODE"] == "4"
    with pytest.raises(ConfigError, match="HTTP --port"):
        dist_env_for_ranks(1, 1, 29600, {"MASTER_PORT": "29650"})
    with pytest.raises(ConfigError, match="lists 2 GPU"):
        dist_env_for_ranks(3, 1, 8000, {"CUDA_VISIBLE_DEVICES": "0,1"})


# -- failures: nothing hangs, nothing is left behind -----------------------------------------------------------------


def test_add_request_exception_fails_that_request_only(deepinfer_server) -> None:
    # The fake's add_request raises RuntimeError for prompts over 100 tokens (not a ValueError/TypeError).
    srv = deepinfer_server("--dp", "2", FAKE_DEEPINFER_ADD_RAISES_OVER="100")
    client = srv.client(timeout=30)
    big = "lorem ipsum dolor sit amet " * 40
    with pytest.raises(openai.InternalServerError, match="refused the request"):
        chat(client, big, max_tokens=5)
    with pytest.raises(openai.APIError, match="refused the request"):
        stream_text(client, content=big, max_tokens=5)
    for i in range(6):  # both ranks still serve, in lockstep
        r = chat(client, f"short {i}", max_tokens=5, extra={"ignore_eos": True})
        assert r.usage.completion_tokens == 5
    assert httpx.get(f"{srv.url}/health").status_code == 200
    log = stop_cleanly(srv)
    assert len(re.findall(r"rank \d closed: .*lockstep=ok", log)) == 2, log


def test_error_outside_step_exits_the_rank_at_once_without_a_collective(deepinfer_server) -> None:
    # The fake's abort_request raises: a stop sequence makes the server abort, the rank's loop fails outside
    # step/sync. It must exit at once, not enter the collective close() while its peer waits in an all-reduce.
    srv = deepinfer_server("--dp", "2", "--exit-on-rank-failure", "1", FAKE_DEEPINFER_ABORT_RAISES="1")
    ranks = srv.rank_pids()
    # ignore_eos: the engine must still be generating when the stop string matches, or no abort is sent (an answer
    # that ended by itself within one batch used to make this test wait for a failure that never came).
    client = srv.client(timeout=30)
    text, finish, _ = stream_text(client, content="x", stop=["e"], max_tokens=2000, extra={"ignore_eos": True})
    assert finish == "stop" and "e" not in text
    assert srv.proc.wait(timeout=20) == 1, srv.log()
    log = srv.log()
    assert "exiting without closing the engine" in log, log
    assert "lockstep violation" not in log and "closed: steps=" not in log, log
    assert not wait_until_gone(srv.proc.pid, set(ranks))


def cp_server(deepinfer_server, *args: str, **env: str):
    """DP 2 x CP 2: each rank spawns a CP worker and forks a VE worker, as the real engine does."""
    srv = deepinfer_server("--ep", "4", "--dp", "2", "--cp", "2", *args, **env)
    ranks = set(srv.rank_pids())
    assert len(ranks) == 2
    r = chat(srv.client(timeout=30), "hello", max_tokens=5, extra={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    members = group_members(ranks)
    workers = [pid for pid in members if pid not in ranks]
    # Per rank, in its process group: the CP worker, the VE worker, and multiprocessing's resource tracker
    # (started with the first "spawn" process, as in the real engine).
    assert len(workers) == 6, members
    return srv, ranks, workers


def test_sigterm_with_stopped_workers_leaves_nothing(deepinfer_server) -> None:
    srv, ranks, workers = cp_server(deepinfer_server, "--rank-shutdown-timeout", "2")
    for pid in workers:  # they can neither answer close() nor act on a SIGTERM
        os.kill(pid, signal.SIGSTOP)
    srv.proc.send_signal(signal.SIGTERM)
    assert srv.proc.wait(timeout=30) == 0, srv.log()
    assert not wait_until_gone(srv.proc.pid, ranks)
    assert "did not stop within --rank-shutdown-timeout" in srv.log()
    assert not {s for s in shm_segments() if f"-{srv.proc.pid}-" in s}


def test_sigkill_of_one_rank_leaves_nothing(deepinfer_server) -> None:
    # The surviving rank would hang in its next collective with the dead one: it is killed at once.
    srv, ranks, workers = cp_server(deepinfer_server, "--exit-on-rank-failure", "1")
    os.kill(workers[0], signal.SIGSTOP)
    os.kill(min(ranks), signal.SIGKILL)
    assert srv.proc.wait(timeout=30) == 1, srv.log()
    left = wait_until_gone(srv.proc.pid, ranks)
    assert not left, left


def test_sigkill_of_the_server_leaves_nothing(deepinfer_server) -> None:
    srv, ranks, workers = cp_server(deepinfer_server)
    for pid in workers[:2]:
        os.kill(pid, signal.SIGSTOP)
    srv.proc.kill()
    srv.proc.wait()
    left = wait_until_gone(srv.proc.pid, ranks)
    assert not left, left
    assert not {s for s in shm_segments() if f"-{srv.proc.pid}-" in s}


def test_ep8_is_one_dp_rank_with_seven_cp_workers_and_serves_chat(deepinfer_server) -> None:
    srv = deepinfer_server("--ep", "8", "--max-num-seqs", "4", "--max-model-len", "4096")
    (rank,) = srv.rank_pids()
    members = group_members({rank})
    children = [pid for pid, (_, ppid, _) in members.items() if ppid == rank]
    assert len(children) == 7 + 1 + 1, members  # CP workers 1..7, the VE worker, the resource tracker
    text, finish, n = stream_text(srv.client(timeout=30), content="hello", max_tokens=20)
    assert text and finish in ("stop", "length") and n
    log = stop_cleanly(srv)
    assert re.search(r"rank 0: CP workers \[(\d+, ){6}\d+\]", log), log
    # The workers are global ranks 1..7 of a world of 8, and ran every step's collective with their driver.
    (driver_steps,) = re.findall(r"rank 0 closed: steps=(\d+)", log)
    workers = re.findall(r"cp worker (\d)/8 closed: steps=(\d+)", log)
    assert sorted(w for w, _ in workers) == [str(i) for i in range(1, 8)], log
    assert {s for _, s in workers} == {driver_steps}, log
    assert not group_members({rank})


def test_stopped_peer_in_a_collective_trips_the_watchdog(deepinfer_server) -> None:
    # DP 2 x CP 2. Rank 1 is stopped: rank 0, which has the stream, waits for it in the step's collective
    # forever (the fake's TCP star blocks, as NCCL does). The watchdog ends it; nothing is left behind.
    srv = deepinfer_server(
        "--ep", "4", "--dp", "2", "--cp", "2", "--watchdog-timeout", "2", "--exit-on-rank-failure", "1",
        FAKE_DEEPINFER_STEP_MS="10",
    )  # fmt: skip
    ranks = srv.rank_pids()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hang"}], "max_tokens": 3000, "stream": True}
    bg = BackgroundStream.start(srv.url, {**body, "ignore_eos": True, **NO_THINK})
    events = bg.events
    assert bg.first.wait(20)
    os.kill(max(ranks), signal.SIGSTOP)  # the later rank: the stream went to the least loaded, rank 0
    assert bg.ended.wait(15), "the stream hung"
    assert events[-1] == "[DONE]" and "stopped responding" in events[-2], events[-3:]
    assert srv.proc.wait(timeout=15) == 1
    assert not wait_until_gone(srv.proc.pid, set(ranks))
    log = srv.log()
    assert re.search(
        r"watchdog: rank 0 has had 1 request\(s\) and no heartbeat for [\d.]+ s, in phase (step|sync)", log
    )
    assert re.search(r"watchdog: rank 1 phase \S+", log), log


def test_a_config_that_can_overrun_the_output_pool_is_refused_at_start_up(deepinfer_server, checkpoint) -> None:
    out = failed_start(checkpoint, "--max-num-seqs", "800", DEEPINFER_USE_NEXTN_DECODE="5")
    assert "--max-num-seqs 800 with DEEPINFER_USE_NEXTN_DECODE=5" in out, out
    assert "= 10400 RequestOutputs" in out and "fixed pool of 10000" in out, out
    assert "use --max-num-seqs <= 769 or DEEPINFER_USE_NEXTN_DECODE <= 4" in out, out
    assert "started rank" not in out  # refused before any rank starts


@pytest.mark.parametrize(("max_num_seqs", "overruns"), [(769, False), (840, True)])
def test_the_fake_output_pool_fails_as_the_engine_does_past_the_bound(
    fake_modules, checkpoint, max_num_seqs: int, overruns: bool
) -> None:
    """With every draft token accepted, two decode steps in a row hold 2 x S x (1 + nextn) outputs at once."""
    from deepinfer_server.engine.deepinfer_build import build
    from deepinfer_server.engine.deepinfer_config import OUTPUT_POOL_SIZE, live_outputs_bound

    os.environ.update({"CUDA_VISIBLE_DEVICES": "0", "MASTER_PORT": "29500", "DEEPINFER_USE_NEXTN_DECODE": "5"})
    os.environ["FAKE_DEEPINFER_ACCEPT_ALL"] = "1"
    cfg = {
        "model": str(checkpoint), "trust_remote_code": False, "expert_parallel_size": 1, "data_parallel_size": 1,
        "context_parallel_size": 1, "engine_rank": 0, "max_model_len": 512, "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": 8192, "gpu_memory_utilization": 0.9,
    }  # fmt: skip
    e = build(cfg)
    assert (live_outputs_bound(max_num_seqs, 5) > OUTPUT_POOL_SIZE) == overruns
    for rid in range(max_num_seqs):
        assert e.add(sub(rid, [0, 5, 6 + rid % 7], max_tokens=60, ignore_eos=True)) == []
    if overruns:
        with pytest.raises(RuntimeError, match="RequestOutputPool exhausted"):
            run_until_idle(e)
        assert e.broken
        e.close()  # skips the collective close(), and keeps the engine's __del__ from running it
        assert e.engine.closed
        return
    done = run_until_idle(e)
    assert len(done) == max_num_seqs and all(len(t) == 60 for t, _, _ in done.values())
    e.close()


def test_a_dead_peer_during_a_collective_ends_in_a_clean_exit(deepinfer_server) -> None:
    # DP 2: rank 0 streams (a collective every step), rank 1 is SIGKILLed. Rank 0 then hangs in the step's
    # collective, as with NCCL; the server fails the stream, exits 1, and kills rank 0's group after the grace.
    # No short --rank-shutdown-timeout: the survivor cannot close, and is not given the default 30 s to try.
    srv = deepinfer_server("--dp", "2", "--exit-on-rank-failure", "1", FAKE_DEEPINFER_STEP_MS="10")
    ranks = srv.rank_pids()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "dead peer"}], "max_tokens": 3000, "stream": True}
    bg = BackgroundStream.start(srv.url, {**body, "ignore_eos": True, **NO_THINK})
    events = bg.events
    assert bg.first.wait(20)
    os.kill(max(ranks), signal.SIGKILL)
    assert bg.ended.wait(15), "the stream hung"
    assert events[-1] == "[DONE]" and '"error"' in events[-2], events[-3:]
    killed = time.monotonic()
    assert srv.proc.wait(timeout=20) == 1, srv.log()
    assert time.monotonic() - killed < 8
    assert not wait_until_gone(srv.proc.pid, set(ranks))
    log = srv.log()
    assert "the collective hangs" in log and "without waiting for their collective close()" in log, log


def test_multi_modal_data_costs_a_ve_round_trip_and_a_step_so_text_passes_none(fake_modules, checkpoint) -> None:
    import numpy as np

    e = build_engine(checkpoint)
    eng = e.engine

    def steps_to_first_token(rid: str, mm: dict[str, list[object]] | None) -> int:
        ids = np.asarray([0, 5, 6], dtype=np.int32)
        eng.add_request(user_id="u", request_id=rid, sampling_params={"max_tokens": 2}, prompt_token_ids=ids,
                        multi_modal_data=mm)  # fmt: skip
        for n in range(1, 50):
            if any(e._ro.get_request_id(p) == rid for p in eng.step()):
                return n
            time.sleep(0.01)  # the VE worker is another process
        raise AssertionError("no first token")

    assert steps_to_first_token("a", None) == 1
    assert steps_to_first_token("b", {"image_bytes": [], "image_sizes": []}) >= 2
    assert eng.ve_round_trips == 1
    e.add(sub(3, [0, 5, 7], max_tokens=3))  # the adapter: no multi_modal_data for text
    run_until_idle(e)
    assert eng.ve_round_trips == 1
    e.close()


def lone_request_ttft(srv: Server) -> float:
    """While rank 0 decodes a long stream, rank 1 gets one request: how long until its first token."""
    started = threading.Event()

    def long_stream() -> None:
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": "long"}], "max_tokens": 400,
            "stream": True, "ignore_eos": True, **NO_THINK,
        }  # fmt: skip
        with httpx.Client(base_url=srv.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            for line in r.iter_lines():
                if sse_has_text(line):
                    started.set()

    t = threading.Thread(target=long_stream, daemon=True)
    t.start()
    assert started.wait(20)
    t0 = time.monotonic()
    for _ in stream_text(srv.client(timeout=30), content="lone", max_tokens=1):
        break
    ttft = time.monotonic() - t0
    t.join(30)
    return ttft


def test_prefill_votes_at_the_configured_intervals_delay_a_lone_request(deepinfer_server) -> None:
    # The engine's own defaults (70/100): rank 1's prompt waits for the next ANY point, 100 decode steps (10 ms
    # each) after the stream's prefill. The serving defaults (1/1) vote every step.
    slow = deepinfer_server(
        "--dp", "2", FAKE_DEEPINFER_STEP_MS="10",
        DEEPINFER_PREFILL_ATTEMPT_INTERVAL="70", DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL="100",
    )  # fmt: skip
    waited = lone_request_ttft(slow)
    log = stop_cleanly(slow)
    # The flags win over the environment.
    fast = deepinfer_server(
        "--dp", "2", "--prefill-attempt-interval", "1", "--prefill-any-attempt-interval", "1",
        FAKE_DEEPINFER_STEP_MS="10", DEEPINFER_PREFILL_ANY_ATTEMPT_INTERVAL="100",
    )  # fmt: skip
    quick = lone_request_ttft(fast)
    fast_log = stop_cleanly(fast)
    assert waited > 0.6 and quick < 0.3, (waited, quick)
    votes = [int(v) for v in re.findall(r"votes=(\d+)", log)]
    steps = [int(v) for v in re.findall(r"closed: steps=(\d+)", log)]
    assert len(set(votes)) == 1 and votes[0] < steps[0] / 10, (votes, steps)  # a vote every ~70-100 steps
    assert log.count("prefill_intervals=70/100") == 2 and fast_log.count("prefill_intervals=1/1") == 2
    fast_votes = [int(v) for v in re.findall(r"votes=(\d+)", fast_log)]
    fast_steps = [int(v) for v in re.findall(r"closed: steps=(\d+)", fast_log)]
    assert fast_votes[0] >= fast_steps[0] - 2, (fast_votes, fast_steps)  # one (or two) a step
    assert any(int(p) > 0 for p in re.findall(r"placeholder_steps=(\d+)", log))  # the idle rank rode along


def test_preempted_requests_are_recomputed_whole_and_counted_in_the_metrics(deepinfer_server) -> None:
    srv = deepinfer_server("--dp", "2", FAKE_DEEPINFER_PREEMPT_EVERY="7")
    client = srv.client(timeout=30)
    results: list[int] = []

    def one(i: int) -> None:
        r = chat(client, f"preempt {i}", max_tokens=60, extra={"ignore_eos": True})
        results.append(r.usage.completion_tokens)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [60] * 8  # a recomputed request loses and repeats no token
    metric = re.search(r"^vllm:num_preemptions_total\{[^}]*\} (\d+)", httpx.get(f"{srv.url}/metrics").text, re.M)
    log = stop_cleanly(srv)
    engine = sum(int(n) for n in re.findall(r"preempted=(\d+)", log))
    assert metric and engine > 0 and int(metric.group(1)) == engine, (metric, engine)


def test_the_adapter_sends_its_first_token_times(deepinfer_server) -> None:
    # The TTFT breakdown's rank stages come from the adapter (taken, the step launched before the call that
    # returned the first token under async scheduling, published): none falls back to the whole-engine stage.
    srv = deepinfer_server("--dp", "2", FAKE_DEEPINFER_STEP_MS="10")
    for i in range(2):
        text, _, _ = stream_text(srv.client(timeout=30), content=f"time it {i}", max_tokens=4)
        assert text
    metrics = httpx.get(f"{srv.url}/metrics").text
    count = dict(re.findall(r'^deepinfer_ttft_stage_seconds_count\{stage="(\w+)"\} (\S+)$', metrics, re.M))
    assert count["prefill"] == count["ring"] == count["sse"] == "2" and count["engine"] == "0", count
    total = dict(re.findall(r'^deepinfer_ttft_stage_seconds_sum\{stage="(\w+)"\} (\S+)$', metrics, re.M))
    assert float(total["prefill"]) >= 2 * 0.010, total  # at least the fake's 10 ms step each
    stop_cleanly(srv)


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": SCHEMA}}


def logged_so_args(srv: Server) -> list[dict[str, object]]:
    return [
        json.loads(ln.split(" ", 3)[3]) for ln in srv.log().splitlines() if ln.startswith("fake-deepinfer so_args ")
    ]


def test_constraints_reach_the_engine_as_so_args(deepinfer_server) -> None:
    """What DeepInfer receives: the schema, the trigger `</think>` with thinking on, none with thinking off; a
    forced tool call as an EBNF grammar."""
    srv = deepinfer_server()
    think_end = json.loads((BUNDLED / "tokenizer.json").read_text())["added_tokens"]
    think_end_id = next(t["id"] for t in think_end if t["content"] == "</think>")
    base = {"model": MODEL, "messages": [{"role": "user", "content": "json please"}], "max_tokens": 5}
    for thinking in ("enabled", "disabled"):
        body = {**base, "response_format": RESPONSE_FORMAT, "thinking": {"type": thinking}}
        assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    body = {**base, "tools": [tool], "tool_choice": "required", "thinking": {"type": "disabled"}}
    assert httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30).status_code == 200
    wait_for("the engine's three so_args lines", lambda: len(logged_so_args(srv)) >= 3)  # the log pump is async
    on, off, forced = logged_so_args(srv)[-3:]
    assert on["schema_type"] == off["schema_type"] == "json" and json.loads(str(on["schema"])) == SCHEMA
    assert on["trigger_token_ids"] == [think_end_id] and "trigger_token_ids" not in off
    assert forced["schema_type"] == "ebnf" and 'invoke name=\\"f\\"' in str(forced["schema"])
    assert "bound_token_id" not in on
    stop_cleanly(srv)


def test_a_grammar_the_engine_fails_ends_the_request_and_frees_its_slot(deepinfer_server) -> None:
    """DeepInfer's "xgrammar runtime errors or timeout" finish: a 400 invalid_grammar (an error event on a
    stream), and the slot is free again (--max-num-seqs 1: the next request runs)."""
    srv = deepinfer_server("--max-num-seqs", "1", FAKE_DEEPINFER_GRAMMAR_FAILS="1")
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "json please"}],
        "max_tokens": 5,
        "response_format": RESPONSE_FORMAT,
        **NO_THINK,
    }
    for _ in range(3):
        r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_grammar", r.text
        assert "xgrammar" in r.json()["error"]["message"]
    with httpx.stream("POST", f"{srv.url}/v1/chat/completions", json={**body, "stream": True}, timeout=30) as s:
        text = s.read().decode()
    assert s.status_code == 200 and "invalid_grammar" in text and text.rstrip().endswith("[DONE]")
    r = chat(srv.client(timeout=30), "plain", max_tokens=5, extra={"ignore_eos": True})
    assert r.usage.completion_tokens == 5, "the failed requests left their slot"
    metrics = httpx.get(f"{srv.url}/metrics").text
    assert re.search(r'deepinfer_aborted_requests_total\{[^}]*reason="grammar_error"\} 4', metrics), metrics
    stop_cleanly(srv)


def logged_images(srv: Server) -> list[dict[str, str]]:
    """The fake engine's `multi_modal_data` lines: what add_request received, per request."""
    out = []
    for line in srv.lines:
        if "fake-deepinfer multi_modal_data " in line:
            fields = line.split("multi_modal_data ", 1)[1].split()
            out.append({"rid": fields[0], **dict(f.split("=", 1) for f in fields[1:])})
    return out


@pytest.mark.parametrize("engine_image_id", [None, 128000])
def test_images_reach_deepinfer_as_its_multi_modal_data(deepinfer_server, engine_image_id: int | None) -> None:
    """What DeepInfer receives for a request with images: `image_bytes` (deepseek-recipe's preprocessed WebP) and
    `image_sizes` in placeholder order, the placeholders at the engine's own image token (config.json's, here
    different from the serving tokenizer's <｜image｜> in the second case), and an expanded prompt exactly as long
    as the prompt_tokens the client is billed."""
    from test_images import data_url, expected, picture

    env = {} if engine_image_id is None else {"FAKE_DEEPINFER_IMAGE_TOKEN_ID": str(engine_image_id)}
    srv = deepinfer_server(**env)
    a, b = picture(300, 200), picture(640, 640, "JPEG")
    parts = [
        {"type": "text", "text": "two pictures"},
        {"type": "image_url", "image_url": {"url": data_url(a), "detail": "high"}},
        {"type": "image_url", "image_url": {"url": data_url(b, "image/jpeg"), "detail": "low"}},
    ]
    r = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": parts}],
        max_tokens=5,
        extra_body=NO_THINK,  # type: ignore[list-item]
    )
    assert r.usage is not None
    wait_for("the engine's multi_modal_data line", lambda: len(logged_images(srv)) >= 1)
    got = logged_images(srv)[-1]
    want = expected((a, "high"), (b, "low"))  # "WxH/bytes/sha16" each
    assert json.loads(got["sizes"]) == [[int(x) for x in w.split("/")[0].split("x")] for w in want]
    assert got["sha"].split(",") == [w.split("/")[2] for w in want]
    assert got["placeholders"] == "2"  # found at the engine's image token, whichever ID that is
    assert int(got["expanded_len"]) == r.usage.prompt_tokens
    stop_cleanly(srv)
