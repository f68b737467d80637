#!/usr/bin/env python3
"""Server CPU per streamed token on each door (Chat Completions, Completions, Anthropic Messages, OpenAI Responses),
on the same load: one server on the zero-cost sim, wrk streaming the same 256-token answers (`ignore_eos`) at 64
connections, the doors in turn, several alternating rounds. Prints each door's figure and its ratio to chat's.

    python bench/doors.py [--rounds 3] [--seconds 8] [--conns 64] [--base OTHER_TREE/python] [--server-args ARGS]
                          [--base-args ARGS]

`--base` runs a second server from another build's `python/` directory beside this one and alternates them door
by door (their order flips each round), for a before/after in one run. `--base-args` gives the base server flags of
its own: `--base python --base-args=--disable-response-store` costs a feature on one build.

Needs `wrk` (Debian package). CPU is the server's and its ranks' (utime + stime from /proc) over the timed run, and
the server process's alone (HTTP, codec and SSE: where the doors differ).
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
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench import cpu_seconds

MODEL = "deepseek-v4.1-flash"
TOKENS = 256
PROMPT = " ".join(["the", "of", "and", "to", "in", "weather", "Paris"] * 36)
DOORS: dict[str, tuple[str, dict[str, Any]]] = {
    "chat": (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS, "thinking": {"type": "disabled"}},
    ),
    "completions": ("/v1/completions", {"prompt": PROMPT, "max_tokens": TOKENS}),
    "messages": (
        "/v1/messages",
        {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": TOKENS, "thinking": {"type": "disabled"}},
    ),
    "responses": ("/v1/responses", {"input": PROMPT, "max_output_tokens": TOKENS, "reasoning": {"effort": "none"}}),
}


def body(door: str) -> dict[str, Any]:
    extra = DOORS[door][1]
    return {"model": MODEL, "stream": True, "ignore_eos": True, **extra}


def wrk(url: str, door: str, seconds: int, conns: int, pids: list[int]) -> dict[str, float]:
    path, _ = DOORS[door]
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as f:
        lua_body = json.dumps(json.dumps(body(door)))
        f.write(f'wrk.method = "POST"\nwrk.body = {lua_body}\nwrk.headers["Content-Type"] = "application/json"\n')
        script = f.name
    try:
        target = f"{url}{path}"
        subprocess.run(["wrk", "-t1", f"-c{conns}", "-d2s", "-s", script, target], capture_output=True, check=True)
        cpu0, own0 = cpu_seconds(pids), cpu_seconds(pids[:1])
        cmd = ["wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "-s", script, target]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        cpu, own = cpu_seconds(pids) - cpu0, cpu_seconds(pids[:1]) - own0
    finally:
        os.unlink(script)
    reqs = int(re.search(r"(\d+) requests in", out).group(1))  # type: ignore[union-attr]
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return {
        "requests": reqs,
        "non_2xx": int(bad.group(1)) if bad else 0,
        "tokens_per_s": round(reqs * TOKENS / seconds),
        "cpu_us_per_token": round(1e6 * cpu / max(1, reqs * TOKENS), 3),
        # the server process alone (HTTP, codec, SSE), without its ranks' engine loops
        "server_us_per_token": round(1e6 * own / max(1, reqs * TOKENS), 3),
    }


def check_lengths(url: str) -> None:
    """Each door streams exactly TOKENS tokens for the benchmark's body, or the figures would not compare."""
    for door in DOORS:
        path, _ = DOORS[door]
        r = httpx.post(f"{url}{path}", json={**body(door), "stream": False}, timeout=60)
        r.raise_for_status()
        usage = r.json()["usage"]
        n = usage.get("completion_tokens", usage.get("output_tokens"))
        if n != TOKENS:
            raise SystemExit(f"{door}: {n} output tokens, not {TOKENS}: {usage}")


def start_server(port: int, pythonpath: str | None, extra: list[str]) -> tuple[subprocess.Popen[bytes], list[int], str]:
    cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--served-model-name", MODEL, "--log-level", "warning", "--dp", "2", "--max-num-seqs", "128", *extra]
    env = dict(os.environ)
    if pythonpath is not None:  # another build's package first on the path (its ranks inherit it)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pythonpath, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    out = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout
    return proc, [proc.pid, *map(int, out.split())], url


