#!/usr/bin/env python3
"""GuideLLM compatibility check: GuideLLM 0.8.1 against DeepInfer-server on the simulated engine, fully offline.

GuideLLM pulls in torch, so it lives in its own virtualenv (created with --install) instead of the test extra:

    python scripts/guidellm_check.py --install          # once: .venv-guidellm with guidellm==0.8.1
    python scripts/guidellm_check.py                    # start the sim server, run GuideLLM, check its report

Synthetic prompts are sized with the bundled tokenizer directory (no Hugging Face Hub access). GuideLLM sends
content-part messages, max_completion_tokens, ignore_eos and stream_options with continuous usage; the check
passes when no request errored and every request produced exactly the requested output tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from bench import MODEL, ours_cmd, wait_health  # noqa: E402  (the benchmark's way of starting our server)

TOKDIR = ROOT / "python" / "deepinfer_server" / "tokenizer"
VENV = ROOT / ".venv-guidellm"


def fail(msg: str) -> int:
    print(f"GUIDELLM CHECK FAIL: {msg}", file=sys.stderr)
    return 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--install", action="store_true", help="create .venv-guidellm with guidellm==0.8.1 and exit")
    ap.add_argument("--guidellm", default=str(VENV / "bin" / "guidellm"))
    ap.add_argument("--port", type=int, default=18790)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--output-tokens", type=int, default=64)
    args = ap.parse_args()
    if args.install:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
        subprocess.run([str(VENV / "bin" / "pip"), "install", "-q", "guidellm==0.8.1"], check=True)
        print(f"installed {VENV}")
        return 0
    if not Path(args.guidellm).exists():
        return fail(f"{args.guidellm} not found; run with --install first")

    url = f"http://127.0.0.1:{args.port}"
    server = subprocess.Popen(ours_cmd(args.port, "--dp", "2", "--max-num-seqs", "16"))
    try:
        try:
            wait_health(url, server, timeout=30)
        except SystemExit as e:
            return fail(f"server did not become healthy: {e}")
        with tempfile.TemporaryDirectory() as out:
            report = Path(out) / "report.json"
            env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
            backend = {
                "kind": "openai_http",
                "target": url,
                "model": MODEL,
                "extras": {"body": {"thinking": {"type": "disabled"}}},
            }
            cmd = [
                args.guidellm,
                "run",
                "--backend",
                json.dumps(backend),
                "--tokenizer",
                f"kind=huggingface_auto,model={TOKDIR}",
                "--data",
                f"kind=synthetic_text,prompt_tokens=256,output_tokens={args.output_tokens}",
                "--profile",
                f"kind=concurrent,streams={args.streams}",
                "--constraint",
                f"kind=max_requests,count={args.requests}",
                "--output",
                f"kind=json,path={report}",
                "--disable-console-interactive",
            ]
            run = subprocess.run(cmd, env=env, cwd=out, capture_output=True, text=True, timeout=600)
            if run.returncode != 0:
                return fail(f"guidellm exited {run.returncode}:\n{run.stdout[-3000:]}\n{run.stderr[-3000:]}")
            metrics = json.loads(report.read_text())["benchmarks"][0]["metrics"]
    finally:
        server.terminate()
        server.wait(timeout=30)

    totals = metrics["request_totals"]
    out_tok = metrics["output_token_count"]["successful"]
    prompt_tok = metrics["prompt_token_count"]["successful"]
    summary = {
        "requests": {k: totals[k] for k in ("successful", "incomplete", "errored", "total")},
        "output_tokens_per_request": {"min": out_tok["min"], "max": out_tok["max"], "mean": out_tok["mean"]},
        "prompt_tokens_per_request_mean": prompt_tok["mean"],
        "ttft_ms_p50": metrics["time_to_first_token_ms"]["successful"]["median"],
        "itl_ms_p50": metrics["inter_token_latency_ms"]["successful"]["median"],
    }
    print(json.dumps(summary, indent=1))
    if totals["errored"] or totals["successful"] != args.requests:
        return fail(f"expected {args.requests} successful and 0 errored requests, got {totals}")
    if out_tok["min"] != args.output_tokens or out_tok["max"] != args.output_tokens:
        return fail(f"output tokens per request must be exactly {args.output_tokens}: {out_tok}")
    if not prompt_tok["mean"] > 0:
        return fail("no prompt tokens reported")
    print("GUIDELLM CHECK OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
