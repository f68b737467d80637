"""Servers with a state store, shared by the state tests (stored responses, conversations): one on an embedded
SQLite file and one on a PostgreSQL server started here, each started once per session (conftest imports these
fixtures)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from conftest import MODEL, Server, start_server

from pg_server import postgres

STATE_ARGS = ("--served-model-name", MODEL, "--max-num-seqs", "8", "--max-model-len", "8192")


@pytest.fixture(scope="session")
def state(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The SQLite file of the shared SQLite server (another server may open it too)."""
    return str(tmp_path_factory.mktemp("state") / "state.sqlite3")


@pytest.fixture(scope="session")
def pg_url() -> Iterator[str]:
    with postgres() as url:
        yield url


@pytest.fixture(scope="session", params=["sqlite", "postgresql"])
def state_srv(request: pytest.FixtureRequest, state: str) -> Iterator[Server]:
    spec = state if request.param == "sqlite" else request.getfixturevalue("pg_url")
    s = start_server(*STATE_ARGS, "--state-store", spec)
    yield s
    s.stop()
