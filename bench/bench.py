#!/usr/bin/env python3
"""Side-by-side benchmark: DeepInfer-server vs the pure-Python FastAPI peer, on the zero-cost simulated engine.

Both servers run DP 2 with 128 sequences per rank and the same tokenizer (the bundled one). The load generator is
`shared/bench/loadgen.py`. For each scenario each server is driven in turn, in the same run, and the CPU the server
process and its rank processes spend (from /proc) is divided by the streamed tokens.

    python bench/bench.py [--bench-dir ../shared/bench] [--quick] [--json-out results.json]

Prints one JSON summary and a table of ratios (ours / peer).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TOKENIZER = ROOT / "python" / "deepinfer_server" / "tokenizer" / "tokenizer.json"
MODEL = "deepseek-v4.1-flash"


@dataclass
class Proc:
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
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def wait_health(url: str, proc: subprocess.Popen[bytes], timeout: float = 60) -> None:
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


def start_ours(port: int, extra: list[str]) -> Proc:
    cmd = [
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
        *extra,
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, p)
    return Proc("ours", p, url)


def start_peer(bench_dir: Path, port: int, extra: list[str]) -> Proc:
    cmd = [
        sys.executable,
        str(bench_dir / "peer_fastapi.py"),
        "--port",
        str(port),
        "--tokenizer",
        str(TOKENIZER),
        "--served-model-name",
        MODEL,
        *extra,
    ]
    p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_health(url, p)
    return Proc("peer", p, url)


def loadgen(bench_dir: Path, proc: Proc, *args: str) -> dict:
    cmd = [
        sys.executable,
        str(bench_dir / "loadgen.py"),
        "--base-url",
        proc.url,
        "--model",
        MODEL,
        "--tokenizer",
        str(TOKENIZER),
        "--watch-pids",
        ",".join(map(str, proc.pids())),
        *args,
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    res = json.loads(out.strip().splitlines()[-1])
    cpu_s = sum(v for v in res.get("watched_cpu_pct", {}).values() if v is not None) / 100.0 * res["wall_s"]
    res["server_cpu_s"] = round(cpu_s, 3)
    tokens = res["completion_tokens"] or 1
    res["server_cpu_us_per_token"] = round(1e6 * cpu_s / tokens, 3)
    return res


def scenario_zero_cost(bench_dir: Path, quick: bool) -> dict:
    """Issue #2's shape: 64 streams, 256-token prompts, 256 output tokens, ignore_eos, both usage options."""
    n = "600" if quick else "2500"
    common = ["--prompt-tokens", "256", "--max-tokens", "256", "--ignore-eos"]
    runs = {}
    for name in ("ours", "peer"):
        proc = (
            start_ours(18611, ["--dp", "2", "--max-num-seqs", "128", "--max-model-len", "4096"])
            if name == "ours"
            else start_peer(
                bench_dir,
                18612,
                ["--dp", "2", "--max-num-seqs", "128", "--itl-ms", "0", "--prefill-ms-per-1k-tokens", "0"],
            )
        )
        try:
            r64 = loadgen(bench_dir, proc, "--concurrency", "64", "--requests", n, "--warmup", "64", *common)
            r16 = loadgen(
                bench_dir, proc, "--concurrency", "16", "--requests", str(int(n) // 2), "--warmup", "16", *common
            )
        finally:
            proc.stop()
        runs[name] = {"c64": r64, "c16": r16}
    return runs


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench-dir", type=Path, default=ROOT.parent / "shared" / "bench")
    ap.add_argument("--quick", action="store_true", help="fewer requests (a smoke run, not for BENCHMARKS.md)")
    ap.add_argument("--json-out", type=Path)
    args = ap.parse_args()
    if not (args.bench_dir / "loadgen.py").is_file():
        raise SystemExit(f"loadgen.py not found in {args.bench_dir} (use --bench-dir)")
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    runs = scenario_zero_cost(args.bench_dir, args.quick)
    o, p = runs["ours"], runs["peer"]
    summary = {
        "machine": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "zero_cost": runs,
        "ratios_ours_over_peer": {
            "cpu_us_per_token_c64": ratio(o["c64"]["server_cpu_us_per_token"], p["c64"]["server_cpu_us_per_token"]),
            "ttft_p50_c64": ratio(o["c64"]["ttft_ms"]["p50"], p["c64"]["ttft_ms"]["p50"]),
            "ttft_p50_c16": ratio(o["c16"]["ttft_ms"]["p50"], p["c16"]["ttft_ms"]["p50"]),
            "output_tok_s_c64": ratio(o["c64"]["output_tokens_per_s"], p["c64"]["output_tokens_per_s"]),
        },
    }
    text = json.dumps(summary, indent=1)
    print(text)
    if args.json_out:
        args.json_out.write_text(text + "\n")
    rows = [("metric", "ours", "peer", "ours/peer")]
    for c in ("c64", "c16"):
        for key, label in (
            ("server_cpu_us_per_token", "server+ranks CPU µs/token"),
            ("output_tokens_per_s", "output tok/s"),
        ):
            rows.append((f"{c} {label}", o[c][key], p[c][key], ratio(o[c][key], p[c][key])))
        for q in ("p50", "p95"):
            rows.append(
                (
                    f"{c} TTFT {q} ms",
                    o[c]["ttft_ms"][q],
                    p[c]["ttft_ms"][q],
                    ratio(o[c]["ttft_ms"][q], p[c]["ttft_ms"][q]),
                )
            )
        rows.append(
            (
                f"{c} ITL p50 ms",
                o[c]["itl_ms"]["p50"],
                p[c]["itl_ms"]["p50"],
                ratio(o[c]["itl_ms"]["p50"], p[c]["itl_ms"]["p50"]),
            )
        )
        rows.append(
            (f"{c} errors", sum(o[c]["errors_by_status"].values()), sum(p[c]["errors_by_status"].values()), None)
        )
    print()
    for r in rows:
        print(f"| {r[0]:<34} | {r[1]!s:>10} | {r[2]!s:>10} | {r[3]!s:>9} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
