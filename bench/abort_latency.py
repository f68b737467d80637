#!/usr/bin/env python3
"""How fast `/abort_request` ends a streaming request and frees its slot (issue 42 asks for under 50 ms).

One server on the sim (one rank, ONE slot, no wait queue, 20 ms decode steps). Each round starts a long chat
stream with its own `X-Request-Id`, waits for its first text, then times from sending `/abort_request {rid}` to:
the abort's answer (the slot is free before it is sent: `RankLink::abort` takes the request off its rank first),
the stream's last byte (its `finish_reason: "abort"` chunk and `[DONE]`), and a new request's 200 headers (on a
server of one slot with no queue, a 429 had the slot still been held). Prints the median and p95 of each.

    python bench/abort_latency.py [--rounds 50]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import threading
import time
from typing import IO

import httpx

MODEL = "deepseek-v4.1-flash"
BODY = {
    "model": MODEL,
    "messages": [{"role": "user", "content": "Tell me a story."}],
    "max_tokens": 3000,
    "ignore_eos": True,
    "stream": True,
    "thinking": {"type": "disabled"},
}


def start() -> tuple[subprocess.Popen[str], str]:
    cmd = [sys.executable, "-m", "deepinfer_server", "--port", "0", "--served-model-name", MODEL, "--dp", "1"]
    cmd += ["--host", "127.0.0.1", "--max-num-seqs", "1", "--sim-decode-step-ms", "20"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if m:
            threading.Thread(target=drain, args=(proc.stdout,), daemon=True).start()  # keep its log pipe flowing
            return proc, m.group(1)
    raise SystemExit("the server did not start")


def drain(out: IO[str]) -> None:
    for _ in out:
        pass


def p95(xs: list[float]) -> float:
    return sorted(xs)[min(len(xs) - 1, round(0.95 * (len(xs) - 1)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    proc, url = start()
    answered, ended, admitted = [], [], []
    try:
        with httpx.Client(base_url=url, timeout=30) as control, httpx.Client(base_url=url, timeout=30) as c:
            for i in range(args.rounds):
                rid = f"bench-{i}"
                with c.stream("POST", "/v1/chat/completions", json=BODY, headers={"X-Request-Id": rid}) as r:
                    lines = r.iter_lines()
                    for line in lines:
                        if '"content":"' in line:
                            break
                    t0 = time.perf_counter()
                    assert control.post("/abort_request", json={"rid": rid}).json()["aborted"] == 1
                    answered.append(time.perf_counter() - t0)
                    rest = list(lines)
                    ended.append(time.perf_counter() - t0)
                    assert any('"finish_reason":"abort"' in x for x in rest), rest[-3:]
                short = {**BODY, "stream": False, "max_tokens": 1}
                status = control.post("/v1/chat/completions", json=short).status_code
                admitted.append(time.perf_counter() - t0)
                assert status == 200, f"the slot was still held: {status}"
    finally:
        proc.terminate()
        proc.wait(10)
    for name, xs in (("abort answered", answered), ("stream ended", ended), ("next request done", admitted)):
        ms = [x * 1e3 for x in xs]
        print(f"{name:>18}: median {statistics.median(ms):6.2f} ms   p95 {p95(ms):6.2f} ms   (n={len(ms)})")
    print(json.dumps({"rounds": args.rounds}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
