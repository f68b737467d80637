"""Shared fixtures: start a real `deepinfer-server` process on loopback and talk to it over HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

MODEL = "deepseek-v4.1-flash"
LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


@dataclass
class Server:
    proc: subprocess.Popen[str]
    base_url: str = ""
    lines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.base_url

    def client(self, **kw: object) -> OpenAI:
        return OpenAI(base_url=f"{self.base_url}/v1", api_key="unused", max_retries=0, **kw)  # type: ignore[arg-type]

    def rank_pids(self) -> list[int]:
        """The rank processes (children of the server, without its reaper)."""
        cmd = ["pgrep", "-P", str(self.proc.pid), "-f", "deepinfer_server.engine.rank"]
        out = subprocess.run(cmd, capture_output=True, text=True).stdout
        return [int(x) for x in out.split()]

    def log(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def start_server(*args: str, timeout: float = 60.0, env: dict[str, str] | None = None) -> Server:
    cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
    )
    srv = Server(proc)
    found = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            srv.lines.append(line)
            m = LISTENING.search(line)
            if m and not found.is_set():
                srv.base_url = f"http://{m.group(1)}:{m.group(2)}"
                found.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start (exit {proc.poll()}):\n{srv.log()}")
    return srv


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    """One shared server: DP 2, fast sim, generous capacity."""
    srv = start_server("--dp", "2", "--max-num-seqs", "16", "--max-model-len", "4096", "--served-model-name", MODEL)
    yield srv
    srv.stop()


@pytest.fixture
def make_server() -> Iterator[Callable[..., Server]]:
    """Start a dedicated server with its own flags; stopped after the test."""
    started: list[Server] = []

    def make(*args: str, **kw: object) -> Server:
        srv = start_server("--served-model-name", MODEL, *args, **kw)  # type: ignore[arg-type]
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


@pytest.fixture
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        yield c


def sse_events(resp: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order (comments skipped)."""
    out = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            out.append(line[len("data: ") :])
        else:
            assert line == "" or line.startswith(":"), f"unexpected SSE line {line!r}"
    return out


@pytest.fixture
def ring_path() -> Iterator[Callable[[], str]]:
    """Factory of unique ring paths (in /dev/shm when there is one); every path is unlinked at teardown."""
    from deepinfer_server._native import Ring

    made: list[str] = []
    base = "/dev/shm" if os.path.isdir("/dev/shm") else os.environ.get("TMPDIR", "/tmp")

    def make() -> str:
        p = os.path.join(base, f"deepinfer-test-{os.getpid()}-{uuid.uuid4().hex}")
        made.append(p)
        return p

    yield make
    for p in made:
        with contextlib.suppress(FileNotFoundError):
            Ring.unlink(p)


def shm_segments() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("deepinfer-*")}


def context_switches(pid: int) -> int:
    """Voluntary plus involuntary context switches of every thread of `pid` so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


def idle_wakeups_per_s(srv: Server, seconds: float = 2.0) -> list[float]:
    """How often each rank process of an idle server is scheduled: a poll loop shows up as hundreds a second."""
    pids = srv.rank_pids()
    before = [context_switches(p) for p in pids]
    time.sleep(seconds)
    return [(context_switches(p) - b) / seconds for p, b in zip(pids, before, strict=True)]


def requests_across_idle_gaps(srv: Server, n: int = 24, threads: int = 3) -> None:
    """Short requests from a few threads with idle gaps between them, so ranks go to sleep and must be woken
    (the server starts such tests with a long idle backstop: a lost wake-up hangs past the client timeout)."""
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        client = srv.client(timeout=20)
        try:
            for i in range(n // threads):
                time.sleep(0.005 * ((i * 7 + k * 3) % 11))
                r = client.chat.completions.create(
                    model=MODEL,
                    messages=[{"role": "user", "content": f"wake {k} {i}"}],
                    max_tokens=3,
                    extra_body={"thinking": {"type": "disabled"}, "ignore_eos": True},
                )
                assert r.usage is not None and r.usage.completion_tokens == 3
        except BaseException as e:
            errors.append(e)

    workers = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state, parent pid, process group) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2 :].split()
    return f[0], int(f[1]), int(f[2])


def server_processes(server_pid: int, groups: set[int]) -> dict[int, str]:
    """Every live process that belongs to a server, by a /proc scan: the server itself, anything in the rank
    process groups `groups` (ranks, CP workers, VE workers), or carrying the server's shared-memory prefix in its
    command line (the ranks, the reaper). Zombies do not count. pid -> command line."""
    marker = f"deepinfer-{server_pid}-"
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        st = proc_stat(pid)
        if st is None or st[0] == "Z":
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if pid == server_pid or st[2] in groups or marker in cmdline:
            found[pid] = cmdline[:160]
    return found


def group_members(groups: set[int]) -> dict[int, tuple[str, int, int]]:
    """Live processes in the given process groups: pid -> (state, ppid, pgid)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            st = proc_stat(int(entry.name))
            if st is not None and st[0] != "Z" and st[2] in groups:
                out[int(entry.name)] = st
    return out


def wait_until_gone(server_pid: int, groups: set[int], timeout: float = 10.0) -> dict[int, str]:
    """Poll until no process of the server remains (or `timeout`); returns what is left."""
    deadline = time.monotonic() + timeout
    while True:
        left = server_processes(server_pid, groups)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def sse_has_text(line: str) -> bool:
    """True for an SSE line that carries generated text (not the role chunk, a comment or the end)."""
    if not line.startswith("data: {"):
        return False
    import json

    chunk = json.loads(line[6:])
    return any((ch.get("delta") or {}).get("content") for ch in chunk.get("choices") or [])
