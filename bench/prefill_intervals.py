#!/usr/bin/env python3
"""DeepInfer's prefill-vote interval against TTFT and ITL, on the sim (default) or on the fake engine.

DeepInfer's scheduler admits new prompts only at vote points: every `--prefill-attempt-interval` decode steps all
DP ranks must want a prefill, every `--prefill-any-attempt-interval` one is enough, and each vote is an all-reduce
over the DP group. `--engine sim` runs the sim on the replay's calibrated 8 x B200 cost model (`--sim-lockstep`,
8.5 ms + 0.1 ms per sequence, 25 ms per 1k prefill tokens overlapped in 340-token chunks) with the vote modelled
(`--sim-prefill-vote-ms`). `--engine fake` runs `--engine fake-deepinfer` (DeepInfer's adapter on
tests/fake_deepinfer), whose NORMAL scheduler makes each step all prefill or all decode (`--step-ms` each) and
holds the votes with a cost (`FAKE_DEEPINFER_VOTE_MS`).

    python bench/prefill_intervals.py [--engine sim|fake] [--intervals 1,4,16] [--concurrency 16,64]
                                      [--requests 192] [--json-out F]

For each interval N (both flags = N) and concurrency, one server (DP 2, 32 seqs/rank) and one loadgen run
(256-token prompts, 128 output tokens, ignore_eos, a warm-up round first). Prints a Markdown table and JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "python" / "deepinfer_server" / "tokenizer"
MODEL = "deepseek-v4.1-flash"
LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


def checkpoint(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (root / name).write_bytes((BUNDLED / name).read_bytes())
    (root / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "vocab_size": 129280}))
    return root


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


CALIBRATED_SIM = [
    "--sim-decode-step-ms", "8.5", "--sim-decode-ms-per-seq", "0.1", "--sim-prefill-ms-per-1k-tokens", "25",
    "--sim-overlap-prefill", "--sim-prefill-chunk-tokens", "340", "--sim-lockstep",
]  # fmt: skip


def start(engine: str, ckpt: Path, interval: int, step_ms: float, vote_ms: float) -> tuple[subprocess.Popen[str], str]:
    common = [
        sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", str(free_port()),
        "--served-model-name", MODEL, "--dp", "2", "--max-num-seqs", "32", "--max-model-len", "4096",
        "--prefill-attempt-interval", str(interval), "--prefill-any-attempt-interval", str(interval),
    ]  # fmt: skip
    if engine == "sim":
        return launch([*common, *CALIBRATED_SIM, "--sim-prefill-vote-ms", str(vote_ms)], dict(os.environ))
    env = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "0,1",
        "DEEPINFER_USE_NEXTN_DECODE": "0",
        "FAKE_DEEPINFER_STEP_MS": str(step_ms),
        "FAKE_DEEPINFER_VOTE_MS": str(vote_ms),
    }
    return launch([*common, "--engine", "fake-deepinfer", str(ckpt)], env)


def launch(cmd: list[str], env: dict[str, str]) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    found: list[str] = []
    ready = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            m = LISTENING.search(line)
            if m and not found:
                found.append(f"http://{m.group(1)}:{m.group(2)}")
                ready.set()

    threading.Thread(target=pump, daemon=True).start()
    if not ready.wait(120):
        proc.kill()
        raise RuntimeError("server did not start")
    return proc, found[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", choices=("sim", "fake"), default="sim")
    ap.add_argument("--intervals", default="1,4,16")
    ap.add_argument("--concurrency", default="16,64")
    ap.add_argument("--requests", type=int, default=192)
    ap.add_argument("--step-ms", type=float, default=9.0, help="fake: a DeepInfer step on 8 x B200 (BENCHMARKS.md)")
    ap.add_argument("--vote-ms", type=float, default=0.3, help="one gloo all-reduce over the DP group")
    ap.add_argument("--bench-dir", type=Path, default=ROOT.parent / "shared" / "bench")
    ap.add_argument("--json-out", type=Path)
    a = ap.parse_args()
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = checkpoint(Path(tmp) / "ckpt")
        for interval in map(int, a.intervals.split(",")):
            for conc in map(int, a.concurrency.split(",")):
                proc, url = start(a.engine, ckpt, interval, a.step_ms, a.vote_ms)
                try:
                    cmd = [
                        sys.executable, str(a.bench_dir / "loadgen.py"), "--base-url", url, "--model", MODEL,
                        "--tokenizer", str(BUNDLED / "tokenizer.json"), "--concurrency", str(conc),
                        "--requests", str(a.requests), "--warmup", str(conc), "--prompt-tokens", "256",
                        "--max-tokens", "128", "--ignore-eos",
                    ]  # fmt: skip
                    run = subprocess.run(cmd, capture_output=True, text=True)
                    if run.returncode:
                        raise RuntimeError(f"loadgen failed: {run.stdout[-2000:]}{run.stderr[-2000:]}")
                    res = json.loads(run.stdout.strip().splitlines()[-1])
                finally:
                    proc.terminate()
                    proc.wait(60)
                row = {"interval": interval, "concurrency": conc, "ttft_ms": res["ttft_ms"], "itl_ms": res["itl_ms"]}
                row["tokens_per_s"] = res.get("output_tokens_per_s") or res.get("completion_tokens_per_s")
                results.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    print("| interval | streams | TTFT p50 ms | TTFT p99 ms | ITL mean ms | ITL p95 ms | output tok/s |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        t, i = r["ttft_ms"], r["itl_ms"]
        print(
            f"| {r['interval']} | {r['concurrency']} | {t['p50']} | {t['p99']} | {i['mean']} | {i['p95']} | "
            f"{r['tokens_per_s']} |"
        )
    doc = {"engine": a.engine, "step_ms": a.step_ms, "vote_ms": a.vote_ms, "requests": a.requests, "results": results}
    print(json.dumps(doc))
    if a.json_out:
        a.json_out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
