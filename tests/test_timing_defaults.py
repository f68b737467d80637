"""The timing settings that are not limits (`--drain-timeout` and its kin: the operator tunes them, no client
controls them) are declared once, in rust/timing.rs (`_native.TIMING_DEFAULTS`): the flags take their defaults
from it, `ServerConfig::for_tests` starts from it (checked by its Rust test), and this file checks the flags and
the README's options table against it."""

from __future__ import annotations

import ast
from pathlib import Path

from deepinfer_server._native import TIMING_DEFAULTS
from deepinfer_server.cli import build_parser, check_args
from test_limits_table import options_rows, quantities

ROOT = Path(__file__).resolve().parent.parent
GATHER = "--dispatch-gather-ms"  # its default depends on the engine: the declared one when the ranks step together


def test_every_timing_flag_defaults_to_its_declared_value() -> None:
    assert set(TIMING_DEFAULTS) == {
        "--exit-on-rank-failure",
        "--drain-timeout",
        "--sse-keep-alive",
        "--stream-interval-ms",
        "--watchdog-timeout",
        GATHER,
    }
    actions = {a.option_strings[0]: a for a in build_parser()._actions if a.option_strings}
    for flag, default in TIMING_DEFAULTS.items():
        assert actions[flag].type is float, flag
        assert actions[flag].default == (None if flag == GATHER else default), flag


def test_the_gather_window_is_the_declared_one_when_the_ranks_step_together() -> None:
    together = build_parser().parse_args(["--sim-lockstep"])
    alone = build_parser().parse_args([])
    assert check_args(together) is None and check_args(alone) is None
    assert (together.dispatch_gather_ms, alone.dispatch_gather_ms) == (TIMING_DEFAULTS[GATHER], 0.0)


def test_the_flags_write_no_timing_default_by_hand() -> None:
    # A float literal as a timing flag's default would be a second source again.
    tree = ast.parse((ROOT / "python" / "deepinfer_server" / "cli.py").read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
            continue
        if node.args[0].value in TIMING_DEFAULTS:
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            assert not isinstance(default, ast.Constant) or default.value is None, node.args[0].value


def test_the_readme_gives_each_timing_flag_its_declared_default() -> None:
    rows = options_rows()
    for flag, default in TIMING_DEFAULTS.items():
        found = [(flags, cell) for flags, cell in rows if flag in flags]
        assert len(found) == 1, f"{flag}: {len(found)} rows of the README's options table name it"
        flags, cell = found[0]
        parts = cell.split("; ")
        part = parts[flags.index(flag)] if len(parts) == len(flags) else cell
        assert default in quantities(part), f"{flag}: README says {part!r}, declared {default}"
