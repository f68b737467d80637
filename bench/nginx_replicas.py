#!/usr/bin/env python3
"""Two sim replicas behind nginx (Debian's package) on loopback, under steady streamed load: a rolling restart
(SIGTERM to each replica's whole process group, wait for its exit, start it again, then the other) and a SIGKILL of
one replica. Prints what the clients saw.

    python bench/nginx_replicas.py [--clients 4] [--max-tokens 60] [--only restart,sigkill] [--json]

nginx is set up as docs/deploy.md recommends: passive health checks (`max_fails=1 fail_timeout=2s`), and a retry
on the other replica for connection errors and 503s (`proxy_next_upstream error timeout http_503 non_idempotent`),
which nginx only does while nothing of the response has reached the client: a request that has not started.
tests/test_gateway_nginx.py runs the same code and asserts on it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

MODEL = "deepseek-v4.1-flash"
LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.access(p, os.X_OK)), None)
# A replica's flags: a 5 ms decode step, so a stream of 60 tokens lasts about 0.3 s.
REPLICA_ARGS = ("--sim-decode-step-ms", "5", "--max-num-seqs", "16", "--drain-timeout", "20")

NGINX_CONF = """\
worker_processes 1;
daemon off;
pid nginx.pid;
error_log error.log notice;
events {{ worker_connections 1024; }}
http {{
    log_format upstream '$status "$request" upstream=$upstream_addr statuses=$upstream_status t=$request_time';
    access_log access.log upstream;
    upstream deepinfer {{
        # Passive health checks: one failed attempt (connection error, or a 503 since proxy_next_upstream names it)
        # takes a replica out for 2 s; then one request tries it again.
        server 127.0.0.1:{port_a} max_fails=1 fail_timeout=2s;
        server 127.0.0.1:{port_b} max_fails=1 fail_timeout=2s;
        keepalive 32;
    }}
    server {{
        listen 127.0.0.1:{port};
        client_max_body_size 16m;
        client_body_buffer_size 1m;      # keep request bodies in memory: a retry re-sends them
        location / {{
            proxy_pass http://deepinfer;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;         # stream tokens as they come (the server also sends X-Accel-Buffering: no)
            proxy_read_timeout 600s;
            # Retry on the other replica when this one refuses or drops the connection, or answers 503 (draining,
            # a failed rank), as long as nothing has been sent to the client. POST is not idempotent, so say so.
            proxy_next_upstream error timeout http_503 non_idempotent;
            proxy_next_upstream_tries 3;
            proxy_next_upstream_timeout 15s;
            add_header X-Upstream $upstream_addr always;
        }}
    }}
}}
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Replica:
    """One `deepinfer-server` leading its own process group, on a fixed port (nginx knows it by address)."""

    port: int
    args: tuple[str, ...] = REPLICA_ARGS
    proc: subprocess.Popen[str] | None = None
    lines: list[str] = field(default_factory=list)

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.addr}"

    def start(self, timeout: float = 90.0) -> None:
        cmd = [sys.executable, "-m", "deepinfer_server", "--host", "127.0.0.1", "--port", str(self.port)]
        cmd += ["--served-model-name", MODEL, *self.args]
        self.lines = []
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self.proc = proc
        up = threading.Event()

        def pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                self.lines.append(line)
                if LISTENING.search(line):
                    up.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout
        while not up.wait(0.05):
            if proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"replica {self.addr} did not start:\n{''.join(self.lines)[-3000:]}")

    def in_flight(self) -> int:
        return int(httpx.get(f"{self.url}/get_load", timeout=5).json()["load"])

    def signal_group(self, sig: signal.Signals) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, sig)  # the server's whole process group, as systemd, tini -g or kill -- -PGID do

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()


@dataclass
class Nginx:
    ports: tuple[int, int]
    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        assert NGINX is not None
        self.port = free_port()
        conf = NGINX_CONF.format(port=self.port, port_a=self.ports[0], port_b=self.ports[1])
        (self.workdir / "nginx.conf").write_text(conf)
        cmd = [NGINX, "-p", str(self.workdir), "-c", "nginx.conf", "-e", "error.log"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + 15
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), timeout=1):
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"nginx did not start: {self.error_log()}")
            time.sleep(0.05)

    def error_log(self) -> str:
        p = self.workdir / "error.log"
        return p.read_text(errors="replace")[-3000:] if p.exists() else ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # fast shutdown of the master and its worker
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


@dataclass
class Result:
    """One streamed request as a client saw it."""

    start: float
    end: float = 0.0
    upstream: str = "?"  # the replica that answered (nginx's X-Upstream: the last address it tried)
    tried: int = 0  # addresses nginx tried: more than one is a retry
    failure: str = ""
    stall: float = 0.0  # the longest wait for the next line: time to first byte or between two events
    tokens: int = 0


