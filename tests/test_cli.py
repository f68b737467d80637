"""CLI: EP/DP/CP rules (DP x CP = EP, CP derived when omitted) and clear exits for bad arguments."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

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
    ],
)
def test_bad_arguments_exit_2_with_a_clear_message(argv: list[str], message: str) -> None:
    r = subprocess.run([sys.executable, "-m", "deepinfer_server", *argv], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert message in r.stderr


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
