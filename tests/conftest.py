"""Shared fixtures: start a real `deepinfer-server` process on loopback and talk to it over HTTP."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
import wire_schema
from openai import OpenAI

MODEL = "deepseek-v4.1-flash"
# The servers the tests start keep their state (stored responses) under this run's own directory, by the default
# rule (state.sqlite3 under $XDG_STATE_HOME), never the user's.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="deepinfer-tests-state-")
os.environ.pop("DEEPINFER_SERVER_STATE_STORE", None)
# The start-up line's address: http://HOST:PORT, https://HOST:PORT with TLS, http+unix:PATH with --uds.
LISTENING = re.compile(r"listening on (https?://[\d.]+:(\d+)|https?\+unix:\S+)")


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


def start_server(
    *args: str,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    new_session: bool = False,
    launcher: list[str] | None = None,
) -> Server:
    """`new_session`: the server leads its own process group, so a test can signal the whole group
    (`os.killpg(srv.proc.pid, ...)`) as systemd, dumb-init or `kill -- -PGID` do. `launcher`: the command that
    starts it (default `python -m deepinfer_server`), e.g. the container entrypoint."""
    launch = launcher or [sys.executable, "-m", "deepinfer_server"]
    cmd = [*launch, "--host", "127.0.0.1", "--port", "0", *args]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=new_session,
    )
    srv = Server(proc)
    found = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        try:
            for line in proc.stdout:
                srv.lines.append(line)
                m = LISTENING.search(line)
                if m and not found.is_set():
                    srv.base_url = m.group(1)
                    if m.group(2):
                        WIRE_PORTS.add(int(m.group(2)))
                    found.set()
        except ValueError:
            pass  # `stop` closed the pipe while a process a killed server left (its reaper) still held it open

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found.wait(0.05):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start (exit {proc.poll()}):\n{srv.log()}")
    return srv


from state_servers import pg_url, state, state_srv  # noqa: E402, F401  (the state tests' shared servers)


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


def terminate(proc: subprocess.Popen[Any], timeout: float = 10.0) -> None:
    """SIGTERM, and SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def free_ports(n: int) -> list[int]:
    """`n` distinct free loopback ports: every socket stays bound until all are chosen, so no two are the same."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def wait_for(what: str, pred: Callable[[], bool], timeout: float = 30.0) -> None:
    """Poll `pred` (an HTTP error counts as not yet) until it holds, failing after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if pred():
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


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


@dataclass
class BackgroundStream:
    """A streamed chat request read on a thread of its own: its `data:` payloads, when its first text came, and
    when it ended (for tests that stop or kill ranks under it)."""

    events: list[str] = field(default_factory=list)
    first: threading.Event = field(default_factory=threading.Event)
    ended: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @classmethod
    def start(cls, base_url: str, body: dict[str, Any]) -> BackgroundStream:
        s = cls()

        def read() -> None:
            with (
                httpx.Client(base_url=base_url, timeout=60) as c,
                c.stream("POST", "/v1/chat/completions", json=body) as r,
            ):
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        s.events.append(line[6:])
                        if sse_has_text(line):
                            s.first.set()
            s.ended.set()

        s.thread = threading.Thread(target=read, daemon=True)
        s.thread.start()
        return s


def sse_has_text(line: str) -> bool:
    """True for an SSE line that carries generated text (not the role chunk, a comment or the end)."""
    if not line.startswith("data: {"):
        return False
    import json

    chunk = json.loads(line[6:])
    return any((ch.get("delta") or {}).get("content") for ch in chunk.get("choices") or [])


# ------------------------------------------------------------------------------------- wire conformance, always on
# Every response that a test reads through httpx, or through httpx2 (the openai SDK's fork of it, so also LangChain
# and the Agents SDK), from one of our servers' API paths is checked against the providers' published schemas
# (tests/wire_schema.py); a test that saw a violating response fails, whatever it asserted itself.

WIRE_VIOLATIONS: list[str] = []
WIRE_CHECKED: list[str] = []  # what was checked, for the test that the capture is live
WIRE_HOSTS = {"127.0.0.1", "localhost", "::1"}
# Ports of the servers the tests started: a gateway or peer in front of them says its own words, unchecked.
WIRE_PORTS: set[int] = set()


def _check_wire(response: Any, body: bytes, complete: bool) -> None:
    request = response.request
    ctype = response.headers.get("content-type", "")
    found = wire_schema.check_response(request.url.path, response.status_code, ctype, body, complete, request.method)
    WIRE_CHECKED.append(f"{request.method} {request.url.path} {response.status_code}")
    WIRE_VIOLATIONS.extend(f"{request.method} {request.url}: {v}" for v in found)


class _Recording:
    """A response body stream that keeps what the client read and checks it when the response closes."""

    def __init__(self, inner: Any, response: Any) -> None:
        self.inner, self.response, self.body, self.complete, self.checked = inner, response, bytearray(), False, False

    def __iter__(self) -> Iterator[bytes]:
        for chunk in self.inner:
            self.body += chunk
            yield chunk
        self.complete = True

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.inner:
            self.body += chunk
            yield chunk
        self.complete = True

    def _check(self) -> None:
        if not self.checked:
            self.checked = True
            _check_wire(self.response, bytes(self.body), self.complete)

    def close(self) -> None:
        self.inner.close()
        self._check()

    async def aclose(self) -> None:
        await self.inner.aclose()
        self._check()


def _record(module: Any) -> Callable[[], None]:
    """Wrap `module`'s transports (httpx or httpx2) so that watched responses are recorded; returns the undo."""
    recorder = type("Recorder", (_Recording, module.SyncByteStream, module.AsyncByteStream), {})
    sync_cls, async_cls = module.HTTPTransport, module.AsyncHTTPTransport
    sync_send, async_send = sync_cls.handle_request, async_cls.handle_async_request

    def watch(request: Any, response: Any) -> Any:
        url = request.url
        if url.host in WIRE_HOSTS and url.port in WIRE_PORTS and wire_schema.watched(url.path, request.method):
            response.request = request
            response.stream = recorder(response.stream, response)
        return response

    def handle_request(self: Any, request: Any) -> Any:
        return watch(request, sync_send(self, request))

    async def handle_async_request(self: Any, request: Any) -> Any:
        return watch(request, await async_send(self, request))

    sync_cls.handle_request, async_cls.handle_async_request = handle_request, handle_async_request

    def undo() -> None:
        sync_cls.handle_request, async_cls.handle_async_request = sync_send, async_send

    return undo


@pytest.fixture(scope="session", autouse=True)
def wire_capture() -> Iterator[None]:
    modules = [httpx]
    with contextlib.suppress(ImportError):
        import httpx2

        modules.append(httpx2)
    undo = [_record(m) for m in modules]
    yield
    for u in undo:
        u()


@pytest.fixture(autouse=True)
def wire_conformance(wire_capture: None) -> Iterator[None]:
    """Fail the test if any response it saw broke OpenAI's schema."""
    start = len(WIRE_VIOLATIONS)
    yield
    found = WIRE_VIOLATIONS[start:]
    if found:
        pytest.fail(f"{len(found)} response(s) break OpenAI's published schema:\n" + "\n".join(found[:20]))
