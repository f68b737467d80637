"""Options of the server's edge as clients, proxies and browsers see it: TLS (mutual TLS included), a Unix socket
instead of TCP, a path prefix for a proxy, and CORS. vLLM's flag names and meanings throughout.

Every file and path is checked here, before any rank starts loading (minutes with DeepInfer): a certificate or key
that does not load, with the very loader the server uses, is a one-line error naming the file.

CORS is off unless the operator names the origins that may call the API from a browser: without it a web page can
only send the "simple" requests that need no preflight, and the JSON routes refuse those (their Content-Type is
not JSON), so no page a user of the host opens can drive the server.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
from pathlib import Path

from deepinfer_server._native import CorsConfig, EdgeConfig, TlsFiles

OPENAPI = Path(__file__).with_name("openapi.json")
# A Unix socket path must fit sockaddr_un's sun_path (108 bytes with its terminating NUL).
MAX_UDS_BYTES = 107
# A root path: segments of URL-safe characters, nothing a proxy or the router would re-encode.
ROOT_PATH = re.compile(r"^(/[A-Za-z0-9._~!$&'()*+,;=:@%-]+)+$")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_listen_arguments(parser.add_argument_group("TLS, Unix socket, path prefix"))
    p = parser.add_argument_group("browsers (console, CORS)")
    p.add_argument(
        "--console",
        choices=("on", "off"),
        default="on",
        help="The built-in console at / (live status, batch progress, a playground), as llama.cpp's server has "
        "one: on (the default) or off. Its page needs no key to load; with --api-key it asks for the key, keeps it "
        "in the browser tab only, and /console/status answers nothing without it.",
    )
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


def add_listen_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--ssl-certfile",
        metavar="PATH",
        help="Serve HTTPS with this PEM certificate chain (with --ssl-keyfile). The files are checked every 2 s and "
        "reloaded when they change: new connections get the new certificate, open ones keep theirs, and files "
        "that do not load leave the current ones in use (logged).",
    )
    p.add_argument("--ssl-keyfile", metavar="PATH", help="The PEM private key of --ssl-certfile (unencrypted).")
    p.add_argument(
        "--ssl-ca-certs",
        metavar="PATH",
        help="PEM CA certificates that client certificates must chain to (mutual TLS, with --ssl-cert-reqs 1 or 2).",
    )
    p.add_argument(
        "--ssl-cert-reqs",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="Client certificates, as Python's ssl module numbers it: 0 none asked for, 1 optional (verified "
        "against --ssl-ca-certs when sent), 2 required (a client without one fails the handshake).",
    )
    p.add_argument(
        "--uds",
        metavar="PATH",
        help="Serve on this Unix socket instead of TCP (--host and --port are then ignored). The socket gets mode "
        "0660; a stale socket file is replaced (not one a live server listens on, nor any other file), and the "
        "file is removed when the server stops.",
    )
    p.add_argument(
        "--root-path",
        metavar="PREFIX",
        help="Path prefix of a proxy in front (e.g. /deepinfer): every route, /openapi.json and /metrics answer "
        "under it, and without it too, so a proxy that strips the prefix and one that forwards it both work. "
        "/openapi.json names it in 'servers'.",
    )


def _split(items: list[str]) -> list[str]:
    return [s.strip() for item in items for s in item.split(",") if s.strip()]


def resolve(args: argparse.Namespace) -> str | None:
    """Check and normalize the edge options; an error message, or None."""
    return resolve_tls(args) or resolve_uds(args) or resolve_root_path(args) or resolve_cors(args)


def resolve_tls(args: argparse.Namespace) -> str | None:
    """The TLS files load (as the server loads them) and the client-certificate options agree."""
    if args.ssl_certfile is None and args.ssl_keyfile is None:
        if args.ssl_ca_certs is not None or args.ssl_cert_reqs:
            return "--ssl-ca-certs and --ssl-cert-reqs need --ssl-certfile and --ssl-keyfile"
        return None
    if args.ssl_certfile is None or args.ssl_keyfile is None:
        return "--ssl-certfile and --ssl-keyfile go together"
    if args.ssl_cert_reqs and args.ssl_ca_certs is None:
        return f"--ssl-cert-reqs {args.ssl_cert_reqs} needs --ssl-ca-certs (the CA client certificates chain to)"
    if args.ssl_ca_certs is not None and not args.ssl_cert_reqs:
        # vLLM would take it and verify nothing: an operator who gives a CA means to check clients.
        return "--ssl-ca-certs checks client certificates only with --ssl-cert-reqs 1 (optional) or 2 (required)"
    for flag in ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs"):
        if getattr(args, flag) is not None:
            setattr(args, flag, os.path.abspath(getattr(args, flag)))
    from deepinfer_server import _native

    try:
        _native.check_tls(args.ssl_certfile, args.ssl_keyfile, args.ssl_ca_certs, args.ssl_cert_reqs)
    except ValueError as e:
        return str(e)
    return None


def resolve_uds(args: argparse.Namespace) -> str | None:
    """The socket path fits, its directory exists, and nothing but a socket is there already."""
    path = args.uds
    if path is None:
        return None
    if not path or len(os.fsencode(path)) > MAX_UDS_BYTES:
        return f"--uds {path!r}: a socket path is 1 to {MAX_UDS_BYTES} bytes long"
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return f"--uds {path}: the directory {parent} does not exist"
    if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
        return f"--uds {path}: exists and is not a socket; not replacing it"
    return None


def resolve_root_path(args: argparse.Namespace) -> str | None:
    """`/prefix` without a trailing slash, or None for none (empty, or /)."""
    prefix = (args.root_path or "").rstrip("/")
    if not prefix:
        args.root_path = None
        return None
    if not ROOT_PATH.match(prefix):
        return f"--root-path {args.root_path!r}: a path such as /deepinfer (URL-safe characters, no query)"
    first = prefix.split("/")[1]
    if first in routed_segments():
        # The prefix is stripped before routing: /v1 would turn /v1/models into /models.
        return f"--root-path {prefix}: /{first} is a path the server routes itself; pick another prefix"
    args.root_path = prefix
    return None


def routed_segments() -> set[str]:
    """First segments of the server's own paths (openapi.json lists the routes)."""
    paths = json.loads(OPENAPI.read_text(encoding="utf-8"))["paths"] if OPENAPI.is_file() else {}
    return {p.split("/")[1] for p in paths} | {"v1", "openapi.json", "health", "metrics", "console"}


def resolve_cors(args: argparse.Namespace) -> str | None:
    """Normalize the lists (space or comma separated)."""
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


def edge_config(args: argparse.Namespace) -> EdgeConfig:
    """How clients reach the Rust front end (rust/edge/mod.rs's `EdgeConfig`)."""
    tls = None
    if args.ssl_certfile is not None:
        tls = TlsFiles(
            certfile=args.ssl_certfile,
            keyfile=args.ssl_keyfile,
            ca_certs=args.ssl_ca_certs,
            cert_reqs=args.ssl_cert_reqs,
        )
    return EdgeConfig(tls=tls, uds=args.uds, root_path=args.root_path)


def cors_config(args: argparse.Namespace) -> CorsConfig:
    """Which browser origins may call the API (rust/config.rs)."""
    return CorsConfig(
        allowed_origins=[o.rstrip("/") for o in args.allowed_origins],
        allowed_methods=args.allowed_methods,
        allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials,
    )
