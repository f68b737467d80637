"""The engine registry (engine/registry.py): every entry is whole (an --engine choice, a rank entry point that
imports, the abilities its engine has, one launch per rank), and no other module of the package tells engines
apart by their names."""

from __future__ import annotations

import ast
import inspect
import typing
from pathlib import Path

import pytest

from deepinfer_server.cli import build_parser, check_args
from deepinfer_server.engine.base import Ability
from deepinfer_server.engine.registry import ENGINES, EngineEntry, Stepping

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "deepinfer_server"
REGISTRY = PACKAGE / "engine" / "registry.py"
BUNDLED_TOKENIZER = PACKAGE / "tokenizer" / "tokenizer.json"


def engine_choices() -> list[str]:
    action = next(a for a in build_parser()._actions if a.dest == "engine")
    return list(action.choices or ())


def engine_class(entry: EngineEntry) -> type:
    """The class the entry's rank entry point returns (its return annotation)."""
    cls = typing.get_type_hints(entry.rank_entry())["return"]
    assert isinstance(cls, type), cls
    return cls


def has_member(cls: type, name: str) -> bool:
    """A method or class attribute, or an attribute its __init__ sets (`self.re_aborts = 0`)."""
    return hasattr(cls, name) or name in cls.__init__.__code__.co_names


@pytest.mark.parametrize("name", list(ENGINES))
def test_every_entry_is_a_choice_with_a_rank_entry_point(name: str) -> None:
    entry = ENGINES[name]
    assert entry.name == name
    assert name in engine_choices()
    build = entry.rank_entry()  # imports the engine's module, as the rank does
    params = list(inspect.signature(build).parameters.values())
    assert len(params) == 1 and params[0].kind is params[0].POSITIONAL_OR_KEYWORD, entry.build  # the engine config


@pytest.mark.parametrize("name", list(ENGINES))
def test_an_entry_declares_exactly_the_abilities_its_engine_has(name: str) -> None:
    """Nothing probes an engine for what it can do: an ability left out of the entry is one the server never uses,
    and one declared but missing fails in the rank."""
    entry = ENGINES[name]
    cls = engine_class(entry)
    held = {a for a in Ability if all(has_member(cls, member) for member in a.value)}
    assert held == set(entry.abilities), (cls.__name__, held)


