"""The tree's shape: no import circle among the package's modules (TYPE_CHECKING imports included: a circle there is
one a reader has to untangle all the same), none among the Rust crate's layers, and no file that names a test file
that is not there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "python" / "deepinfer_server"


def imports() -> dict[str, set[str]]:
    """Each module of the package, and the package's modules it imports."""
    modules = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("deepinfer_server"):
                deps |= {
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                    for a in node.names
                }
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("deepinfer_server")}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The circles: groups of modules that each reach all the others through their imports."""
    reach = {m: reachable(graph, m) for m in graph}
    found: list[set[str]] = []
    for m in graph:
        component = {n for n in reach[m] if m in reach[n]}
        if component and component not in found:
            found.append(component)
    return found


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for dep in graph[todo.pop()]:
            if dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return seen


def test_no_module_of_the_package_imports_itself_back() -> None:
    graph = imports()
    assert {"deepinfer_server.codec", "deepinfer_server.doors.chat", "deepinfer_server.engine.rank"} <= set(graph)
    assert not circles(graph)


# The Rust crate's layers: each module under rust/ (a file or a directory), and each worker under rust/workers/ on
# its own (batches and background responses are two layers side by side, neither below the other).
SPLIT = {"workers"}
RUST_USE = re.compile(r"\bcrate::(\w+)(?:::(\w+))?")


def rust_layer(path: Path) -> str:
    parts = path.relative_to(ROOT / "rust").with_suffix("").parts
    return "/".join(parts[:2]) if parts[0] in SPLIT and len(parts) > 1 else parts[0]


def rust_imports() -> dict[str, set[str]]:
    """Each layer of the crate, and the layers its code names through `crate::` (comments and `#[cfg(test)]`
    modules left out: a test may reach anywhere)."""
    graph: dict[str, set[str]] = {}
    for path in (ROOT / "rust").rglob("*.rs"):
        layer = rust_layer(path)
        code = path.read_text(encoding="utf-8").split("#[cfg(test)]")[0]
        code = re.sub(r"//.*", "", code)
        named = {f"{a}/{b}" if a in SPLIT and b else a for a, b in RUST_USE.findall(code)}
        graph.setdefault(layer, set()).update(n for n in named if n != layer)
    return {m: {d for d in deps if d in graph} for m, deps in graph.items()}


def test_no_layer_of_the_crate_imports_itself_back() -> None:
    graph = rust_imports()
    assert {"http", "path", "doors", "config", "edge", "workers/batches", "workers/background"} <= set(graph)
    assert "path" in graph["workers/batches"] and "path" in graph["workers/background"], "the checker reads uses"
    found = circles(graph)
    # Each circle named with the uses that close it, to say where to cut.
    assert not found, [{m: sorted(graph[m] & c) for m in sorted(c)} for c in found]
    # Downward only: no layer below HTTP reaches up into it (the workers included), and only HTTP and the server
    # reach a worker: the path and the store below them keep none of a worker's state by name.
    assert not [m for m, deps in graph.items() if "http" in deps and m not in {"server"}], graph
    above = {"http", "server", "workers/batches", "workers/background"}
    assert not {m: sorted(d) for m, deps in graph.items() if m not in above and (d := workers(deps))}


def workers(deps: set[str]) -> set[str]:
    return {d for d in deps if d.startswith("workers")}


def test_the_layer_check_sees_a_lower_layer_reach_a_worker() -> None:
    graph = {"store": {"workers/background", "db"}, "path": {"store"}}
    assert workers(graph["store"]) == {"workers/background"} and not workers(graph["path"])


def test_the_checker_finds_a_circle() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


# Where the tree names test files: scripts, docs, deployment files, sources and tests.
NAMING = ("README.md", "BENCHMARKS.md", "Makefile", "scripts", "docs", "deploy", "python", "rust", "tests", "bench")
TEST_FILE = re.compile(r"\btests/[\w/]+\.py\b")


def test_every_test_file_the_tree_names_exists() -> None:
    named: dict[str, set[str]] = {}
    for top in NAMING:
        base = ROOT / top
        for path in [base] if base.is_file() else base.rglob("*") if base.is_dir() else []:
            if not path.is_file() or path.suffix in (".so", ".png", ".gz") or "__pycache__" in path.parts:
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            for name in TEST_FILE.findall(text):
                named.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    assert "tests/test_observability.py" in named, "the scan finds what scripts/test.sh names"
    missing = {name: sorted(where) for name, where in named.items() if not (ROOT / name).is_file()}
    assert not missing, missing


# A file does one job; past this many lines it usually does two. The ring's contract (its shared-memory layout and
# its records) is one job, however long.
MAX_LINES = 420
LONG_BY_DESIGN = {"rust/ring/shm.rs", "rust/ring/records.rs"}


def test_no_source_file_is_longer_than_one_job() -> None:
    sources = [*(ROOT / "python").rglob("*.py"), *(ROOT / "rust").rglob("*.rs")]
    assert len(sources) > 50
    long = {
        str(p.relative_to(ROOT)): n
        for p in sources
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
        and str(p.relative_to(ROOT)) not in LONG_BY_DESIGN
    }
    assert not long, long