def streamed_chat(client: httpx.Client, url: str, max_tokens: int) -> Result:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hello"}],
        "thinking": {"type": "disabled"},
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = Result(start=time.monotonic())
    last = res.start
    events: list[str] = []
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
            tried = [a.strip() for a in r.headers.get("x-upstream", "").split(",") if a.strip()]
            res.upstream, res.tried = (tried[-1] if tried else "?"), len(tried)
            if r.status_code != 200:
                res.failure = f"HTTP {r.status_code}: {r.read()[:200]!r}"
            else:
                for line in r.iter_lines():
                    now = time.monotonic()
                    res.stall, last = max(res.stall, now - last), now
                    if line.startswith("data: "):
                        events.append(line[6:])
    except httpx.HTTPError as e:
        res.failure = f"{type(e).__name__}: {e}"
    res.end = time.monotonic()
    if res.failure:
        return res
    if not events or events[-1] != "[DONE]":
        res.failure = f"no [DONE]: {events[-2:]}"
        return res
    chunks = [json.loads(e) for e in events[:-1]]
    if any("error" in c for c in chunks):
        res.failure = f"error event: {json.dumps(next(c for c in chunks if 'error' in c))}"
        return res
    res.tokens = int((chunks[-1].get("usage") or {}).get("completion_tokens", 0))
    if res.tokens != max_tokens:
        res.failure = f"usage {chunks[-1].get('usage')}"
    return res


class Load:
    """`clients` threads, each streaming one request after another through `url` until stopped."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.results: list[Result] = []
        self.stopping = threading.Event()
        self.threads = [threading.Thread(target=self.loop, daemon=True) for _ in range(clients)]

    def loop(self) -> None:
        with httpx.Client(timeout=60) as c:
            while not self.stopping.is_set():
                self.results.append(streamed_chat(c, self.url, self.max_tokens))

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stopping.set()
        for t in self.threads:
            t.join(timeout=90)


def wait_for(what: str, pred: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if pred():
                return
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.02)


@contextlib.contextmanager
def setup(
    workdir: Path, args_a: tuple[str, ...] = REPLICA_ARGS, args_b: tuple[str, ...] = REPLICA_ARGS
) -> Iterator[tuple[Nginx, list[Replica]]]:
    """Two replicas and nginx in front of them; everything is stopped on the way out."""
    replicas = [Replica(free_port(), args_a), Replica(free_port(), args_b)]
    nginx = Nginx((replicas[0].port, replicas[1].port), workdir)
    try:
        for r in replicas:
            r.start()
        nginx.start()
        yield nginx, replicas
    finally:
        nginx.stop()
        for r in replicas:
            r.stop()


def rolling_restart(nginx: Nginx, replicas: list[Replica], clients: int = 4, max_tokens: int = 60) -> dict[str, Any]:
    """SIGTERM each replica's process group in turn (once it has streams in flight), wait for it to exit, start it
    again, and wait until nginx sends it requests again."""
    steps: list[dict[str, Any]] = []
    with Load(nginx.url, clients, max_tokens) as load:
        wait_for("requests on both replicas", lambda: {r.upstream for r in load.results} >= {x.addr for x in replicas})
        for rep in replicas:
            wait_for(f"streams in flight on {rep.addr}", lambda rep=rep: rep.in_flight() > 0)
            t_term = time.monotonic()
            rep.signal_group(signal.SIGTERM)
            code = rep.wait(timeout=60)
            t_exit = time.monotonic()
            rep.stop()
            rep.start()
            t_up = time.monotonic()
            wait_for(
                f"nginx to route to the restarted {rep.addr}",
                lambda rep=rep, t=t_up: sum(1 for r in load.results if r.upstream == rep.addr and r.start > t) >= 3,
            )
            steps.append({"replica": rep.addr, "term": t_term, "exit": t_exit, "up": t_up, "exit_status": code})
    return summarize(load.results, steps)


def summarize(results: list[Result], steps: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {
        "requests": len(results),
        "failures": sum(1 for r in results if r.failure),
        "failure_samples": [r.failure for r in results if r.failure][:5],
        "longest_stall_s": round(max((r.stall for r in results), default=0.0), 3),
        "retried_by_nginx": sum(1 for r in results if r.tried > 1),
        "per_replica": dict(Counter(r.upstream for r in results)),
        "steps": [],
    }
    for s in steps:
        rep = s["replica"]
        draining = [r for r in results if r.upstream == rep and r.start < s["term"] < r.end]
        # Started after the SIGTERM and before the replica exited: it was draining and refused them (503).
        meanwhile = [r for r in results if s["term"] < r.start < s["exit"]]
        out["steps"].append(
            {
                "replica": rep,
                "exit_status": s["exit_status"],
                "drain_s": round(s["exit"] - s["term"], 3),
                "restart_s": round(s["up"] - s["exit"], 3),
                "in_flight_at_sigterm": len(draining),
                "in_flight_finished": sum(1 for r in draining if not r.failure),
                "started_while_draining": len(meanwhile),
                "started_while_draining_on_other": sum(1 for r in meanwhile if r.upstream != rep and not r.failure),
            }
        )
    return out


def sigkill(nginx: Nginx, replicas: list[Replica], streams: int = 6, max_tokens: int = 400) -> dict[str, Any]:
    """Long streams on both replicas and steady short requests; SIGKILL the first replica's process group."""
    victim, survivor = replicas
    long: list[Result] = []

    def one() -> None:
        with httpx.Client(timeout=60) as c:
            long.append(streamed_chat(c, nginx.url, max_tokens))

    threads = [threading.Thread(target=one) for _ in range(streams)]
    for t in threads:
        t.start()
    # The long streams alone first: with the short load already running, its requests would count in the
    # replicas' in-flight figures and take turns in nginx's round robin, so a replica could hold one long stream.
    wait_for("long streams on both replicas", lambda: victim.in_flight() >= 2 and survivor.in_flight() >= 2)
    with Load(nginx.url, 2, 20) as short:
        wait_for("short requests going", lambda: len(short.results) >= 2)
        t_kill = time.monotonic()
        victim.signal_group(signal.SIGKILL)  # the server; its ranks die with it (PR_SET_PDEATHSIG)
        victim.wait(timeout=10)
        for t in threads:
            t.join(timeout=60)
        time.sleep(1.0)  # new requests keep coming after the kill
    after = [r for r in short.results if r.start > t_kill]
    on_victim = [r for r in long if r.upstream == victim.addr]
    on_survivor = [r for r in long if r.upstream == survivor.addr]
    return {
        "long_streams": len(long),
        "long_on_killed": len(on_victim),
        "long_on_killed_cut": sum(1 for r in on_victim if r.failure),
        "cut_samples": sorted({r.failure.split(":")[0] for r in on_victim if r.failure}),
        "long_on_survivor": len(on_survivor),
        "long_on_survivor_failed": sum(1 for r in on_survivor if r.failure),
        "short_requests_after_kill": len(after),
        "short_after_kill_failed": sum(1 for r in after if r.failure),
        "short_after_kill_on_survivor": sum(1 for r in after if r.upstream == survivor.addr),
        "short_after_kill_retried": sum(1 for r in after if r.tried > 1),
        "short_failure_samples": [r.failure for r in after if r.failure][:5],
    }


