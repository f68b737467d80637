"""`deepinfer-server run-batch` (issue 31): vLLM's offline form, through this server's Batch API."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

from conftest import MODEL

from deepinfer_server.progress import Progress


def test_run_batch_writes_one_result_per_line_in_order(tmp_path: Path) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6}
    lines = [
        {"custom_id": "c0", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {
            "custom_id": "t0",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": MODEL, "prompt": "Once", "max_tokens": 4},
        },
        {"custom_id": "x0", "method": "POST", "url": "/v1/embeddings", "body": {"model": MODEL, "input": "x"}},
        {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions", "body": {**chat, "model": "nope"}},
    ]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    cmd = [
        sys.executable,
        "-m",
        "deepinfer_server",
        "run-batch",
        "-i",
        str(src),
        "-o",
        str(out),
        "--served-model-name",
        MODEL,
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    got = [json.loads(x) for x in out.read_text().splitlines()]
    assert [g["custom_id"] for g in got] == ["c0", "t0", "x0", "c1"]
    assert got[0]["response"]["status_code"] == 200 and got[0]["response"]["body"]["object"] == "chat.completion"
    assert got[1]["response"]["body"]["object"] == "text_completion"
    assert got[2]["response"] is None and "url" in got[2]["error"]["message"]
    assert got[3]["response"]["status_code"] == 404
    # Piped: plain progress lines, the last one for each endpoint's batch, no bar and no carriage returns.
    assert "run-batch: /v1/chat/completions 2/2 (100 %), 1 failed" in run.stderr, run.stderr[-3000:]
    assert "run-batch: /v1/completions 1/1 (100 %), 0 failed" in run.stderr
    assert "\r" not in run.stderr and "[###" not in run.stderr


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_a_bar_on_a_terminal_and_lines_when_piped() -> None:
    tty, pipe = Terminal(), io.StringIO()
    bars, lines = Progress("/v1/chat/completions", tty), Progress("/v1/chat/completions", pipe)
    for done in (0, 5, 10):
        batch = {"status": "in_progress", "request_counts": {"total": 10, "completed": done, "failed": 0}}
        bars.update(batch, final=done == 10)
        lines.update(batch, final=done == 10)
    drawn = tty.getvalue()
    assert drawn.count("\r") == 3 and drawn.endswith("\n"), drawn
    assert "[###############...............] 5/10 (50 %)" in drawn
    assert "[##############################] 10/10 (100 %)" in drawn
    # Piped: the first count, then (within PLAIN_EVERY_S) only the last.
    assert pipe.getvalue().splitlines() == [
        "run-batch: /v1/chat/completions 0/10 (0 %), 0 failed, 0.0/s, ETA -, in_progress",
        pipe.getvalue().splitlines()[-1],
    ]
    assert pipe.getvalue().splitlines()[-1].startswith("run-batch: /v1/chat/completions 10/10 (100 %), 0 failed")
