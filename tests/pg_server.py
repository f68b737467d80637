"""A throwaway PostgreSQL server for the tests (Debian's `postgresql` package, which scripts/test.sh installs): a
fresh cluster in a temporary directory, on a free loopback port, trusted, with fsync off; removed afterwards."""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest


def bindir() -> str | None:
    """The newest installed PostgreSQL's binaries (Debian keeps them per version, off the PATH)."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(p.split("/")[4]))
    if found:
        return os.path.dirname(found[-1])
    initdb = shutil.which("initdb")
    return os.path.dirname(initdb) if initdb else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def postgres() -> Iterator[str]:
    """A running PostgreSQL server; yields its URL (database `deepinfer`, user `deepinfer`)."""
    bin_ = bindir()
    if bin_ is None:
        pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql; scripts/test.sh does)")
    # PostgreSQL refuses to run as root: run it as its own user, as the package sets it up.
    user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
    base = tempfile.mkdtemp(prefix="deepinfer-pg-")
    os.chmod(base, 0o755)
    data = os.path.join(base, "data")
    os.mkdir(data, 0o700)
    if user:
        shutil.chown(data, "postgres", "postgres")
        shutil.chown(base, "postgres", "postgres")
    port = free_port()
    run = dict(check=True, capture_output=True, text=True, timeout=120)
    subprocess.run([*user, f"{bin_}/initdb", "-D", data, "-U", "deepinfer", "--auth=trust", "--no-sync"], **run)  # type: ignore[call-overload]
    settings = ("listen_addresses=127.0.0.1", "fsync=off", "synchronous_commit=off", "full_page_writes=off")
    server = subprocess.Popen(
        [*user, f"{bin_}/postgres", "-D", data, "-p", str(port), "-k", base, *(a for s in settings for a in ("-c", s))],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            ready = subprocess.run([f"{bin_}/pg_isready", "-h", "127.0.0.1", "-p", str(port)], capture_output=True)
            if ready.returncode == 0:
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start (exit {server.poll()})")
            time.sleep(0.2)
        create = [f"{bin_}/createdb", "-h", "127.0.0.1", "-p", str(port), "-U", "deepinfer", "deepinfer"]
        subprocess.run(create, **run)  # type: ignore[call-overload]
        yield f"postgresql://deepinfer@127.0.0.1:{port}/deepinfer"
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(base, ignore_errors=True)


def fresh_database(url: str, name: str) -> str:
    """A new, empty database on the server of `url` (dropped first if a test made it before); its URL. For tests
    whose replicas must not take over what other tests' stopped servers left in the shared one (batches,
    background responses)."""
    base, _ = url.rsplit("/", 1)
    psql = [f"{bindir()}/psql", url, "-q", "-v", "ON_ERROR_STOP=1"]
    for sql in (f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}"):
        subprocess.run([*psql, "-c", sql], check=True, capture_output=True, timeout=60)
    return f"{base}/{name}"
