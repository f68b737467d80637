"""A throwaway PostgreSQL server for the tests (Debian's `postgresql` package, which scripts/test.sh installs): a
fresh cluster in a temporary directory, on a free loopback port, trusted, with fsync off; removed afterwards."""

from __future__ import annotations

import glob
import os
import shutil
import signal
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


class Cluster:
    """A throwaway PostgreSQL cluster: a fresh data directory in a temporary directory, on a free loopback port,
    trusted, with fsync off. It can be stopped and started again on the same port and data (the fault tests' store
    outage)."""

    def __init__(self) -> None:
        bin_ = bindir()
        if bin_ is None:
            pytest.skip("PostgreSQL is not installed (Debian: apt-get install postgresql; scripts/test.sh does)")
        self.bin = bin_
        # PostgreSQL refuses to run as root: run it as its own user, as the package sets it up.
        self.user = ["runuser", "-u", "postgres", "--"] if os.geteuid() == 0 else []
        self.base = tempfile.mkdtemp(prefix="deepinfer-pg-")
        os.chmod(self.base, 0o755)
        self.data = os.path.join(self.base, "data")
        os.mkdir(self.data, 0o700)
        if self.user:
            shutil.chown(self.data, "postgres", "postgres")
            shutil.chown(self.base, "postgres", "postgres")
        self.port = free_port()
        self.server: subprocess.Popen[bytes] | None = None
        init = [*self.user, f"{self.bin}/initdb", "-D", self.data, "-U", "deepinfer", "--auth=trust", "--no-sync"]
        subprocess.run(init, check=True, capture_output=True, text=True, timeout=120)
        self.url = f"postgresql://deepinfer@127.0.0.1:{self.port}/deepinfer"

    def start(self) -> None:
        settings = ("listen_addresses=127.0.0.1", "fsync=off", "synchronous_commit=off", "full_page_writes=off")
        cmd = [*self.user, f"{self.bin}/postgres", "-D", self.data, "-p", str(self.port), "-k", self.base]
        self.server = subprocess.Popen(
            [*cmd, *(a for s in settings for a in ("-c", s))], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + 60
        while True:
            ready = subprocess.run(
                [f"{self.bin}/pg_isready", "-h", "127.0.0.1", "-p", str(self.port)], capture_output=True
            )
            if ready.returncode == 0:
                return
            if self.server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"PostgreSQL did not start (exit {self.server.poll()})")
            time.sleep(0.2)

    def stop(self) -> None:
        """Stop the server (a fast shutdown: its clients' connections are cut)."""
        if self.server is None:
            return
        try:
            with open(os.path.join(self.data, "postmaster.pid")) as f:
                os.kill(int(f.readline()), signal.SIGINT)  # the postmaster itself (runuser may be its parent)
        except (OSError, ValueError):
            self.server.terminate()
        try:
            self.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.server.kill()
            self.server.wait()
        self.server = None

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


@contextmanager
def cluster() -> Iterator[Cluster]:
    """A running PostgreSQL cluster with a database `deepinfer` for user `deepinfer`."""
    c = Cluster()
    try:
        c.start()
        create = [f"{c.bin}/createdb", "-h", "127.0.0.1", "-p", str(c.port), "-U", "deepinfer", "deepinfer"]
        subprocess.run(create, check=True, capture_output=True, text=True, timeout=120)
        yield c
    finally:
        c.remove()


@contextmanager
def postgres() -> Iterator[str]:
    """A running PostgreSQL server; yields its URL (database `deepinfer`, user `deepinfer`)."""
    with cluster() as c:
        yield c.url


def fresh_database(url: str, name: str) -> str:
    """A new, empty database on the server of `url` (dropped first if a test made it before); its URL. For tests
    whose replicas must not take over what other tests' stopped servers left in the shared one (batches,
    background responses)."""
    base, _ = url.rsplit("/", 1)
    psql = [f"{bindir()}/psql", url, "-q", "-v", "ON_ERROR_STOP=1"]
    for sql in (f"DROP DATABASE IF EXISTS {name}", f"CREATE DATABASE {name}"):
        subprocess.run([*psql, "-c", sql], check=True, capture_output=True, timeout=60)
    return f"{base}/{name}"