@pytest.mark.parametrize("name", list(ENGINES))
def test_an_entry_launches_every_rank(name: str) -> None:
    args = build_parser().parse_args(["--engine", name, "--dp", "2", "--port", "0", "/models/deepseek-v4.1-flash"])
    assert check_args(args) is None
    args.model_dir = args.model  # the launcher's resolve_model, without a checkpoint
    launches = ENGINES[name].launch(args, BUNDLED_TOKENIZER, {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert len(launches) == 2
    for engine_config, env in launches:
        assert isinstance(engine_config, dict) and isinstance(env, dict)
        assert all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())


@pytest.mark.parametrize(
    ("argv", "stepping"),
    [
        ([], Stepping.ALONE),
        (["--sim-lockstep"], Stepping.BARRIER),
        (["--engine", "deepinfer", "--sim-lockstep", "m"], Stepping.COLLECTIVES),  # its own collectives, always
        (["--engine", "deepinfer", "m"], Stepping.COLLECTIVES),
        (["--engine", "fake-deepinfer", "m"], Stepping.COLLECTIVES),
    ],
)
def test_how_the_ranks_step_follows_from_the_abilities(argv: list[str], stepping: Stepping) -> None:
    args = build_parser().parse_args(argv)
    assert check_args(args) is None
    assert ENGINES[args.engine].stepping(args) is stepping


def test_the_fake_is_deepinfer_on_tests_fake_deepinfer_and_not_offered(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_server.engine import deepinfer_config

    fake, real = ENGINES["fake-deepinfer"], ENGINES["deepinfer"]
    assert (fake.build, fake.abilities, fake.shares_allocator) == (real.build, real.abilities, real.shares_allocator)
    assert fake.hidden and "fake-deepinfer" not in build_parser().format_help()
    args = build_parser().parse_args(["--engine", "fake-deepinfer", "--port", "0", "m"])
    assert check_args(args) is None
    args.model_dir = args.model
    (launched,) = fake.launch(args, BUNDLED_TOKENIZER, {"PYTHONPATH": "/elsewhere"})
    assert launched.env["PYTHONPATH"] == f"{ROOT / 'tests' / 'fake_deepinfer'}:/elsewhere"
    monkeypatch.setattr(deepinfer_config, "FAKE_DEEPINFER", ROOT / "no-such-dir")  # an installed package
    args = build_parser().parse_args(["--engine", "fake-deepinfer", "m"])
    assert "runs tests/fake_deepinfer of a source checkout" in (check_args(args) or "")


def test_an_engine_the_environment_names_must_be_in_the_table(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DEEPINFER_SERVER_ENGINE", "vllm")  # argparse does not check a default against its choices
    assert check_args(build_parser().parse_args([])) == "DEEPINFER_SERVER_ENGINE='vllm' is not an engine (" + (
        ", ".join(ENGINES) + ")"
    )


# -- nothing outside the registry tells engines apart by name -------------------------------------------------------


def _strings(node: ast.AST) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_strings(e) for e in node.elts)
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _engine_names(node: ast.AST, names: frozenset[str]) -> bool:
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return any(_engine_names(e, names) for e in node.elts)
    return isinstance(node, ast.Constant) and node.value in names


def _engine_field(node: ast.AST) -> bool:
    """`args.engine`, `conf["engine"]`, `conf.get("engine")`, `getattr(ns, "engine", ...)`."""
    if isinstance(node, ast.Attribute):
        return node.attr == "engine"
    if isinstance(node, ast.Subscript):
        return isinstance(node.slice, ast.Constant) and node.slice.value == "engine"
    if isinstance(node, ast.Call):
        func = node.func
        if isinstance(func, ast.Name) and func.id == "getattr" and len(node.args) >= 2:
            key = node.args[1]
        elif isinstance(func, ast.Attribute) and func.attr == "get" and node.args:
            key = node.args[0]
        else:
            return False
        return isinstance(key, ast.Constant) and key.value == "engine"
    return False


def _tells_apart(node: ast.AST, names: frozenset[str]) -> bool:
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
        if any(_engine_names(o, names) for o in operands):
            return True
        return any(_engine_field(o) for o in operands) and any(_strings(o) for o in operands)
    if isinstance(node, ast.Match):
        return _engine_field(node.subject)
    if isinstance(node, ast.MatchValue):
        return _engine_names(node.value, names)
    if isinstance(node, ast.Dict):
        return any(k is not None and _engine_names(k, names) for k in node.keys)
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and _engine_names(node, names)  # choices=("sim", ...)


def engine_name_tests(source: str, names: frozenset[str] = frozenset(ENGINES)) -> list[int]:
    """The lines of `source` that tell engines apart by name: a comparison with an engine's name, a comparison of an
    `engine` field with a string, a match on an engine field or an engine's name, a table keyed by engine names or a
    list of them."""
    return sorted({node.lineno for node in ast.walk(ast.parse(source)) if _tells_apart(node, names)})  # type: ignore[attr-defined]


def test_no_module_but_the_registry_compares_engine_names() -> None:
    modules = [p for p in PACKAGE.rglob("*.py") if p != REGISTRY]
    assert PACKAGE / "cli.py" in modules and PACKAGE / "engine" / "rank.py" in modules
    found = {
        f"{path.relative_to(ROOT)}:{line}"
        for path in modules
        for line in engine_name_tests(path.read_text(encoding="utf-8"))
    }
    assert not found, sorted(found)


def test_the_scan_finds_engine_names_told_apart() -> None:
    told_apart = """\
if args.engine == "deepinfer": pass
together = kind in ("sim", "deepinfer")
if conf["engine"] != "custom": pass
if getattr(ns, "engine", None) == "custom": pass
if conf.get("engine") == "custom": pass
builders = {"sim": build_sim}
match args.engine:
    case _: pass
match kind:
    case "sim": pass
p.add_argument("--engine", choices=("sim", "deepinfer"))
"""
    assert engine_name_tests(told_apart) == [1, 2, 3, 4, 5, 6, 7, 10, 11]
    not_told_apart = """\
entry = ENGINES[args.engine]
if entry.stepping(args) is not Stepping.ALONE: pass
if self.engine is None: pass
if mode == "simple": pass
log.info("rank %d ready (engine %s)", rank, conf["engine"])
fingerprint = system_fingerprint(args.engine, args.model or "")
"""
    assert engine_name_tests(not_told_apart) == []