def summarize(runs: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, Any]]:
    chat = [r["cpu_us_per_token"] for r in runs["chat"]]
    chat_own = [r["server_us_per_token"] for r in runs["chat"]]
    summary = {}
    for door, rs in runs.items():
        cpu = [r["cpu_us_per_token"] for r in rs]
        own = [r["server_us_per_token"] for r in rs]
        summary[door] = {
            "cpu_us_per_token_median": round(statistics.median(cpu), 3),
            "cpu_us_per_token_rounds": cpu,
            "ratio_to_chat_rounds": [round(c / h, 3) for c, h in zip(cpu, chat, strict=True)],
            "server_us_per_token_median": round(statistics.median(own), 3),
            "server_ratio_to_chat_rounds": [round(c / h, 3) for c, h in zip(own, chat_own, strict=True)],
            "tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in rs),
            "non_2xx": sum(r["non_2xx"] for r in rs),
        }
    return summary


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--conns", type=int, default=64)
    ap.add_argument("--port", type=int, default=18790)
    ap.add_argument(
        "--base",
        metavar="DIR",
        help="also run a server from another build's python/ directory (put first on PYTHONPATH), "
        "alternating with this one door by door: before/after in one run",
    )
    ap.add_argument(
        "--server-args",
        default="",
        help="more server flags, e.g. '--sim-decode-step-ms 5': an engine-paced load, the same tokens/s on every "
        "door, instead of the zero-cost engine's flat-out one",
    )
    ap.add_argument("--base-args", default=None, help="flags for the base server instead of --server-args")
    args = ap.parse_args()
    builds = {"this": None} if args.base is None else {"base": args.base, "this": None}
    flags = {"this": args.server_args.split(), "base": (args.base_args or args.server_args).split()}
    servers: dict[str, tuple[subprocess.Popen[bytes], list[int], str]] = {}
    try:
        for k, (label, path) in enumerate(builds.items()):
            servers[label] = start_server(args.port + k, path, flags[label])
            check_lengths(servers[label][2])
        runs: dict[str, dict[str, list[dict[str, float]]]] = {label: {door: [] for door in DOORS} for label in builds}
        for i in range(args.rounds):
            for door in DOORS:
                order = list(builds) if i % 2 == 0 else list(builds)[::-1]
                for label in order:
                    _, pids, url = servers[label]
                    runs[label][door].append(wrk(url, door, args.seconds, args.conns, pids))
                    print(f"round {i + 1} {label} {door}: {runs[label][door][-1]}", file=sys.stderr, flush=True)
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    summaries = {label: summarize(r) for label, r in runs.items()}
    print(json.dumps(summaries if args.base else summaries["this"], indent=1))
    for label, summary in summaries.items():
        title = f"{label} ({args.base if label == 'base' else 'this tree'})\n" if args.base else ""
        print(
            f"\n{title}| door | CPU µs/token (median) | / chat (rounds) | server alone µs/token | / chat (rounds) "
            "| tok/s | non-2xx |\n|---|---|---|---|---|---|---|"
        )
        for door, s in summary.items():
            ratios = ", ".join(f"{r:.2f}" for r in s["ratio_to_chat_rounds"])
            own = ", ".join(f"{r:.2f}" for r in s["server_ratio_to_chat_rounds"])
            print(
                f"| {door} | {s['cpu_us_per_token_median']} | {ratios} | {s['server_us_per_token_median']} | {own} "
                f"| {s['tokens_per_s_median']} | {s['non_2xx']} |"
            )
    if args.base:
        print("\nthis / base, CPU µs/token per round:")
        for door in DOORS:
            this = summaries["this"][door]["cpu_us_per_token_rounds"]
            base = summaries["base"][door]["cpu_us_per_token_rounds"]
            print(f"  {door}: " + ", ".join(f"{a / b:.2f}" for a, b in zip(this, base, strict=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
