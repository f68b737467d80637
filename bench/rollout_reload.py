#!/usr/bin/env python3
"""The time from `POST /update_weights_from_disk` to the first token on the new weights (issue 42, point 6), on
the sim with two ranks: while a rollout's requests run, the reload is called, and a streaming request is sent as
soon as the pause has begun; it waits at the pause gate and its first token comes from the new checkpoint.
Alternates two checkpoints (their config.json sets the sim's script seed), `--rounds` times, with the running
requests drained (`abort_all_requests: false`) and aborted (`true`).

Prints per round and mode: the reload's answer time, and the first new token's time, both from the call.

    python bench/rollout_reload.py [--rounds 10] [--inflight 32] [--tokens 64] [--step-ms 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import queue  # noqa: E402, F401  (the stdlib's, before bench/queue.py could shadow it)

sys.path.insert(0, str(HERE))
from doors import MODEL, start_server  # noqa: E402

TOKDIR = HERE.parent / "python" / "deepinfer_server" / "tokenizer"


def checkpoint(d: Path, seed: int) -> Path:
    d.mkdir(parents=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKDIR / f, d / f)
    (d / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "sim_script_seed": seed}))
    return d


async def first_token(c: httpx.AsyncClient, t0: float) -> float:
    """Seconds from `t0` to the first token of a streamed completion."""
    body = {"model": MODEL, "prompt": "The river", "max_tokens": 4, "temperature": 0, "stream": True}
    async with c.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread()).decode()}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                return time.monotonic() - t0
    raise RuntimeError("the stream ended without a token")


async def round_(url: str, ckpt: Path, abort: bool, args: argparse.Namespace) -> dict[str, float]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as c:
        body = {"model": MODEL, "prompt": "x", "max_tokens": args.tokens, "ignore_eos": True}
        running = [asyncio.create_task(c.post("/v1/completions", json=body)) for _ in range(args.inflight)]
        await asyncio.sleep(args.tokens * args.step_ms / 2000)  # halfway through their tokens
        t0 = time.monotonic()
        req = {"model_path": str(ckpt), "abort_all_requests": abort}
        reload = asyncio.create_task(c.post("/update_weights_from_disk", json=req))
        # Sent before the pause, it would run (or be aborted) on the old weights. An aborting reload may be over
        # before a poll sees the pause: then the request goes after it, still timed from the call.
        while not reload.done() and not (await c.get("/is_paused")).json()["is_paused"]:
            await asyncio.sleep(0.001)
        first = await first_token(c, t0)
        answer = await reload
        answered = time.monotonic() - t0
        assert answer.json()["success"], answer.text
        await asyncio.gather(*running)
        return {"reload_answered_ms": round(answered * 1e3, 1), "first_new_token_ms": round(first * 1e3, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--inflight", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--step-ms", type=float, default=10.0)
    ap.add_argument("--port", type=int, default=18840)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="reload-bench-"))
    ckpts = [checkpoint(root / "v1", 1), checkpoint(root / "v2", 2)]
    extra = [str(ckpts[0]), "--sim-decode-step-ms", str(args.step_ms)]
    proc, _, url = start_server(args.port, None, extra)
    runs: dict[str, list[dict[str, float]]] = {"drain": [], "abort": []}
    try:
        for i in range(args.rounds):
            for mode in ("drain", "abort"):
                ckpt = ckpts[(2 * i + (mode == "abort") + 1) % 2]
                runs[mode].append(asyncio.run(round_(url, ckpt, mode == "abort", args)))
                print(f"round {i + 1} {mode}: {runs[mode][-1]}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"\n{args.inflight} requests of {args.tokens} tokens running, {args.step_ms} ms steps, dp 2, "
        f"{args.rounds} rounds\n"
    )
    print("| running requests | reload answered ms (median, max) | first new token ms (median, max) |")
    print("|---|---|---|")
    for mode, rs in runs.items():
        a = [r["reload_answered_ms"] for r in rs]
        f = [r["first_new_token_ms"] for r in rs]
        what = "drained" if mode == "drain" else "aborted"
        print(f"| {what} | {statistics.median(a)}, {max(a)} | {statistics.median(f)}, {max(f)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
