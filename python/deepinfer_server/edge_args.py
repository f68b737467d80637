"""Options of the server's edge as browsers and proxies see it: CORS (vLLM's flag names).

CORS is off unless the operator names the origins that may call the API from a browser: without it a web page can
only send the "simple" requests that need no preflight, and the JSON routes refuse those (their Content-Type is
not JSON), so no page a user of the host opens can drive the server.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--allowed-origins",
        nargs="+",
        default=[],
        metavar="ORIGIN",
        help="Browser origins allowed to call the API (CORS), e.g. https://app.example.com, or * for any. Unset: "
        "CORS is off, preflights get 405, and no response carries CORS headers.",
    )
    p.add_argument(
        "--allowed-methods",
        nargs="+",
        default=["GET", "POST", "OPTIONS"],
        metavar="METHOD",
        help="Methods allowed to those origins (with --allowed-origins).",
    )
    p.add_argument(
        "--allowed-headers",
        nargs="+",
        default=["authorization", "content-type", "x-api-key", "anthropic-version", "anthropic-beta", "x-request-id"],
        metavar="HEADER",
        help="Request headers allowed to those origins (with --allowed-origins), or * for any.",
    )
    p.add_argument(
        "--allow-credentials",
        action="store_true",
        help="Let those origins send credentials (cookies, HTTP authentication): needs explicit origins and headers, "
        "not *.",
    )


def _split(items: list[str]) -> list[str]:
    return [s.strip() for item in items for s in item.split(",") if s.strip()]


def resolve(args: argparse.Namespace) -> str | None:
    """Normalize the lists (space or comma separated); an error message, or None."""
    args.allowed_origins = _split(args.allowed_origins)
    args.allowed_methods = [m.upper() for m in _split(args.allowed_methods)]
    args.allowed_headers = [h.lower() for h in _split(args.allowed_headers)]
    for origin in args.allowed_origins:
        if origin != "*" and not origin.startswith(("http://", "https://")):
            return f"--allowed-origins: {origin!r} is not an origin (scheme://host[:port]) or *"
        if origin != "*" and origin.rstrip("/").count("/") > 2:
            return f"--allowed-origins: {origin!r} has a path; an origin is scheme://host[:port]"
    if "*" in args.allowed_origins and len(args.allowed_origins) > 1:
        return "--allowed-origins: * stands alone"
    if args.allow_credentials and ("*" in args.allowed_origins or "*" in args.allowed_headers):
        return "--allow-credentials needs explicit --allowed-origins and --allowed-headers (browsers refuse * there)"
    if args.allowed_origins and not args.allowed_methods:
        return "--allowed-methods must name at least one method"
    return None


def server_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "allowed_origins": [o.rstrip("/") for o in args.allowed_origins],
        "allowed_methods": args.allowed_methods,
        "allowed_headers": args.allowed_headers,
        "allow_credentials": args.allow_credentials,
    }
