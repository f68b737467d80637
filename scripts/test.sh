#!/usr/bin/env bash
# Install everything the tests need into a fresh virtualenv, build the extension, and run every test:
# lints, cargo test and pytest. Usage: bash scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="$(realpath -m "${VENV:-.venv}")"
PY="${PYTHON:-python3}"

if ! command -v cargo >/dev/null 2>&1; then
    echo "cargo not found: install Rust (https://rustup.rs) first" >&2
    exit 1
fi
# procps (pgrep) for the tests; libmimalloc2.0 so the allocator switch is tested too (the server runs without);
# nginx for the replicas behind a load balancer (tests/test_gateway_nginx.py); prometheus for promtool, which
# checks and unit-tests the alert rules (tests/test_observability.py); postgresql for the shared state store
# (tests/test_response_store.py starts a throwaway cluster of its own; the package's service is never started);
# chromium for the console's browser tests (tests/test_console*.py, driven by Playwright through executable_path).
need=()
command -v pgrep >/dev/null 2>&1 || need+=(procps)
ls /usr/lib/*-linux-gnu/libmimalloc.so.* >/dev/null 2>&1 || need+=(libmimalloc2.0)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || command -v initdb >/dev/null 2>&1 || need+=(postgresql)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -gt 0 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    # A policy-rc.d that says no: installing the packages must not start their services (nginx, prometheus).
    own_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && own_policy=1
    fi
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
    [ -z "$own_policy" ] || rm -f /usr/sbin/policy-rc.d
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q maturin
"$VENV/bin/python" -m pip install -q -e '.[test]'   # builds the Rust extension with maturin

echo "== rustfmt / clippy"
cargo fmt --check
PYO3_PYTHON="$VENV/bin/python" cargo clippy --all-targets -q -- -D warnings
echo "== ruff / mypy"
"$VENV/bin/ruff" check python tests scripts bench
"$VENV/bin/ruff" format --check python tests scripts bench
"$VENV/bin/mypy" python/deepinfer_server
export PYO3_PYTHON="$VENV/bin/python"
echo "== cargo test"
cargo test -q
echo "== pytest"
"$VENV/bin/python" -m pytest -q "$@"
