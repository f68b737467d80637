"""Image input options: where the server may fetch images from, and how much. The fetcher is Rust's
(rust/media); this module declares its flags, checks them at start-up and hands them over."""

from __future__ import annotations

import argparse
import ipaddress
import os

from deepinfer_server import limits_args
from deepinfer_server._native import MediaConfig


def add_arguments(p: argparse._ArgumentGroup) -> None:
    p.add_argument(
        "--allowed-media-domains",
        nargs="+",
        default=[],
        metavar="HOST",
        help="Hosts image URLs may name, space or comma separated, matched case-insensitively on every redirect "
        "hop too; '*.example.com' matches the subdomains of example.com (not example.com itself). Empty: any host. "
        "Without it a client can make the server fetch from any public address.",
    )
    p.add_argument(
        "--allow-private-media-urls",
        action="store_true",
        help="Also fetch images from loopback, private (RFC 1918, CGNAT, fc00::/7) and link-local addresses. By "
        "default they are refused, since a client could otherwise reach services behind the server (SSRF). "
        "Cloud-metadata addresses (169.254.169.254, fd00:ec2::254, ...) stay refused.",
    )
    p.add_argument(
        "--allowed-media-networks",
        nargs="+",
        default=[],
        metavar="CIDR",
        help="Networks images may be fetched from even though not public, e.g. 10.1.2.0/24 for an internal image "
        "store: the precise alternative to --allow-private-media-urls. The only way to allow a cloud-metadata or "
        "reserved address.",
    )
    p.add_argument(
        "--allowed-local-media-path",
        default=None,
        metavar="DIR",
        help="Serve file:// image URLs from files under DIR (symlinks resolved, no escape above it). Unset: "
        "file:// URLs are refused, since they would let a client read the server's files.",
    )

    limits_args.add_declared(p, "media")  # the fetch timeout, and how many and how large images may be


def _split(items: list[str]) -> list[str]:
    return [s.strip() for item in items for s in item.split(",") if s.strip()]


def _domain_error(entry: str) -> str | None:
    host = entry.strip().rstrip(".").strip("[]").lower()
    if host.startswith("*."):
        host = host[2:]
    try:
        ipaddress.ip_address(host)
        return None
    except ValueError:
        pass
    if not host or any(c in host for c in "/@ :*"):
        return f"--allowed-media-domains: {entry!r} is not a host name (no scheme, port or path; '*.' only in front)"
    return None


def resolve(args: argparse.Namespace) -> str | None:
    """Check and normalize the media options in place. Returns an error message, or None."""
    args.allowed_media_domains = _split(args.allowed_media_domains)
    args.allowed_media_networks = _split(args.allowed_media_networks)
    for entry in args.allowed_media_domains:
        if err := _domain_error(entry):
            return err
    for net in args.allowed_media_networks:
        try:
            # A prefix length, not a netmask: the Rust side parses only that form.
            if "/" in net and not net.partition("/")[2].isdigit():
                raise ValueError(net)
            ipaddress.ip_network(net, strict=False)
        except ValueError:
            return f"--allowed-media-networks: {net!r} is not a CIDR such as 10.0.0.0/8 or fd00::/8"
    path = args.allowed_local_media_path
    if path is not None:
        if not os.path.isdir(path):
            return f"--allowed-local-media-path: {path!r} is not an existing directory"
        args.allowed_local_media_path = os.path.realpath(path)
    if not args.media_fetch_timeout > 0:
        return "--media-fetch-timeout must be positive"
    if args.max_images_per_request < 0:
        return "--max-images-per-request must not be negative"
    if args.max_image_bytes < 1 or args.max_image_total_bytes < 1:
        return "--max-image-bytes and --max-image-total-bytes must be at least 1"
    return None


def server_config(args: argparse.Namespace) -> MediaConfig:
    """Where the Rust server may fetch images from (rust/config.rs; how many and how large are `limits_args`')."""
    return MediaConfig(
        allowed_media_domains=args.allowed_media_domains,
        allowed_media_networks=args.allowed_media_networks,
        allow_private_media_urls=args.allow_private_media_urls,
        allowed_local_media_path=args.allowed_local_media_path,
    )
