"""OpenTelemetry traces: where to export them (vLLM's `--otlp-traces-endpoint`, or the standard `OTEL_EXPORTER_OTLP_*`
variables) and over which protocol; what the Rust front end is handed (rust/trace).

Off unless an endpoint is set. The rest of the standard variables are read where they apply: the sampler
(`OTEL_TRACES_SAMPLER`, `OTEL_TRACES_SAMPLER_ARG`), the resource (`OTEL_SERVICE_NAME`, default `deepinfer-server`;
`OTEL_RESOURCE_ATTRIBUTES`), the exporter's headers and timeout (`OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`,
`..._TIMEOUT`) and the batching (`OTEL_BSP_*`) by the Rust side, as OpenTelemetry's SDKs read them.
"""

from __future__ import annotations

import argparse
import os
from urllib.parse import urlsplit

PROTOCOLS = ("http/protobuf", "grpc")


def add_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="Export OpenTelemetry traces over OTLP to this URL (vLLM's flag): one span per request with a child per "
        "stage and the gen_ai attributes, never prompt or output text. Default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, "
        "else $OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/traces over HTTP); unset, tracing is off and costs nothing. The "
        "protocol is $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL or $OTEL_EXPORTER_OTLP_PROTOCOL: http/protobuf (the "
        "default; e.g. http://collector:4318/v1/traces) or grpc (e.g. http://collector:4317; a grpc:// URL "
        "implies it). Sampling: $OTEL_TRACES_SAMPLER and $OTEL_TRACES_SAMPLER_ARG (parentbased_always_on "
        "by default).",
    )


def _env(name: str) -> str | None:
    v = os.environ.get(name, "").strip()
    return v or None


def resolve(args: argparse.Namespace) -> str | None:
    """Settle the endpoint and protocol into `args.otlp_traces_endpoint` / `args.otlp_traces_protocol`; an error
    message, or None."""
    protocol = _env("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or _env("OTEL_EXPORTER_OTLP_PROTOCOL")
    endpoint = args.otlp_traces_endpoint or _env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = None if endpoint else _env("OTEL_EXPORTER_OTLP_ENDPOINT")
    url = endpoint or base
    args.otlp_traces_protocol = None
    if url is None:
        args.otlp_traces_endpoint = None
        return None
    scheme = urlsplit(url).scheme
    if scheme == "grpc":  # vLLM's examples write grpc://host:4317
        url = "http" + url[len("grpc") :]
        protocol = protocol or "grpc"
    elif scheme not in ("http", "https"):
        return f"the OTLP traces endpoint must be an http://, https:// or grpc:// URL, got {url!r}"
    protocol = protocol or "http/protobuf"
    if protocol not in PROTOCOLS:
        return f"OTLP protocol {protocol!r} is not supported (use one of {', '.join(PROTOCOLS)})"
    if base is not None and protocol != "grpc":
        # The spec: a base endpoint gets the signal's path over HTTP; a signal endpoint is taken as it is.
        url = url.rstrip("/") + "/v1/traces"
    args.otlp_traces_endpoint, args.otlp_traces_protocol = url, protocol
    return None


def server_config(args: argparse.Namespace) -> tuple[str, str] | None:
    """What the Rust front end takes (rust/config.rs): the endpoint and its protocol, or None when tracing is off."""
    if args.otlp_traces_endpoint is None:
        return None
    return (args.otlp_traces_endpoint, args.otlp_traces_protocol)
