#!/usr/bin/env python3
"""The codec's CPU per streamed token on each door, without the server around it: `Codec.prepare` of
`bench/doors.py`'s bodies, then the decoder's `push` over 256 sim-corpus tokens in batches of `--batch`, as rank_io
calls it. The doors alternate within each round; the figure is the minimum over rounds. With `--profile DOOR`,
cProfile of that door's pushes instead.

    python bench/codec_doors.py [--rounds 7] [--requests 200] [--batch 2] [--profile responses]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).parent))
from doors import DOORS, MODEL, TOKENS, body

from deepinfer_server import _native
from deepinfer_server._native import PrepareInput
from deepinfer_server.codec import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Codec
from deepinfer_server.engine.sim_script import CORPUS
from deepinfer_server.launcher import BUNDLED_TOKENIZER
from deepinfer_server.refusals import Refusal

PROTOCOL = {"chat": CHAT, "completions": COMPLETIONS, "messages": MESSAGES, "responses": RESPONSES}


def one_request(codec: Codec, door: str, raw: bytes, tokens: list[int], batch: int) -> tuple[int, int]:
    """(ns in prepare, ns in the pushes) of one streamed request."""
    t0 = time.perf_counter_ns()
    p = codec.prepare(PrepareInput(door=PROTOCOL[door], body=raw, response_id="resp_1", model=MODEL, ignore_eos=True))
    t1 = time.perf_counter_ns()
    assert not isinstance(p, Refusal), p
    dec = p.decoder
    n = len(tokens)
    for k in range(0, n, batch):
        finish = _native.FINISH_LENGTH if k + batch >= n else _native.FINISH_NONE
        dec.push(tokens[k : k + batch], finish)
    return t1 - t0, time.perf_counter_ns() - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--profile", choices=list(DOORS))
    args = ap.parse_args()
    codec = Codec(BUNDLED_TOKENIZER, [MODEL], 16384)
    tok = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    corpus = tok.encode(CORPUS.read_text(encoding="utf-8"), add_special_tokens=False).ids
    tokens = corpus[:TOKENS]
    bodies = {door: json.dumps(body(door)).encode() for door in DOORS}
    if args.profile:
        door = args.profile
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(args.requests):
            one_request(codec, door, bodies[door], tokens, args.batch)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
        return 0
    best: dict[str, tuple[float, float]] = {}
    for _ in range(args.rounds):
        for door in DOORS:
            prep = push = 0
            for _ in range(args.requests):
                a, b = one_request(codec, door, bodies[door], tokens, args.batch)
                prep, push = prep + a, push + b
            per_tok = push / 1e3 / args.requests / TOKENS
            per_req = prep / 1e3 / args.requests
            old = best.get(door)
            best[door] = (min(old[0], per_tok), min(old[1], per_req)) if old else (per_tok, per_req)
    chat = best["chat"][0] + best["chat"][1] / TOKENS
    print(f"batch {args.batch}, {TOKENS} tokens, min of {args.rounds} rounds of {args.requests} requests")
    print("| door | push µs/token | prepare µs/request | all µs/token | / chat |\n|---|---|---|---|---|")
    for door, (tk, rq) in best.items():
        total = tk + rq / TOKENS
        print(f"| {door} | {tk:.3f} | {rq:.1f} | {total:.3f} | {total / chat:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
