#!/usr/bin/env python3
"""Validate gpustack-deepinfer-server-backend.yaml with GPUStack's own code.

gpustack is a heavy install, so use a throwaway virtual environment (not the project's):

    python3 -m venv /tmp/gpustack-venv
    /tmp/gpustack-venv/bin/pip install gpustack
    /tmp/gpustack-venv/bin/python scripts/check_gpustack_backend.py [path/to/backend.yaml]

What it does, mirroring GPUStack's `POST /v2/inference-backends/from-yaml` route
(gpustack/routes/inference_backend.py, create_inference_backend_from_yaml):

1. yaml.safe_load the file; require backend_name; reject names clashing with built-in backends
   (gpustack.schemas.inference_backend.is_built_in_backend).
2. Keep only the keys the route allows (the list is read from the route's source when possible, so a newer
   gpustack is checked against its own list); report keys that the import would drop (e.g. icon).
3. Turn version_configs into VersionConfig / VersionConfigDict, apply the route's validate_custom_suffix, and
   validate InferenceBackendCreate (the pydantic model the route uses).
4. Render default_run_command with GPUStack's replace_command_param and sample deployment values, shlex.split it,
   and check that every template variable was substituted.
5. If `deepinfer_server.cli` is importable (installed, or from the repo's python/ directory; a missing compiled
   `_native` extension is replaced by a stand-in, since parsing never uses it), parse the rendered args with
   `build_parser().parse_args(args)`; otherwise say that this step was skipped.

Exits 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import shlex
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_YAML = REPO_ROOT / "gpustack-deepinfer-server-backend.yaml"

# Fallback copy of the allowed_keys list in create_inference_backend_from_yaml (gpustack 2.3.0).
FALLBACK_ALLOWED_KEYS = [
    "backend_name",
    "version_configs",
    "default_version",
    "default_backend_param",
    "default_run_command",
    "default_entrypoint",
    "health_check_path",
    "description",
    "default_env",
    "enabled",
    "backend_source",
    "parameter_format",
    "common_parameters",
]

SAMPLE = {
    "version": None,
    "model_path": "/var/lib/gpustack/cache/huggingface/deepseek-ai/DeepSeek-V4.1-Flash-1017",
    "port": 40123,
    "worker_ip": "10.0.0.7",
    "model_name": "deepseek-v4.1-flash",
    "gpu_count": 8,
    "gpu_ids": [0, 1, 2, 3, 4, 5, 6, 7],
}


class CheckFailed(Exception):
    pass


def ok(msg: str) -> None:
    print(f"ok: {msg}")


def allowed_keys_from_route(route_module: Any) -> tuple[list[str], str]:
    """Read the allowed_keys list literal from the installed route's source."""
    try:
        src = inspect.getsource(route_module.create_inference_backend_from_yaml)
        tree = ast.parse(src.lstrip() if src.startswith(" ") else src)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == "allowed_keys" for t in node.targets)
                and isinstance(node.value, ast.List)
            ):
                return [ast.literal_eval(e) for e in node.value.elts], "read from the installed route"
    except (OSError, TypeError, SyntaxError, ValueError, AttributeError):
        pass
    return list(FALLBACK_ALLOWED_KEYS), "fallback copy (could not read the route source)"


