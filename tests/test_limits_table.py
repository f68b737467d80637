"""Every limit is declared once, in rust/limits (`_native.LIMITS`): the flags are built from it, and this file checks
what is written by hand against it: the README's options table, the grammar's own defaults, and the flags'."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deepinfer_server import _native, limits_args
from deepinfer_server._native import Limits
from deepinfer_server.cli import build_parser
from deepinfer_server.grammar import GrammarLimits

ROOT = Path(__file__).resolve().parent.parent
SETTABLE = [limit for limit in _native.LIMITS if limit.flag is not None]
UNITS = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
QUANTITY = re.compile(r"(\d+(?:\.\d+)?)\s*(KiB|MiB|GiB)?")


def options_rows() -> list[tuple[list[str], str]]:
    """The README's options table: each row's flags (in its first cell) and its Default cell."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text.split("\n## Options\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in table.splitlines():
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        if len(cells) == 3 and cells[0].startswith("`--"):
            rows.append((re.findall(r"`(--[a-z0-9-]+)[^`]*`", cells[0]), cells[1]))
    return rows


def quantities(cell: str) -> set[float]:
    return {float(n) * UNITS.get(unit, 1) for n, unit in QUANTITY.findall(cell)}


def test_the_readme_lists_every_settable_limit_with_its_declared_default() -> None:
    rows = options_rows()
    for limit in SETTABLE:
        assert limit.flag is not None
        found = [(flags, default) for flags, default in rows if limit.flag in flags]
        assert len(found) == 1, f"{limit.flag}: {len(found)} rows of the README's options table name it"
        flags, cell = found[0]
        if limit.derived:  # worked out at start: the cell says how, in words
            continue
        parts = cell.split(", ")
        part = parts[flags.index(limit.flag)] if len(parts) == len(flags) else cell
        assert float(limit.default) in quantities(part), f"{limit.flag}: README says {part!r}, declared {limit.default}"


def test_the_flags_are_the_declared_ones() -> None:
    parser = build_parser()
    actions = {a.option_strings[0]: a for a in parser._actions if a.option_strings}
    for limit in SETTABLE:
        assert limit.flag is not None
        action = actions[limit.flag]
        assert action.dest == limits_args.dest(limit)
        assert action.default == (None if limit.derived else limit.default), limit.flag
        assert action.type is type(limit.default) and action.help == limit.help, limit.flag


def test_every_settable_limit_reaches_the_server_config() -> None:
    args = build_parser().parse_args([])
    from deepinfer_server.cli import check_args

    assert check_args(args) is None
    sent = limits_args.server_config(args, 4096)
    derived = {limit.name for limit in SETTABLE if limit.derived}
    assert {limit.name: limit.default for limit in SETTABLE if limit.name not in derived} == {
        limit.name: getattr(sent, limit.name) for limit in SETTABLE if limit.name not in derived
    }


def test_the_grammar_defaults_are_the_declared_ones() -> None:
    declared = {limit.name: limit.default for limit in SETTABLE}
    assert (GrammarLimits.max_bytes, GrammarLimits.cpu_seconds, GrammarLimits.cache_bytes) == (
        declared["max_grammar_bytes"],
        declared["grammar_cpu_s"],
        declared["max_grammar_cache_bytes"],
    )


def test_names_follow_one_style() -> None:
    for limit in _native.LIMITS:
        assert "_max" not in limit.name.lower(), f"{limit.name}: a most is max_x, not x_max"
        assert limit.name == (limit.name.lower() if limit.flag else limit.name.upper())
        assert limit.unit in limits_args.METAVARS and limit.help


# The ring's layout bounds are its wire format's (rust/ring/layout.rs, records.rs), shared with the ranks' Python.
RING_FORMAT = {"rust/ring/layout.rs": {"MIN_CAPACITY", "MAX_CAPACITY"}, "rust/ring/records.rs": {"MAX_TOP_LOGPROBS"}}


def test_no_limit_constant_is_declared_outside_rust_limits() -> None:
    const = re.compile(r"^\s*(?:pub(?:\([a-z]+\))? )?const ([A-Z0-9_]+):", re.M)
    for path in (ROOT / "rust").rglob("*.rs"):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("rust/limits/"):
            continue
        names = {n for n in const.findall(path.read_text(encoding="utf-8")) if {"MAX", "MIN"} & set(n.split("_"))}
        found = names - RING_FORMAT.get(rel, set())
        assert not found, f"{rel}: {sorted(found)} belong in rust/limits"


def test_a_setting_misspelt_missing_or_mistyped_fails_where_it_is_built() -> None:
    from deepinfer_server.cli import check_args

    args = build_parser().parse_args([])
    assert check_args(args) is None
    sent = limits_args.server_config(args, 4096)
    values = {limit.name: getattr(sent, limit.name) for limit in SETTABLE}
    assert Limits(**values).max_json_depth == values["max_json_depth"]
    with pytest.raises(TypeError, match="max_json_deep"):
        Limits(**{**values, "max_json_deep": 3})
    with pytest.raises(TypeError, match="max_json_depth"):
        Limits(**{k: v for k, v in values.items() if k != "max_json_depth"})
    with pytest.raises(TypeError, match="max_json_depth"):
        Limits(**{**values, "max_json_depth": "deep"})
