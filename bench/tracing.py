#!/usr/bin/env python3
"""What OpenTelemetry tracing costs: servers on the zero-cost sim with tracing off (two of them: their difference is
the noise floor), on at 100 % sampling and on at 1 % (`traceidratio` 0.01), exporting OTLP/HTTP to a local
receiver in this process. Each round streams the same
answers (`ignore_eos`) with wrk at 64 connections to each server in turn (the order rotates every round), then
times single requests' first token with no other load. Prints medians and each traced server's ratio to off.

    python bench/tracing.py [--rounds 3] [--seconds 8] [--conns 64] [--tokens 256] [--probes 40] [--server-args ARGS]

`--server-args '--sim-decode-step-ms 5'` paces the engine: the same tokens/s on every server whatever else runs on
the machine, where the flat-out figures move with the CPU the servers get (more batching when they get less).

CPU is the server process's (HTTP, codec, SSE, and the trace export thread) and, beside it, with its ranks, from
/proc utime + stime over the timed run, per streamed token and per request. TTFT is the server's own mean under
the wrk load (`vllm:time_to_first_token_seconds` over the run) and the client's median to the first content
chunk of a lone stream. Needs `wrk` (Debian package).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import cpu_seconds

MODEL = "deepseek-v4.1-flash"
TTFT = "vllm:time_to_first_token_seconds"
PROMPT = " ".join(["the", "of", "and", "to", "in", "weather", "Paris"] * 36)
# Two servers with tracing off: what one off server reads against the other is the machine's noise floor.
CONFIGS: dict[str, dict[str, str]] = {
    "off": {},
    "off_again": {},
    "on_100": {"OTEL_TRACES_SAMPLER": "always_on"},
    "on_1": {"OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"},
}


class Receiver:
    """An OTLP/HTTP endpoint that takes every export (200, an empty ExportTraceServiceResponse) and counts bytes."""

    def __init__(self) -> None:
        self.bytes = 0
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:
                n = int(self.headers.get("content-length", 0))
                receiver.bytes += len(self.rfile.read(n))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1/traces"


def body(tokens: int, stream: bool = True) -> dict[str, Any]:
    return {
        "model": MODEL,
        "stream": stream,
        "ignore_eos": True,
        "max_tokens": tokens,
        "thinking": {"type": "disabled"},
        "messages": [{"role": "user", "content": PROMPT}],
    }


def start(
    port: int, endpoint: str | None, env_extra: dict[str, str], extra: list[str]
) -> tuple[subprocess.Popen[bytes], list[int]]:
    cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--log-level", "warning", "--dp", "2", "--max-num-seqs", "128", *extra]
    if endpoint is not None:
        cmd += ["--otlp-traces-endpoint", endpoint]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ, **env_extra})
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    return proc, [proc.pid, *map(int, out.split())]


def thread_cpu(pid: int, name: str) -> float:
    """CPU seconds of the process's threads called `name` (the trace export thread: `otel-export`)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            if (task / "comm").read_text().strip() == name:
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except OSError:
            pass
    return total


def metric(url: str, name: str) -> float:
    """A series' value, summed over its labels."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def counts(url: str) -> tuple[float, float, float, float]:
    """Tokens generated, requests finished, and the TTFT histogram's sum and count, so far."""
    names = ["vllm:generation_tokens_total", "vllm:request_success_total", f"{TTFT}_sum", f"{TTFT}_count"]
    a, b, c, d = (metric(url, n) for n in names)
    return a, b, c, d


def wrk(url: str, tokens: int, seconds: int, conns: int, pids: list[int]) -> dict[str, float]:
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        lua_body = json.dumps(json.dumps(body(tokens)))
        f.write(f'wrk.method = "POST"\nwrk.body = {lua_body}\nwrk.headers["Content-Type"] = "application/json"\n')
        script = f.name
    target = f"{url}/v1/chat/completions"
    try:
        subprocess.run(["wrk", "-t1", f"-c{conns}", "-d2s", "-s", script, target], capture_output=True, check=True)
        before = counts(url)
        cpu0, own0, export0 = cpu_seconds(pids), cpu_seconds(pids[:1]), thread_cpu(pids[0], "otel-export")
        cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "-s", script, target]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        cpu, own = cpu_seconds(pids) - cpu0, cpu_seconds(pids[:1]) - own0
        export = thread_cpu(pids[0], "otel-export") - export0
        # The server's own counts over the same window: the tokens of requests wrk cut at its end count too.
        toks, reqs, ttft_sum, ttft_n = (b - a for a, b in zip(before, counts(url), strict=True))
    finally:
        os.unlink(script)
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "requests": reqs,
        "non_2xx": int(bad.group(1)) if bad else 0,
        "tokens_per_s": round(toks / seconds),
        "server_us_per_token": round(1e6 * own / max(1.0, toks), 3),
        "cpu_us_per_token": round(1e6 * cpu / max(1.0, toks), 3),
        "server_us_per_request": round(1e6 * own * tokens / max(1.0, toks), 1),
        # the export thread alone (building the spans, encoding, sending), per request served
        "export_us_per_request": round(1e6 * export * tokens / max(1.0, toks), 1),
        "ttft_ms_mean_loaded": round(1e3 * ttft_sum / max(1.0, ttft_n), 3),
    }