def check(path: Path) -> None:
    try:
        import yaml
        from gpustack.routes import inference_backend as route
        from gpustack.schemas.inference_backend import (
            InferenceBackendCreate,
            VersionConfig,
            VersionConfigDict,
            is_built_in_backend,
        )
    except ImportError as e:
        raise CheckFailed(f"gpustack is not importable ({e}); see the install command at the top of this script") from e

    import gpustack

    print(f"gpustack {getattr(gpustack, '__version__', '?')} from {Path(gpustack.__file__).parent}")
    print(f"checking {path}")

    raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(raw, dict):
        raise CheckFailed("the YAML document must be a single mapping")
    ok("YAML parses as one mapping")

    name = raw.get("backend_name")
    if not name:
        raise CheckFailed("backend_name is required")
    if is_built_in_backend(name):
        raise CheckFailed(f"backend_name {name!r} clashes with a built-in backend")
    ok(f"backend_name {name!r} is not a built-in backend name")

    allowed, origin = allowed_keys_from_route(route)
    print(f"allowed keys ({origin}): {', '.join(allowed)}")
    dropped = sorted(set(raw) - set(allowed))
    if dropped:
        raise CheckFailed(f"keys the /from-yaml import would silently drop: {dropped}")
    ok("every key is accepted by the /from-yaml import")
    data = {k: raw[k] for k in allowed if k in raw}

    if not data.get("version_configs"):
        raise CheckFailed("version_configs is required")
    version_configs = {}
    for version, cfg in data["version_configs"].items():
        if not isinstance(version, str):
            raise CheckFailed(f"version key {version!r} must be a string (quote it in YAML)")
        if cfg.get("built_in_frameworks"):
            cfg["built_in_frameworks"] = None
        vc = VersionConfig(**cfg)
        if not vc.image_name:
            raise CheckFailed(f"version {version}: image_name is required")
        if not vc.custom_framework:
            raise CheckFailed(f"version {version}: custom_framework is required")
        version_configs[version] = vc
    data["version_configs"] = VersionConfigDict(root=version_configs)
    summary = ", ".join(f"{v} -> {c.image_name} ({c.custom_framework})" for v, c in version_configs.items())
    ok(f"version_configs: {summary}")

    try:
        route.validate_custom_suffix(data["backend_name"], None)
    except Exception as e:
        raise CheckFailed(f"validate_custom_suffix: {getattr(e, 'message', e)}") from e
    ok("validate_custom_suffix accepts the backend name (ends with -custom)")

    try:
        InferenceBackendCreate.model_validate(data)
    except Exception as e:
        raise CheckFailed(f"InferenceBackendCreate.model_validate: {e}") from e
    backend = InferenceBackendCreate(**data)
    ok("InferenceBackendCreate.model_validate passes")

    if data.get("default_version") and data["default_version"] not in version_configs:
        raise CheckFailed(f"default_version {data['default_version']!r} is not in version_configs")
    resolved = backend.resolve_target_version(None)
    ok(f"default version resolves to {resolved!r}")

    if data.get("health_check_path") != "/health":
        raise CheckFailed(f"health_check_path is {data.get('health_check_path')!r}, expected '/health'")
    ok("health_check_path is /health")

    env = backend.get_backend_env(resolved)
    rendered = backend.replace_command_param(
        version=resolved,
        model_path=SAMPLE["model_path"],
        port=SAMPLE["port"],
        worker_ip=SAMPLE["worker_ip"],
        model_name=SAMPLE["model_name"],
        gpu_count=SAMPLE["gpu_count"],
        gpu_ids=SAMPLE["gpu_ids"],
        env=env,
    )
    if not rendered:
        raise CheckFailed("the run command renders to nothing")
    if "{{" in rendered or "}}" in rendered:
        raise CheckFailed(f"unresolved template variables in the rendered run command: {rendered}")
    try:
        args = shlex.split(rendered)
    except ValueError as e:
        raise CheckFailed(f"shlex.split of the rendered run command failed: {e}") from e
    print(f"rendered run command: {shlex.join(args)}")
    for expected in (
        SAMPLE["model_path"],
        str(SAMPLE["port"]),
        SAMPLE["model_name"],
        str(SAMPLE["gpu_count"]),
    ):
        if expected not in args:
            raise CheckFailed(f"rendered args do not contain {expected!r}")
    ok("run command renders with model_path, port, model_name and gpu_count and shlex-splits")

    entry = backend.get_container_entrypoint(resolved)
    if entry:
        print(f"note: default_entrypoint overrides the image entrypoint: {entry}")
    else:
        ok("no entrypoint override: the image ENTRYPOINT (docker/entrypoint.sh) receives the args")

    build_parser = import_build_parser()
    if build_parser is not None:
        try:
            ns = build_parser().parse_args(args)
        except SystemExit as e:
            raise CheckFailed(f"deepinfer-server's argument parser rejected the rendered args (exit {e.code})") from e
        ok(f"deepinfer_server.cli.build_parser() parses the rendered args: {vars(ns)}")
        if getattr(ns, "engine", None) == "sim":
            print("WARNING: with these args the CLI selects its simulated engine (--engine defaults to 'sim'); a real")
            print("         deployment needs the CLI default changed or '--engine deepinfer' in default_run_command")


def import_build_parser() -> Any:
    """Import deepinfer_server.cli.build_parser, from an installed package or the repo's python/ directory.

    If only the compiled extension (deepinfer_server._native, built by maturin) is missing, retry with a stand-in
    module: argument parsing never touches it. Returns None (and says so) when the CLI cannot be imported.
    """
    import importlib
    import types

    sys.path.insert(0, str(REPO_ROOT / "python"))
    try:
        return importlib.import_module("deepinfer_server.cli").build_parser
    except ModuleNotFoundError as e:
        if e.name != "deepinfer_server._native":
            print(f"SKIP: CLI parse check (deepinfer_server.cli not importable: {e})")
            return None
    except Exception as e:
        print(f"SKIP: CLI parse check (deepinfer_server.cli not importable: {type(e).__name__}: {e})")
        return None
    for mod in [m for m in sys.modules if m == "deepinfer_server" or m.startswith("deepinfer_server.")]:
        del sys.modules[mod]
    stub = types.ModuleType("deepinfer_server._native")

    def _missing(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return type(attr, (Exception,), {})

    stub.__getattr__ = _missing  # type: ignore[method-assign]
    sys.modules["deepinfer_server._native"] = stub
    try:
        build_parser = importlib.import_module("deepinfer_server.cli").build_parser
    except Exception as e:
        print(f"SKIP: CLI parse check (deepinfer_server.cli not importable even with a stand-in _native: {e!r})")
        return None
    print("note: deepinfer_server._native is not built; parsing with a stand-in extension module")
    return build_parser


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("yaml_path", nargs="?", type=Path, default=DEFAULT_YAML)
    ns = ap.parse_args(argv)
    try:
        check(ns.yaml_path)
    except CheckFailed as e:
        print(f"GPUSTACK CHECK FAIL: {e}", file=sys.stderr)
        return 1
    print("GPUSTACK CHECK OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