def print_restart(f: dict[str, Any]) -> None:
    print(
        f"rolling restart: {f['requests']} requests, {f['failures']} failures, longest stall "
        f"{f['longest_stall_s'] * 1000:.0f} ms, {f['retried_by_nginx']} retried by nginx, per replica "
        f"{f['per_replica']}"
    )
    for s in f["steps"]:
        print(
            f"  {s['replica']}: SIGTERM -> exit {s['exit_status']} in {s['drain_s']:.2f} s, "
            f"{s['in_flight_finished']}/{s['in_flight_at_sigterm']} in-flight streams finished, "
            f"{s['started_while_draining_on_other']}/{s['started_while_draining']} requests started during the drain "
            f"served by the other replica; restarted in {s['restart_s']:.2f} s"
        )


def print_sigkill(f: dict[str, Any]) -> None:
    print(
        f"SIGKILL: {f['long_on_killed_cut']}/{f['long_on_killed']} streams on the killed replica cut "
        f"({', '.join(f['cut_samples']) or '-'}), {f['long_on_survivor_failed']}/{f['long_on_survivor']} failed on "
        f"the survivor; after the kill {f['short_after_kill_failed']}/{f['short_requests_after_kill']} new requests "
        f"failed ({f['short_after_kill_on_survivor']} on the survivor, {f['short_after_kill_retried']} retried)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=60)
    ap.add_argument("--only", default="restart,sigkill")
    ap.add_argument("--json", action="store_true", help="Print the figures as JSON too.")
    a = ap.parse_args()
    if NGINX is None:
        print("nginx is not installed (apt-get install nginx)", file=sys.stderr)
        return 2
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="deepinfer-nginx-") as d:
        if "restart" in a.only:
            with setup(Path(d)) as (nginx, replicas):
                figures["rolling_restart"] = rolling_restart(nginx, replicas, a.clients, a.max_tokens)
            print_restart(figures["rolling_restart"])
        if "sigkill" in a.only:
            with setup(Path(d)) as (nginx, replicas):
                figures["sigkill"] = sigkill(nginx, replicas)
            print_sigkill(figures["sigkill"])
    if a.json:
        print(json.dumps(figures, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