def lone_ttft(url: str, probes: int) -> float:
    """The client's median time to the first content chunk of a 16-token stream, one request at a time."""
    got = []
    with httpx.Client(timeout=30) as c:
        for _ in range(probes):
            t0 = time.perf_counter()
            with c.stream("POST", f"{url}/v1/chat/completions", json=body(16)) as r:
                first = None
                for line in r.iter_lines():
                    if first is None and '"content":"' in line:
                        first = time.perf_counter() - t0
                assert first is not None, "no content chunk"
                got.append(first)
    return round(1e3 * statistics.median(got), 3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--probes", type=int, default=40)
    ap.add_argument("--port", type=int, default=18830)
    ap.add_argument("--server-args", default="", help="more flags for every server, e.g. '--sim-decode-step-ms 5'")
    args = ap.parse_args()
    rec = Receiver()
    servers: dict[str, tuple[subprocess.Popen[bytes], list[int], str]] = {}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in CONFIGS}
    try:
        for k, (label, env) in enumerate(CONFIGS.items()):
            endpoint = None if label.startswith("off") else rec.endpoint
            proc, pids = start(args.port + k, endpoint, env, args.server_args.split())
            servers[label] = (proc, pids, f"http://127.0.0.1:{args.port + k}")
        labels = list(CONFIGS)
        for i in range(args.rounds):
            for label in labels[i % len(labels) :] + labels[: i % len(labels)]:  # each server first in turn
                _, pids, url = servers[label]
                run = wrk(url, args.tokens, args.seconds, args.conns, pids)
                run["ttft_ms_median_lone"] = lone_ttft(url, args.probes)
                runs[label].append(run)
                print(f"round {i + 1} {label}: {run}", file=sys.stderr, flush=True)
        spans = {
            label: tuple(metric(url, f"deepinfer_trace_spans_{k}_total") for k in ("exported", "dropped"))
            for label, (_, _, url) in servers.items()
        }
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    keys = ["server_us_per_token", "cpu_us_per_token", "server_us_per_request", "export_us_per_request",
            "ttft_ms_mean_loaded", "ttft_ms_median_lone", "tokens_per_s"]  # fmt: skip
    summary = {
        label: {
            **{f"{k}_median": round(statistics.median(r[k] for r in rs), 3) for k in keys},
            "server_us_per_token_rounds": [r["server_us_per_token"] for r in rs],
            "non_2xx": sum(r["non_2xx"] for r in rs),
            "spans_exported": spans[label][0],
            "spans_dropped": spans[label][1],
        }
        for label, rs in runs.items()
    }
    print(json.dumps({"summary": summary, "receiver_bytes": rec.bytes}, indent=1))
    print(
        "\n| tracing | server µs/token | / off (rounds) | with ranks µs/token | server µs/request | of which export "
        "thread | TTFT mean under load (ms) | lone TTFT p50 (ms) | tok/s | spans exported / dropped |\n"
        + "|---" * 10
        + "|"
    )
    off = runs["off"]
    for label, s in summary.items():
        ratios = ", ".join(
            f"{r['server_us_per_token'] / o['server_us_per_token']:.3f}" for r, o in zip(runs[label], off, strict=True)
        )
        print(
            f"| {label} | {s['server_us_per_token_median']} | {ratios} | {s['cpu_us_per_token_median']} "
            f"| {s['server_us_per_request_median']} | {s['export_us_per_request_median']} "
            f"| {s['ttft_ms_mean_loaded_median']} "
            f"| {s['ttft_ms_median_lone_median']} | {s['tokens_per_s_median']} "
            f"| {int(s['spans_exported'])} / {int(s['spans_dropped'])} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
