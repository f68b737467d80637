"""OpenTelemetry traces, received for real: a server exporting OTLP to a receiver in the test (HTTP/protobuf and gRPC,
decoded with `opentelemetry-proto`). The caller's `traceparent` is the parent; the TTFT stages tile arrival → first
token and add up to the TTFT; every door has its gen_ai attributes and no text; a background response's run and each
batch line have a trace of their own, linked to the request that created them; a server failure is an error, a
client's (4xx, 429, a disconnect) is not, and says what it was; an unreachable collector costs requests nothing. The
gateway case (nginx keeps the header) is test_tracing_nginx.py.
"""

from __future__ import annotations

import argparse
import io
import itertools
import json
import re
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import otlp_receiver as rx
import pytest
from conftest import MODEL, Server

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT}-01"
TO_FIRST_TOKEN = ["parse", "queue", "encode", "dispatch", "ring", "engine_queue", "prefill", "publish"]
# Spans leave every 50 ms instead of the spec's 5 s, so the tests wait little.
FAST = {"OTEL_BSP_SCHEDULE_DELAY": "50"}
CANARY = "zebra-canary-7f3a"
STATE = ("--state-store", "memory")

MakeServer = Callable[..., Server]


@pytest.fixture
def http_rec() -> Iterator[rx.Receiver]:
    rec = rx.http_receiver()
    yield rec
    rec.stop()


@pytest.fixture
def grpc_rec() -> Iterator[rx.Receiver]:
    rec = rx.grpc_receiver()
    yield rec
    rec.stop()


def chat(srv: Server, rid: str, stream: bool, headers: dict[str, str] | None = None, **kw: Any) -> httpx.Response:
    body = {"model": MODEL, "stream": stream, "max_tokens": 8, "messages": [{"role": "user", "content": CANARY}], **kw}
    h = {"x-request-id": rid, **(headers or {})}
    r = httpx.post(f"{srv.url}/v1/chat/completions", json=body, headers=h, timeout=30)
    return r


def log_line(srv: Server, rid: str, what: str = "request finished") -> str:
    deadline = time.monotonic() + 10
    while True:
        lines = [ln for ln in srv.lines if what in ln and f"request_id={rid} " in ln]
        if lines:
            return lines[0]
        assert time.monotonic() < deadline, f"no {what!r} line for {rid}:\n{srv.log()[-2000:]}"
        time.sleep(0.05)


def check_stages(rec: rx.Receiver, span: rx.Span, stream: bool) -> None:
    """The TTFT stages in order from the span's start, touching, adding up to its TTFT within a millisecond; then
    decode and stream to its end (and sse, for a stream)."""
    kids = rec.children(span)
    stages = [k for k in kids if k.name in TO_FIRST_TOKEN]
    assert [k.name for k in stages] == TO_FIRST_TOKEN, [k.name for k in kids]
    assert stages[0].start_ns == span.start_ns
    for a, b in itertools.pairwise(stages):
        assert abs(b.start_ns - a.end_ns) <= 1000, (a, b)
    ttft_ms = span.attributes["gen_ai.latency.time_to_first_token"] * 1e3
    assert abs(sum(k.ms for k in stages) - ttft_ms) < 1.0, (ttft_ms, [(k.name, k.ms) for k in stages])
    assert abs((stages[-1].end_ns - span.start_ns) / 1e6 - ttft_ms) < 1.0
    by_name = {k.name: k for k in kids}
    decode, tail = by_name["decode"], by_name["stream"]
    assert abs(decode.start_ns - stages[-1].end_ns) <= 1000 and abs(tail.start_ns - decode.end_ns) <= 1000
    assert abs(tail.end_ns - span.end_ns) <= 1000
    assert ("sse" in by_name) == stream
    if stream:
        assert by_name["sse"].start_ns == decode.start_ns
    assert len(kids) == len(TO_FIRST_TOKEN) + 2 + stream


