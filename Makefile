.DEFAULT_GOAL := help
VENV ?= .venv
PY := $(VENV)/bin/python

help: ## list the targets
	@grep -E '^[a-z-]+:.*##' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-10s %s\n", $$1, $$2}'

venv: ## create .venv with the package (editable, release build) and the test tools
	[ -x $(PY) ] || python3 -m venv $(VENV)
	$(PY) -m pip install -q maturin && $(PY) -m pip install -q -e '.[test]'

build: ## rebuild the Rust extension into .venv (release)
	$(VENV)/bin/maturin develop -q --release

format: ## rustfmt and ruff format
	cargo fmt && $(VENV)/bin/ruff format python tests scripts bench

lint: ## clippy -D warnings, ruff, mypy
	cargo clippy --all-targets -q -- -D warnings
	$(VENV)/bin/ruff check python tests scripts bench && $(VENV)/bin/mypy python/deepinfer_server

test: ## everything CI runs (installs what it needs)
	bash scripts/test.sh

run: ## start the server on the simulated engine at :8000
	$(VENV)/bin/deepinfer-server

bench: ## side-by-side benchmark against the FastAPI peer (needs '.[bench]' and wrk)
	$(PY) bench/bench.py --json-out docs/bench/summary.json --plots docs/bench

.PHONY: help venv build format lint test run bench
