"""CLI: EP/DP/CP rules (DP x CP = EP, CP derived when omitted) and clear exits for bad arguments."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from deepinfer_server import limits_args
from deepinfer_server.cli import build_parser, check_args

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("argv", "ep", "dp", "cp"),
    [
        ([], 1, 1, 1),
        (["--ep", "8"], 8, 1, 8),
        (["--ep", "8", "--dp", "8"], 8, 8, 1),
        (["--ep", "8", "--dp", "2"], 8, 2, 4),
        (["--ep", "8", "--cp", "4"], 8, 2, 4),
        (["--dp", "2"], 2, 2, 1),
        (["--expert-parallel-size", "4", "--data-parallel-size", "2", "--context-parallel-size", "2"], 4, 2, 2),
    ],
)
def test_parallel_sizes(argv: list[str], ep: int, dp: int, cp: int) -> None:
    args = build_parser().parse_args(argv)
    assert check_args(args) is None
    assert (args.expert_parallel_size, args.data_parallel_size, args.context_parallel_size) == (ep, dp, cp)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--ep", "8", "--dp", "3"], "not divisible"),
        (["--ep", "4", "--dp", "2", "--cp", "4"], "DP x CP must equal EP"),
        (["--dp", "0"], "at least 1"),
        (["--max-num-seqs", "64", "--max-num-batched-tokens", "8"], "--max-num-batched-tokens"),
        (["--engine", "deepinfer"], "MODEL is required"),
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
        (["--stream-interval-ms", "-1"], "--stream-interval-ms must not be negative"),
        (["--client-timeout", "0"], "--client-timeout must be positive"),
        (["--malloc", "jemalloc"], "invalid choice: 'jemalloc'"),
        (["--allowed-media-networks", "10.0.0.0/33"], "--allowed-media-networks: '10.0.0.0/33' is not a CIDR"),
        (["--allowed-media-domains", "https://x.example"], "--allowed-media-domains: 'https://x.example'"),
        (["--allowed-local-media-path", "/nonexistent/images"], "is not an existing directory"),
        (["--media-fetch-timeout", "0"], "--media-fetch-timeout must be positive"),
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(argv: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "deepinfer_server", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr


def test_media_options_reach_the_server_config(tmp_path: Path) -> None:
    from deepinfer_server.media_args import server_config

    argv = ["--allowed-media-domains", "a.example,*.cdn.example", "b.example", "--allowed-media-networks", "10.0.0.0/8"]
    args = build_parser().parse_args(
        [*argv, "--allowed-local-media-path", str(tmp_path), "--max-images-per-request", "0"]
    )
    assert check_args(args) is None
    conf = server_config(args)
    limits = limits_args.server_config(args, 1024)
    assert conf.allowed_media_domains == ["a.example", "*.cdn.example", "b.example"]
    assert conf.allowed_media_networks == ["10.0.0.0/8"]
    assert (conf.allowed_local_media_path, limits.max_images_per_request) == (str(tmp_path.resolve()), 0)
    defaults = server_config(_checked([]))
    assert (
        defaults.allowed_media_domains,
        defaults.allowed_media_networks,
        defaults.allow_private_media_urls,
        defaults.allowed_local_media_path,
    ) == ([], [], False, None)
    for bad in (["--allowed-media-networks", "10.0.0.0/255.0.0.0"], ["--allowed-media-domains", "a.*.example"]):
        assert check_args(build_parser().parse_args(bad)) is not None, bad


def _checked(argv: list[str]) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    assert check_args(args) is None
    return args


def test_bundled_tokenizer_rebuilds_identically(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    if tokenizers.__version__ != "0.23.3":
        pytest.skip(f"the bundled tokenizer was built with tokenizers 0.23.3, not {tokenizers.__version__}")
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "build_tokenizer.py"), str(tmp_path)], check=True, capture_output=True
    )
    bundled = ROOT / "python" / "deepinfer_server" / "tokenizer"
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (bundled / name).read_bytes(), name


@pytest.mark.parametrize(
    ("argv", "gather_ms"),
    [
        ([], 0.0),  # ranks that step on their own: nothing to gather for
        (["--dp", "2", "--sim-lockstep"], 20.0),
        (["--dp", "8", "--sim-profile", "8xb200"], 20.0),  # the profile steps the ranks together
        (["--engine", "deepinfer", "/models/deepseek-v4.1-flash"], 20.0),
        (["--dp", "2", "--sim-lockstep", "--dispatch-gather-ms", "0"], 0.0),
        (["--dispatch-gather-ms", "5"], 5.0),
    ],
)
def test_the_gather_is_on_by_default_only_where_ranks_step_together(argv: list[str], gather_ms: float) -> None:
    args = build_parser().parse_args(argv)
    assert check_args(args) is None
    assert args.dispatch_gather_ms == gather_ms
    assert (args.max_long_partial_prefills, args.long_prefill_token_threshold) == (2, 4096)


@pytest.mark.parametrize("bad", [["--dispatch-gather-ms", "-1"], ["--dispatch-gather-ms", "5000"]])
def test_gather_window_out_of_range(bad: list[str]) -> None:
    assert check_args(build_parser().parse_args(bad)) is not None
