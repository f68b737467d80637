"""A traced request through a real nginx (Debian's package, as test_gateway_nginx.py starts it): nginx passes the
client's `traceparent` on unchanged by default, so the replica's span is a child of the span the client named."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx
import otlp_receiver as rx
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import nginx_replicas as nx

pytestmark = pytest.mark.skipif(
    nx.NGINX is None, reason="nginx is not installed (scripts/test.sh installs Debian's nginx package as root)"
)

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


def test_the_gateways_traceparent_is_the_parent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rec = rx.http_receiver()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # the replicas inherit it
    args = (*nx.REPLICA_ARGS, "--otlp-traces-endpoint", rec.endpoint)
    try:
        with nx.setup(tmp_path, args, args) as (nginx, replicas):
            body = {"model": nx.MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
            headers = {"traceparent": f"00-{TRACE_ID}-{PARENT}-01", "x-request-id": "via-nginx"}
            r = httpx.post(f"{nginx.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
            assert r.status_code == 200, r.text
            upstream = r.headers["x-upstream"]
            span = rec.by_request_id("via-nginx")
            assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT)
            assert span.attributes["http.response.status_code"] == 200
            served = next(rep for rep in replicas if rep.addr == upstream)
            assert any(f"trace_id={TRACE_ID} " in ln for ln in served.lines), "its log line names the trace"
    finally:
        rec.stop()
