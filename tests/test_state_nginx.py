"""Two replicas on one PostgreSQL store behind nginx (issue 31), as a gateway spreads a client's requests: a chain
of `previous_response_id` whose turns land on alternate replicas, and a batch made through the gateway that the
other replica finishes after the one running it is SIGKILLed, each custom_id once."""

from __future__ import annotations

import io
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import openai
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import nginx_replicas as nx

from pg_server import fresh_database

pytestmark = pytest.mark.skipif(
    nx.NGINX is None, reason="nginx is not installed (scripts/test.sh installs Debian's nginx package as root)"
)


def upstream(raw: Any) -> str:
    """The replica that answered (nginx's X-Upstream: the last address it tried)."""
    return str(raw.headers.get("x-upstream", "?")).split(",")[-1].strip()


def test_a_chain_and_a_batch_cross_replicas_behind_nginx(tmp_path: Path, pg_url: str) -> None:
    # A database of its own: in the shared one, batches that other tests' stopped servers left unfinished would be
    # taken over first by the replica this test leaves alive.
    store = fresh_database(pg_url, "nginx_replicas")
    args = (*nx.REPLICA_ARGS, "--max-num-seqs", "2", "--state-store", store, "--files-dir", str(tmp_path / "files"))
    with nx.setup(tmp_path, args, args) as (nginx, replicas):
        c = openai.OpenAI(base_url=f"{nginx.url}/v1", api_key="unused", max_retries=0)
        ask = {"model": nx.MODEL, "max_output_tokens": 8, "reasoning": {"effort": "none"}}

        # A chain through the gateway: each turn continues the one before, wherever that was made.
        raw = c.responses.with_raw_response.create(input="My name is Ada.", **ask)  # type: ignore[call-overload]
        prev, made_on = raw.parse(), upstream(raw)
        crossed = 0
        for turn in range(4):
            raw = c.responses.with_raw_response.create(  # type: ignore[call-overload]
                input=f"Turn {turn}: what is my name?", previous_response_id=prev.id, **ask
            )
            r = raw.parse()
            assert r.previous_response_id == prev.id and r.usage.input_tokens > prev.usage.input_tokens
            crossed += upstream(raw) != made_on
            prev, made_on = r, upstream(raw)
        assert crossed >= 2, "nginx never sent a turn to the replica that did not make the one before"
        items = c.responses.input_items.list(prev.id)
        assert [i.content[0].text for i in items.data] == ["Turn 3: what is my name?"]  # type: ignore[union-attr]

        # A batch through the gateway; the replica that runs it is killed; the other finishes it.
        lines = [
            {
                "custom_id": f"r{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": nx.MODEL,
                    "messages": [{"role": "user", "content": f"line {i}"}],
                    "max_tokens": 40,
                    "ignore_eos": True,
                    "thinking": {"type": "disabled"},
                },
            }
            for i in range(30)
        ]
        data = "\n".join(json.dumps(x) for x in lines).encode()
        f = c.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 60
        runner = None
        while runner is None:
            assert time.monotonic() < deadline, "no replica ran the batch"
            counts = c.batches.retrieve(b.id).request_counts
            busy = [r for r in replicas if r.in_flight() > 0]
            if counts is not None and counts.completed >= 4 and len(busy) == 1:
                runner = busy[0]
            time.sleep(0.05)
        runner.signal_group(signal.SIGKILL)
        runner.wait(timeout=30)
        deadline = time.monotonic() + 120  # the dead replica's 15 s claim runs out first
        while (done := c.batches.retrieve(b.id)).status not in ("completed", "failed", "cancelled", "expired"):
            survivor = next(r for r in replicas if r is not runner)
            assert time.monotonic() < deadline, (done, "".join(survivor.lines)[-3000:])
            time.sleep(0.2)
        assert done.status == "completed" and done.error_file_id is None, done
        assert done.output_file_id is not None
        out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
        assert sorted(x["custom_id"] for x in out) == sorted(f"r{i}" for i in range(30))