def test_http_export_joins_the_callers_trace_and_its_stages_add_up_to_the_ttft(
    make_server: MakeServer, http_rec: rx.Receiver
) -> None:
    srv = make_server("--otlp-traces-endpoint", http_rec.endpoint, env=FAST)
    h = {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    with httpx.stream(
        "POST",
        f"{srv.url}/v1/chat/completions",
        json={"model": MODEL, "stream": True, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]},
        headers={"x-request-id": "t-stream", **h},
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert sum(1 for _ in r.iter_lines()) > 3
    span = http_rec.by_request_id("t-stream")
    assert (span.trace_id, span.parent_span_id, span.kind) == (TRACE_ID, PARENT, rx.SERVER)
    assert span.name == f"chat {MODEL}" and span.status_code == 0
    check_stages(http_rec, span, stream=True)
    assert span.resource["service.name"] == "deepinfer-server"
    # The request's log line names the trace, and its TTFT is the span's.
    line = log_line(srv, "t-stream")
    assert f"trace_id={TRACE_ID} " in line, line
    ttft_ms = float(re.search(r"ttft_ms=([\d.]+)", line).group(1))  # type: ignore[union-attr]
    assert abs(ttft_ms - span.attributes["gen_ai.latency.time_to_first_token"] * 1e3) < 0.01
    # Without a traceparent a new trace starts; a non-stream has no sse stage.
    assert chat(srv, "t-unary", stream=False).status_code == 200
    span = http_rec.by_request_id("t-unary")
    assert span.trace_id != TRACE_ID and span.parent_span_id == ""
    check_stages(http_rec, span, stream=False)
    assert span.trace_id in log_line(srv, "t-unary")
    m = re.search(r"^deepinfer_trace_spans_exported_total (\d+)", httpx.get(f"{srv.url}/metrics").text, re.M)
    assert m and int(m.group(1)) >= 2 * 11, "both requests' spans were exported"


def all_text(span: rx.Span) -> str:
    return " ".join(str(v) for v in [span.name, *span.attributes.values(), *span.events, span.status_message])


def test_every_door_has_its_gen_ai_attributes_and_no_text(make_server: MakeServer, http_rec: rx.Receiver) -> None:
    env = {**FAST, "OTEL_SERVICE_NAME": "svc-x", "OTEL_RESOURCE_ATTRIBUTES": "deployment.environment=test"}
    # Thinking off: in thinking mode the codec runs the model at its own temperature, which the span records.
    srv = make_server("--dp", "2", "--default-thinking", "off", "--otlp-traces-endpoint", http_rec.endpoint, env=env)
    sampling = {"max_tokens": 6, "temperature": 0.5, "top_p": 0.9}
    msgs = [{"role": "user", "content": f"say {CANARY}"}]
    calls: dict[str, tuple[str, dict[str, Any]]] = {
        "chat": ("/v1/chat/completions", {"messages": msgs, **sampling}),
        "chat-stream": ("/v1/chat/completions", {"messages": msgs, "stream": True, **sampling}),
        "completions": ("/v1/completions", {"prompt": f"say {CANARY}", **sampling}),
        "messages": ("/v1/messages", {"messages": msgs, **sampling}),
        "responses": ("/v1/responses", {"input": f"say {CANARY}", "max_output_tokens": 6, "temperature": 0.5,
                                        "top_p": 0.9, "stream": True}),
        "count_tokens": ("/v1/messages/count_tokens", {"messages": msgs}),
        "tokenize": ("/tokenize", {"prompt": f"say {CANARY}"}),
    }  # fmt: skip
    bodies = {}
    for rid, (path, body) in calls.items():
        r = httpx.post(f"{srv.url}{path}", json={"model": MODEL, **body}, headers={"x-request-id": rid}, timeout=30)
        assert r.status_code == 200, (rid, r.text)
        bodies[rid] = r.text
    operations = {"completions": "text_completion", "count_tokens": "count_tokens", "tokenize": "tokenize"}
    for rid in calls:
        span = http_rec.by_request_id(rid)
        a = span.attributes
        assert a["gen_ai.operation.name"] == operations.get(rid, "chat"), rid
        assert (a["http.response.status_code"], a["http.route"], span.status_code) == (200, calls[rid][0], 0), rid
        assert span.resource["service.name"] == "svc-x" and span.resource["deployment.environment"] == "test"
        # No prompt or output text anywhere: the prompt's canary, nor a piece of the answer.
        text = all_text(span)
        assert CANARY not in text, (rid, text)
        if rid in ("count_tokens", "tokenize"):
            continue
        assert (a["gen_ai.provider.name"], a["gen_ai.request.model"]) == ("deepseek", MODEL), rid
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (6, 0.5), rid
        assert 0 < a["gen_ai.request.top_p"] <= 1, rid  # as deepseek-recipe hands it to the engine
        assert a["gen_ai.response.id"] in bodies[rid], rid
        assert a["gen_ai.response.finish_reasons"] in (["length"], ["stop"]), rid
        assert a["gen_ai.usage.input_tokens"] > 0 and 1 <= a["gen_ai.usage.output_tokens"] <= 6, rid
        assert a["deepinfer.dp_rank"] in (0, 1) and a["deepinfer.request_id"] == rid
        check_stages(http_rec, span, stream="stream" in calls[rid][1])
    a = http_rec.by_request_id("chat").attributes
    usage = httpx.Response(200, text=bodies["chat"]).json()["usage"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a.get("gen_ai.usage.reasoning.output_tokens", 0) == usage.get("completion_tokens_details", {}).get(
        "reasoning_tokens", 0
    )
    answer = httpx.Response(200, text=bodies["chat"]).json()["choices"][0]["message"]
    for part in (answer.get("content") or "", answer.get("reasoning_content") or ""):
        if len(part) >= 6:
            assert all(part not in all_text(s) for s in http_rec.requests())


def test_refusals_and_disconnects_mark_the_span(make_server: MakeServer, http_rec: rx.Receiver) -> None:
    srv = make_server(
        "--dp",
        "1",
        "--max-num-seqs",
        "1",
        "--sim-decode-step-ms",
        "20",
        "--otlp-traces-endpoint",
        http_rec.endpoint,
        env=FAST,
    )
    body = {"model": MODEL, "stream": True, "max_tokens": 500, "ignore_eos": True, "messages": [{"role": "user",
            "content": "x"}]}  # fmt: skip
    url, h = f"{srv.url}/v1/chat/completions", {"x-request-id": "long"}
    with httpx.Client(timeout=30) as c, c.stream("POST", url, json=body, headers=h) as r:
        assert r.status_code == 200
        lines = r.iter_lines()  # kept: a dropped iterator closes the stream
        data = (ln for ln in lines if ln.startswith("data: "))
        next(data), next(data)  # the role chunk, then a token: its first token was read and written
        refused = chat(srv, "busy", stream=False, headers={"traceparent": TRACEPARENT})
        assert refused.status_code == 429
    # The client left mid-stream (the connection closed with the stream unread).
    span = http_rec.by_request_id("busy")
    assert (span.trace_id, span.parent_span_id) == (TRACE_ID, PARENT)
    # A refusal is the client's to handle, not a server failure: Unset, but visible as what it was.
    assert span.status_code == rx.UNSET and span.status_message == ""
    assert span.attributes["http.response.status_code"] == 429
    assert span.attributes["error.type"] == "rate_limit_exceeded" and "rejected" in span.events
    assert rx.Receiver.children(http_rec, span) == []
    assert f"trace_id={TRACE_ID} " in log_line(srv, "busy", "request refused")
    span = http_rec.by_request_id("long")
    assert span.status_code == rx.UNSET and span.attributes["http.response.status_code"] == 499
    assert span.attributes["error.type"] == "client_disconnect"
    assert span.attributes["deepinfer.client_disconnected"] is True and "client_disconnect" in span.events
    assert "sse" in [k.name for k in http_rec.children(span)]
    r = httpx.post(
        f"{srv.url}/v1/chat/completions",
        json={"model": "nope", "messages": [{"role": "user", "content": "x"}]},
        headers={"x-request-id": "nomodel"},
    )
    assert r.status_code == 404
    span = http_rec.by_request_id("nomodel")
    assert span.status_code == rx.UNSET and span.attributes["error.type"] == "model_not_found"
    assert span.attributes["http.response.status_code"] == 404
    assert "nope" not in all_text(span), "the client's model name is not recorded for a refusal"


def test_a_server_failure_is_an_error_and_a_client_error_is_not(make_server: MakeServer, http_rec: rx.Receiver) -> None:
    """OpenTelemetry's HTTP conventions for a server: Error for a 5xx only; a 4xx leaves the status Unset, with the
    status code and the error's code as `error.type`."""
    # 20 ms a token and a half-second deadline: a long request times out (504).
    srv = make_server(
        "--sim-decode-step-ms", "20", "--request-timeout", "0.5", "--otlp-traces-endpoint", http_rec.endpoint, env=FAST
    )
    bad = chat(srv, "bad", stream=False, temperature=9)
    assert bad.status_code == 400
    span = http_rec.by_request_id("bad")
    assert (span.status_code, span.attributes["http.response.status_code"]) == (rx.UNSET, 400)
    assert span.attributes["error.type"] == bad.json()["error"]["code"] == "invalid_request_error"
    slow = chat(srv, "slow", stream=False, max_tokens=200, ignore_eos=True)
    assert slow.status_code == 504
    span = http_rec.by_request_id("slow")
    assert (span.status_code, span.status_message) == (rx.ERROR, "504 timeout")
    assert (span.attributes["http.response.status_code"], span.attributes["error.type"]) == (504, "timeout")


def wait_until(what: str, done: Callable[[], bool], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def links(span: rx.Span) -> list[tuple[str, str, bool]]:
    return [(k.trace_id, k.span_id, k.sampled) for k in span.links]


def test_a_background_response_runs_in_a_trace_of_its_own_linked_to_its_post(
    make_server: MakeServer, http_rec: rx.Receiver
) -> None:
    srv = make_server(*STATE, "--otlp-traces-endpoint", http_rec.endpoint, env=FAST)
    c = srv.client()
    h = {"traceparent": TRACEPARENT, "x-request-id": "bg"}
    r = c.responses.create(model=MODEL, input=f"say {CANARY}", max_output_tokens=8, background=True, extra_headers=h)
    assert r.background and r.status in ("queued", "in_progress")
    wait_until("the run", lambda: c.responses.retrieve(r.id).status not in ("queued", "in_progress"))
    done = c.responses.retrieve(r.id)
    assert done.status in ("completed", "incomplete") and done.usage
    # The POST: a short SERVER span in the caller's trace, without stages (it never reached a rank).
    post = http_rec.by_request_id("bg")
    assert (post.trace_id, post.parent_span_id, post.status_code) == (TRACE_ID, PARENT, rx.UNSET)
    a = post.attributes
    assert (a["http.response.status_code"], a["gen_ai.response.id"], a["deepinfer.background"]) == (200, r.id, True)
    assert http_rec.children(post) == [] and post.links == []
    # The run: the root of a trace of its own, linked to the POST's span, with a request's attributes and stages.
    [run] = http_rec.roots("gen_ai.response.id", r.id)
    assert run.trace_id != TRACE_ID and links(run) == [(TRACE_ID, post.span_id, True)]
    assert (run.name, run.status_code) == (f"chat {MODEL}", rx.UNSET)
    a = run.attributes
    assert (a["deepinfer.background"], a["deepinfer.status_code"], a["deepinfer.request_id"]) == (True, 200, "bg")
    assert "http.route" not in a and "error.type" not in a
    assert (a["gen_ai.operation.name"], a["gen_ai.request.model"]) == ("chat", MODEL)
    assert a["gen_ai.usage.output_tokens"] == done.usage.output_tokens
    assert a["gen_ai.response.finish_reasons"] in (["length"], ["stop"])
    check_stages(http_rec, run, stream=True)
    assert abs(run.start_ns - post.start_ns) < 1e6, "the run starts when its POST arrived"
    assert CANARY not in all_text(run)
    # Streamed, the POST follows the run's events: its span ends with the last of them, whole.
    h = {"x-request-id": "bg-stream"}
    events = list(c.responses.create(model=MODEL, input="x", max_output_tokens=4, background=True, stream=True,
                                     extra_headers=h))  # fmt: skip
    rid = events[0].response.id  # type: ignore[union-attr]
    post = http_rec.by_request_id("bg-stream")
    assert "deepinfer.client_disconnected" not in post.attributes and post.attributes["gen_ai.response.id"] == rid
    [run] = http_rec.roots("gen_ai.response.id", rid)
    assert links(run) == [(post.trace_id, post.span_id, True)] and run.end_ns <= post.end_ns + 1000


def test_a_cancelled_run_says_so_and_is_no_error(make_server: MakeServer, http_rec: rx.Receiver) -> None:
    """A cancel stops a run from the server's side: `error.type` says `cancelled` (not the client disconnect its
    abort looks like to the request path), whether it was running or still waiting for the one slot."""
    srv = make_server(
        *STATE, "--max-num-seqs", "1", "--sim-decode-step-ms", "20", "--otlp-traces-endpoint", http_rec.endpoint,
        env=FAST,
    )  # fmt: skip
    c = srv.client()
    long = {
        "model": MODEL,
        "input": "x",
        "max_output_tokens": 2000,
        "background": True,
        "extra_body": {"ignore_eos": True},
    }
    running, waiting = c.responses.create(**long), c.responses.create(**long)  # type: ignore[call-overload]
    wait_until("the first run", lambda: c.responses.retrieve(running.id).status == "in_progress")
    for r in (waiting, running):
        assert c.responses.cancel(r.id).status == "cancelled"
    for r, reached_a_rank in ((running, True), (waiting, False)):
        [run] = http_rec.roots("gen_ai.response.id", r.id)
        a = run.attributes
        assert (run.status_code, a["deepinfer.status_code"], a["error.type"]) == (rx.UNSET, 499, "cancelled"), a
        assert "deepinfer.client_disconnected" not in a and run.events == []
        assert ("deepinfer.dp_rank" in a) == reached_a_rank


def test_each_batch_line_has_a_span_linked_to_the_request_that_created_the_batch(
    make_server: MakeServer, http_rec: rx.Receiver
) -> None:
    srv = make_server(*STATE, "--otlp-traces-endpoint", http_rec.endpoint, env=FAST)
    c = srv.client()
    body = {"model": MODEL, "messages": [{"role": "user", "content": CANARY}], "max_tokens": 4}
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body} for i in range(3)]
    lines.append({**lines[0], "custom_id": "bad", "body": {**body, "model": "no-such-model"}})
    text = "\n".join(json.dumps(x) for x in lines).encode()
    f = c.files.create(file=("in.jsonl", io.BytesIO(text)), purpose="batch")
    h = {"traceparent": TRACEPARENT, "x-request-id": "mkbatch"}
    b = c.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h", extra_headers=h)
    wait_until("the batch", lambda: c.batches.retrieve(b.id).status == "completed")
    done = c.batches.retrieve(b.id)
    assert done.output_file_id
    out = [json.loads(x) for x in c.files.content(done.output_file_id).text.splitlines()]
    request_ids = {x["custom_id"]: x["response"]["request_id"] for x in out}
    # The creating request's span, in the caller's trace: the one every line links to.
    create = http_rec.by_request_id("mkbatch")
    assert (create.trace_id, create.parent_span_id, create.name) == (TRACE_ID, PARENT, "create_batch")
    assert (create.attributes["http.route"], create.attributes["deepinfer.batch.id"]) == ("/v1/batches", b.id)
    spans = {s.attributes["deepinfer.batch.custom_id"]: s for s in http_rec.roots("deepinfer.batch.id", b.id, n=4)}
    assert sorted(spans) == ["bad", "r0", "r1", "r2"]
    assert len({s.trace_id for s in spans.values()} | {TRACE_ID}) == 5, "each line is a trace of its own"
    for custom_id, span in spans.items():
        assert links(span) == [(TRACE_ID, create.span_id, True)], custom_id
    for i in range(3):
        span = spans[f"r{i}"]
        a = span.attributes
        assert (span.name, span.status_code, a["deepinfer.status_code"]) == (f"chat {MODEL}", rx.UNSET, 200)
        assert a["deepinfer.request_id"] == request_ids[f"r{i}"] and a["gen_ai.usage.output_tokens"] > 0
        check_stages(http_rec, span, stream=False)
    bad = spans["bad"]
    assert (bad.status_code, bad.attributes["deepinfer.status_code"]) == (rx.UNSET, 404)
    assert bad.attributes["error.type"] == "model_not_found" and http_rec.children(bad) == []

    # Anthropic's Message Batches run on the same lane; without a traceparent the batch's POST starts a trace.
    reqs = [{"custom_id": "m0", "params": {**body, "max_tokens": 4}}]
    url = f"{srv.url}/v1/messages/batches"
    mb = httpx.post(url, json={"requests": reqs}, headers={"x-request-id": "mkmsg"}, timeout=30).json()
    ended = lambda: httpx.get(f"{url}/{mb['id']}", timeout=30).json()["processing_status"] == "ended"  # noqa: E731
    wait_until("the message batch", ended)
    create = http_rec.by_request_id("mkmsg")
    assert (create.parent_span_id, create.attributes["http.route"]) == ("", "/v1/messages/batches")
    [line] = http_rec.roots("deepinfer.batch.id", mb["id"])
    assert links(line) == [(create.trace_id, create.span_id, True)]
    assert (line.attributes["deepinfer.batch.custom_id"], line.name) == ("m0", f"chat {MODEL}")


def test_grpc_export_from_the_standard_variables(make_server: MakeServer, grpc_rec: rx.Receiver) -> None:
    env = {
        **FAST,
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": grpc_rec.endpoint,
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-tenant=abc",
    }
    srv = make_server(env=env)
    assert chat(srv, "g1", stream=True, headers={"traceparent": TRACEPARENT}).status_code == 200
    span = grpc_rec.by_request_id("g1")
    assert (span.trace_id, span.parent_span_id, span.name) == (TRACE_ID, PARENT, f"chat {MODEL}")
    check_stages(grpc_rec, span, stream=True)
    assert grpc_rec.headers[0].get("x-tenant") == "abc"
    assert "exporting traces over OTLP" in srv.log() and 'protocol="grpc"' in srv.log()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when this returns: nothing listens there


def metric(srv: Server, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", httpx.get(f"{srv.url}/metrics").text, re.M)
    assert m, name
    return float(m.group(1))


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_an_unreachable_collector_drops_spans_and_costs_requests_nothing(
    make_server: MakeServer, protocol: str
) -> None:
    env = {**FAST, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": protocol}
    srv = make_server("--otlp-traces-endpoint", f"http://127.0.0.1:{closed_port()}/v1/traces", env=env)
    slowest = 0.0
    for i in range(20):
        t0 = time.perf_counter()
        assert chat(srv, f"u{i}", stream=i % 2 == 0).status_code == 200
        slowest = max(slowest, time.perf_counter() - t0)
    assert slowest < 1.0, "a request waited for the exporter"
    deadline = time.monotonic() + 30
    while metric(srv, "deepinfer_trace_spans_dropped_total") < 20 * 11:
        assert time.monotonic() < deadline, srv.log()[-2000:]
        time.sleep(0.1)
    assert metric(srv, "deepinfer_trace_spans_exported_total") == 0
    assert chat(srv, "after", stream=False).status_code == 200
    time.sleep(0.5)
    assert srv.log().count("cannot export traces") == 1, srv.log()[-3000:]


def test_sampling_follows_the_standard_variables(make_server: MakeServer, http_rec: rx.Receiver) -> None:
    env = {**FAST, "OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0"}
    srv = make_server(*STATE, "--otlp-traces-endpoint", http_rec.endpoint, env=env)
    unsampled_parent = f"00-{TRACE_ID[:-4]}beef-{PARENT}-00"
    for rid, h in (("root", {}), ("off", {"traceparent": unsampled_parent}), ("on", {"traceparent": TRACEPARENT})):
        assert chat(srv, rid, stream=False, headers=h).status_code == 200
    assert http_rec.by_request_id("on").trace_id == TRACE_ID  # a sampled parent is followed
    # A background run is a new root, but a parent-based sampler follows the request that created it.
    c = srv.client()
    ids = {}
    for rid, tp in (("bg-off", unsampled_parent), ("bg-on", TRACEPARENT)):
        h = {"traceparent": tp, "x-request-id": rid}
        ids[rid] = c.responses.create(model=MODEL, input="x", max_output_tokens=4, background=True, extra_headers=h).id
    for rid in ids.values():
        wait_until("the runs", lambda rid=rid: c.responses.retrieve(rid).status not in ("queued", "in_progress"))
    [run] = http_rec.roots("gen_ai.response.id", ids["bg-on"])
    assert links(run) == [(TRACE_ID, http_rec.by_request_id("bg-on").span_id, True)]
    time.sleep(0.5)
    assert {s.attributes["deepinfer.request_id"] for s in http_rec.requests()} == {"on", "bg-on"}
    assert not http_rec.roots("gen_ai.response.id", ids["bg-off"], n=0), "its creator was not sampled"
    assert "trace_id=" in log_line(srv, "root"), "an unsampled request still names its trace"


def test_off_by_default_exports_nothing_and_logs_no_trace_id(server: Server) -> None:
    assert chat(server, "plain", stream=False).status_code == 200
    assert "trace_id" not in log_line(server, "plain")
    assert "exporting traces" not in server.log()
    assert metric(server, "deepinfer_trace_spans_exported_total") == 0
    assert metric(server, "deepinfer_trace_spans_dropped_total") == 0


@pytest.mark.parametrize(
    ("flag", "env", "want"),
    [
        (None, {}, (None, None)),
        ("http://c:4318/v1/traces", {}, ("http://c:4318/v1/traces", "http/protobuf")),
        ("grpc://c:4317", {}, ("http://c:4317", "grpc")),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}, ("http://c:4318/v1/traces", "http/protobuf")),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
         ("http://c:4317", "grpc")),
        (None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://b", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"},
         ("http://t/x", "http/protobuf")),
        ("http://flag/v1/traces", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env"},
         ("http://flag/v1/traces", "http/protobuf")),
    ],
)  # fmt: skip
def test_endpoint_and_protocol_come_from_the_flag_then_the_variables(
    monkeypatch: pytest.MonkeyPatch, flag: str | None, env: dict[str, str], want: tuple[str | None, str | None]
) -> None:
    from deepinfer_server import trace_args

    for var in ("ENDPOINT", "TRACES_ENDPOINT", "PROTOCOL", "TRACES_PROTOCOL"):
        monkeypatch.delenv(f"OTEL_EXPORTER_OTLP_{var}", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    args = argparse.Namespace(otlp_traces_endpoint=flag)
    assert trace_args.resolve(args) is None
    assert (args.otlp_traces_endpoint, args.otlp_traces_protocol) == want
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/json")
    assert "not supported" in (trace_args.resolve(argparse.Namespace(otlp_traces_endpoint="http://c")) or "")
