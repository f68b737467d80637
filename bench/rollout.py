#!/usr/bin/env python3
"""An RL rollout's load (issue 42, point 6): P prompts × n samples of T tokens with their token IDs and logprobs,
as a rollout framework asks for them, on one server on the zero-cost sim. Three ways, alternating round by round:

- `generate`: SGLang's native `/generate`, one request per prompt with `n` samples, `return_logprob`;
- `chat_ids`: Chat Completions with vLLM's `return_token_ids` and `logprobs`, one request per sample (`n` > 1 is
  refused on chat, so a framework sends n requests, as verl's and slime's agent loops do);
- `chat`: plain Chat Completions, one request per sample, no IDs, no logprobs (the baseline).

Each way keeps the same number of sequences in flight (`--inflight`). Prints per way and round: wall time,
generated tokens/s, and CPU µs per generated token (the server and its ranks, utime + stime from /proc; and the
server process alone), then medians and the ratio to plain chat.

    python bench/rollout.py [--prompts 256] [--n 8] [--tokens 64] [--rounds 3] [--inflight 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

# The stdlib's `queue` first (anyio needs it): bench/queue.py, beside this script, would shadow it.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]
import queue  # noqa: E402, F401

sys.path.insert(0, str(HERE))
from bench import cpu_seconds  # noqa: E402
from doors import MODEL, start_server  # noqa: E402

WORDS = ["the", "of", "and", "to", "in", "weather", "Paris", "river", "proof", "sum"]


def prompt(i: int) -> str:
    return f"Problem {i}: " + " ".join(WORDS[(i + k) % len(WORDS)] for k in range(48))


def requests(way: str, prompts: int, n: int, tokens: int) -> list[tuple[str, dict[str, Any], int]]:
    """(path, body, sequences) for every request of one rollout."""
    if way == "generate":
        params = {"max_new_tokens": tokens, "ignore_eos": True, "n": n, "temperature": 1.0}
        return [
            ("/generate", {"text": prompt(i), "sampling_params": params, "return_logprob": True}, n)
            for i in range(prompts)
        ]
    extra: dict[str, Any] = {"return_token_ids": True, "logprobs": True} if way == "chat_ids" else {}
    body = {"model": MODEL, "max_tokens": tokens, "ignore_eos": True, "thinking": {"type": "disabled"}, **extra}
    return [
        ("/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt(i)}]}, 1)
        for i in range(prompts)
        for _ in range(n)
    ]


def generated(way: str, answer: Any) -> int:
    """The tokens an answer says it generated, checked against its IDs where it has them."""
    if way == "generate":
        outs = answer if isinstance(answer, list) else [answer]
        for o in outs:
            assert len(o["output_ids"]) == len(o["meta_info"]["output_token_logprobs"]), "one logprob per id"
        return sum(len(o["output_ids"]) for o in outs)
    if way == "chat_ids":
        choice = answer["choices"][0]
        assert answer["prompt_token_ids"] and len(choice["logprobs"]["content"]) == len(choice["token_ids"])
    return int(answer["usage"]["completion_tokens"])


async def rollout(url: str, way: str, args: argparse.Namespace, pids: list[int]) -> dict[str, float]:
    todo = requests(way, args.prompts, args.n, args.tokens)
    per_request = todo[0][2]
    limit = asyncio.Semaphore(max(1, args.inflight // per_request))
    total = 0
    limits = httpx.Limits(max_connections=args.inflight, max_keepalive_connections=args.inflight)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:

        async def one(path: str, body: dict[str, Any]) -> None:
            nonlocal total
            async with limit:
                r = await client.post(path, json=body)
            if r.status_code != 200:
                raise SystemExit(f"{way}: {r.status_code} {r.text[:300]}")
            total += generated(way, r.json())

        cpu0, own0, t0 = cpu_seconds(pids), cpu_seconds(pids[:1]), time.monotonic()
        await asyncio.gather(*(one(path, body) for path, body, _ in todo))
        wall, cpu, own = time.monotonic() - t0, cpu_seconds(pids) - cpu0, cpu_seconds(pids[:1]) - own0
    expected = args.prompts * args.n * args.tokens
    if total != expected:
        raise SystemExit(f"{way}: {total} tokens generated, not {expected}")
    return {
        "wall_s": round(wall, 2),
        "tokens_per_s": round(total / wall),
        "cpu_us_per_token": round(1e6 * cpu / total, 2),
        "server_us_per_token": round(1e6 * own / total, 2),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--inflight", type=int, default=256, help="sequences in flight, the same for every way")
    ap.add_argument("--port", type=int, default=18830)
    args = ap.parse_args()
    ways = ["generate", "chat_ids", "chat"]
    # Room for every sequence of a rollout: what waits, waits in the queue (a framework sends them all at once).
    room = str(args.prompts * args.n)
    proc, pids, url = start_server(args.port, None, ["--max-queued-requests", room, "--max-generate-fanout", room])
    runs: dict[str, list[dict[str, float]]] = {way: [] for way in ways}
    try:
        for i in range(args.rounds):
            for way in ways if i % 2 == 0 else ways[::-1]:
                runs[way].append(asyncio.run(rollout(url, way, args, pids)))
                print(f"round {i + 1} {way}: {runs[way][-1]}", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    med = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in runs.items()}
    print(json.dumps({"args": vars(args), "rounds": runs, "medians": med}, indent=1))
    print(
        f"\n{args.prompts} prompts × n {args.n} × {args.tokens} tokens, {args.inflight} sequences in flight, "
        f"{args.rounds} rounds (medians; per-round ratio to plain chat's CPU µs/token)\n"
    )
    print("| way | wall s | tokens/s | CPU µs/token | / chat (rounds) | server alone µs/token |")
    print("|---|---|---|---|---|---|")
    for way, rs in runs.items():
        ratios = ", ".join(
            f"{r['cpu_us_per_token'] / c['cpu_us_per_token']:.2f}" for r, c in zip(rs, runs["chat"], strict=True)
        )
        m = med[way]
        print(
            f"| {way} | {m['wall_s']} | {m['tokens_per_s']:.0f} | {m['cpu_us_per_token']} | {ratios} | "
            f"{m['server_us_per_token']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
