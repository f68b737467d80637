"""OTLP trace receivers for the tests and the tracing bench: an HTTP one (POST /v1/traces, ExportTraceServiceRequest
protobuf) and a gRPC TraceService, both decoding with the `opentelemetry-proto` package. What they received is kept
as plain `Span` records."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

UNSET = 0  # Status.STATUS_CODE_UNSET
ERROR = 2  # Status.STATUS_CODE_ERROR
INTERNAL = 1  # Span.SPAN_KIND_INTERNAL
SERVER = 2  # Span.SPAN_KIND_SERVER


def value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


@dataclass
class Link:
    trace_id: str
    span_id: str
    sampled: bool


@dataclass
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int
    status_message: str
    events: list[str]
    resource: dict[str, Any]
    scope: str
    links: list[Link] = field(default_factory=list)

    @property
    def ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


@dataclass
class Receiver:
    """What a receiver got: every span, and every export's headers."""

    spans: list[Span] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    endpoint: str = ""
    stop: Callable[[], None] = lambda: None

    def take(self, req: trace_service_pb2.ExportTraceServiceRequest, headers: dict[str, str]) -> None:
        got = []
        for rs in req.resource_spans:
            resource = {kv.key: value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    got.append(
                        Span(
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: value(kv.value) for kv in s.attributes},
                            status_code=s.status.code,
                            status_message=s.status.message,
                            events=[e.name for e in s.events],
                            resource=resource,
                            scope=ss.scope.name,
                            links=[Link(k.trace_id.hex(), k.span_id.hex(), bool(k.flags & 1)) for k in s.links],
                        )
                    )
        with self.lock:
            self.spans.extend(got)
            self.headers.append(headers)

    def requests(self) -> list[Span]:
        """The request spans (SERVER), in arrival order."""
        with self.lock:
            return [s for s in self.spans if s.kind == SERVER]

    def roots(self, key: str, value: Any, n: int = 1, timeout: float = 20.0) -> list[Span]:
        """The `n` root spans of work a request left behind (INTERNAL, no parent) whose attribute `key` is `value`."""

        def found() -> list[Span]:
            with self.lock:
                return [
                    s
                    for s in self.spans
                    if s.kind == INTERNAL and not s.parent_span_id and s.attributes.get(key) == value
                ]

        deadline = time.monotonic() + timeout
        while len(spans := found()) < n:
            assert time.monotonic() < deadline, f"{len(spans)} of {n} spans with {key}={value!r}"
            time.sleep(0.05)
        return spans

    def children(self, parent: Span) -> list[Span]:
        with self.lock:
            kids = [s for s in self.spans if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id]
        return sorted(kids, key=lambda s: (s.start_ns, s.end_ns))

    def wait(self, pred: Callable[[list[Span]], bool], timeout: float = 20.0) -> list[Span]:
        deadline = time.monotonic() + timeout
        while True:
            spans = self.requests()
            if pred(spans):
                return spans
            assert time.monotonic() < deadline, f"timed out waiting for spans; have {[s.name for s in spans]}"
            time.sleep(0.05)

    def by_request_id(self, request_id: str, timeout: float = 20.0) -> Span:
        def found(spans: list[Span]) -> bool:
            return any(s.attributes.get("deepinfer.request_id") == request_id for s in spans)

        spans = self.wait(found, timeout)
        return next(s for s in spans if s.attributes.get("deepinfer.request_id") == request_id)


def http_receiver() -> Receiver:
    rec = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            req = trace_service_pb2.ExportTraceServiceRequest()
            req.ParseFromString(body)
            ok = self.path == "/v1/traces" and self.headers.get("content-type") == "application/x-protobuf"
            if ok:
                rec.take(req, {k.lower(): v for k, v in self.headers.items()})
            out = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200 if ok else 404)
            self.send_header("content-type", "application/x-protobuf")
            self.send_header("content-length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: Any) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    rec.endpoint = f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces"

    def stop() -> None:
        httpd.shutdown()
        httpd.server_close()

    rec.stop = stop
    return rec


def grpc_receiver() -> Receiver:
    import grpc

    rec = Receiver()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            rec.take(request, dict(context.invocation_metadata()))
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    rec.endpoint = f"http://127.0.0.1:{port}"
    rec.stop = lambda: server.stop(0)
    return rec
