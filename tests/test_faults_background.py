"""Background responses under faults (issue 40), two replicas on one PostgreSQL, judged over HTTP with the `openai`
SDK: a replica paused past its claim's lease does not overwrite the final Response of the one that took the run
over; a drain hands its runs over (none failed, none stranded); a DELETE stops the run and sticks; a chain on a
running response waits for its output; any replica reads a running response as `in_progress`; a replica cut off
from the store past its lease does as a paused one; and, on SQLite, a restarted replica runs what its drain
released. Each counts the stranded and doubled runs and asserts none. Claims
here hold 4 s (`--claim-lease 4`)."""

from __future__ import annotations

import contextlib
import signal
import socket
import sqlite3
import subprocess
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from conftest import MODEL, Server, start_server

from pg_server import bindir, free_port, fresh_database

LONG = {"ignore_eos": True}  # the sim answers until max_output_tokens
LEASE = "4"
RUNNING = ("queued", "in_progress")
ENDED = ("completed", "incomplete")  # incomplete: it ran to its max_output_tokens


def replica(store: str, *args: str) -> Server:
    base = ("--served-model-name", MODEL, "--max-num-seqs", "4", "--state-store", store)
    return start_server(*base, "--sim-decode-step-ms", "20", "--claim-lease", LEASE, *args)


def create(srv: Server, **body: Any) -> Any:
    body = {"model": MODEL, "reasoning": {"effort": "none"}, "extra_body": LONG, **body}
    return srv.client().responses.create(**body)


def status(srv: Server, rid: str) -> str:
    return str(srv.client().responses.retrieve(rid).status)


def until_done(srv: Server, rid: str, timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        r = srv.client().responses.retrieve(rid)
        if r.status not in RUNNING:
            return r
        assert time.monotonic() < deadline, f"{rid} stranded: still {r.status}"
        time.sleep(0.05)


def until_running(srv: Server, rid: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while status(srv, rid) != "in_progress":
        assert time.monotonic() < deadline, f"{rid} never ran"
        time.sleep(0.05)


def load(srv: Server) -> int:
    return int(httpx.get(f"{srv.url}/get_load", timeout=5).json()["load"])


def claims_left(store: str) -> int:
    """Rows of background_runs: a run nobody ends is stranded there."""
    if not store.startswith("postgres"):
        with contextlib.closing(sqlite3.connect(store)) as db:
            return int(db.execute("SELECT count(*) FROM background_runs").fetchone()[0])
    out = subprocess.run(
        [f"{bindir()}/psql", store, "-tAc", "SELECT count(*) FROM background_runs"],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    )
    return int(out.stdout.strip())


def runs_again(srv: Server) -> int:
    return srv.log().count("running again a background response whose replica stopped")


@contextlib.contextmanager
def replicas(store: str) -> Iterator[tuple[Server, Server, str]]:
    a, b = replica(store), replica(store)
    try:
        yield a, b, store
    finally:
        a.proc.send_signal(signal.SIGCONT)
        a.stop()
        b.stop()


@pytest.fixture
def pair(pg_url: str, request: pytest.FixtureRequest) -> Iterator[tuple[Server, Server, str]]:
    with replicas(fresh_database(pg_url, f"faults_bg_{request.node.name[5:40].lower()}")) as p:
        yield p


@pytest.fixture(params=["postgresql", "sqlite"])
def pair_on_each_store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[tuple[Server, Server, str]]:
    """Two replicas on one PostgreSQL database, or on one SQLite file (WAL lets both write it)."""
    if request.param == "sqlite":
        store = str(tmp_path / "state.sqlite3")
    else:
        store = fresh_database(request.getfixturevalue("pg_url"), "faults_bg_paused")
    with replicas(store) as p:
        yield p


def test_a_paused_replica_never_overwrites_the_final_response_of_the_one_that_took_over(
    pair_on_each_store: tuple[Server, Server, str],
) -> None:
    a, b, store = pair_on_each_store
    r = create(a, input="Run long.", background=True, max_output_tokens=120)
    until_running(a, r.id)
    a.proc.send_signal(signal.SIGSTOP)  # past its lease (4 s): b takes the run over and finishes it
    try:
        first = until_done(b, r.id, timeout=30)
    finally:
        a.proc.send_signal(signal.SIGCONT)
    assert first.status in ENDED and first.output and first.completed_at, first
    # a wakes with its run (or its end) in hand: whatever it does now, the final Response stays b's.
    final = (first.status, first.completed_at, first.output)
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        now = b.client().responses.retrieve(r.id)
        assert (now.status, now.completed_at, now.output) == final, "a final Response was overwritten"
        time.sleep(0.2)
    now = a.client().responses.retrieve(r.id)  # a reads the store too, once it has seen its claim is gone
    assert (now.status, now.completed_at, now.output) == final
    assert runs_again(b) == 1 and runs_again(a) == 0, "run twice over"
    assert claims_left(store) == 0, "a claim left behind"
    assert load(a) == 0, "the paused replica still runs what it lost"


def test_a_drain_hands_its_background_responses_over(pg_url: str) -> None:
    """Two running and one waiting for a slot on A; SIGTERM A with a 3 s drain: the waiting one is released at once,
    the running two shortly before the drain ends; B runs all three to `completed`. None failed, none stranded."""
    store = fresh_database(pg_url, "faults_bg_drain")
    a = replica(store, "--max-num-seqs", "2", "--drain-timeout", "3")
    b = replica(store)
    try:
        rs = [create(a, input=f"job {i}", background=True, max_output_tokens=300) for i in range(3)]
        until_running(a, rs[0].id)
        until_running(a, rs[1].id)
        assert status(a, rs[2].id) == "queued"  # waiting for a slot
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=15)
        done = [until_done(b, r.id, timeout=30) for r in rs]
        assert all(d.status in ENDED for d in done), [(d.status, d.error) for d in done]
        assert all(d.usage is not None and d.usage.output_tokens == 300 for d in done)
        assert "The server is shutting down" not in a.log()
        assert a.log().count("handed over by the drain") == 3
        assert runs_again(b) == 3, "each taken over once"
        assert claims_left(store) == 0, "a claim left behind"
    finally:
        a.stop()
        b.stop()


def test_a_delete_stops_the_running_response_and_sticks(pair: tuple[Server, Server, str]) -> None:
    a, b, store = pair
    r = create(a, input="Go on and on.", background=True, max_output_tokens=2000)
    until_running(a, r.id)
    b.client().responses.delete(r.id)  # through the replica that does not run it
    deadline = time.monotonic() + 8
    while load(a) != 0:  # its slot on a is free: the run stopped
        assert time.monotonic() < deadline, "the deleted response still runs"
        time.sleep(0.1)
    for _ in range(20):  # and it is never written back
        for srv in (a, b):
            with pytest.raises(openai.NotFoundError):
                srv.client().responses.retrieve(r.id)
        time.sleep(0.1)
    assert claims_left(store) == 0, "a claim left behind"


def test_a_chain_on_a_running_response_waits_for_its_output(pair: tuple[Server, Server, str]) -> None:
    a, b, store = pair
    first = create(a, input="Tell a long story.", background=True, max_output_tokens=200)
    until_running(a, first.id)
    # Through the other replica, at once: it waits for the story, then continues from it.
    second = create(b, input="And then?", previous_response_id=first.id, max_output_tokens=4)
    story = b.client().responses.retrieve(first.id)
    assert story.status in ENDED and story.usage is not None
    assert second.status in ENDED and second.usage is not None
    assert second.usage.input_tokens > story.usage.output_tokens, (second.usage, story.usage)
    assert claims_left(store) == 0


def test_a_running_response_reads_in_progress_through_any_replica(pair: tuple[Server, Server, str]) -> None:
    a, b, store = pair
    r = create(a, input="Run long.", background=True, max_output_tokens=300)
    until_running(a, r.id)
    time.sleep(0.5)
    assert status(b, r.id) == "in_progress"
    assert status(a, r.id) == "in_progress"
    done = until_done(b, r.id, timeout=30)
    assert done.status in ENDED and runs_again(a) + runs_again(b) == 0
    assert claims_left(store) == 0


def test_a_restart_on_sqlite_runs_what_its_drain_released(tmp_path: Any) -> None:
    """One replica on SQLite: what its drain released (one running, one waiting for its one slot) the same server
    runs once restarted, at its first look, without waiting for a lease."""
    store = str(tmp_path / "state.sqlite3")
    a = replica(store, "--max-num-seqs", "1", "--drain-timeout", "3")
    try:
        rs = [create(a, input=f"job {i}", background=True, max_output_tokens=300) for i in range(2)]
        until_running(a, rs[0].id)
        a.proc.send_signal(signal.SIGTERM)
        a.proc.wait(timeout=15)
        assert "The server is shutting down" not in a.log()
        assert a.log().count("handed over by the drain") == 2
    finally:
        a.stop()
    again = replica(store)
    try:
        done = [until_done(again, r.id, timeout=30) for r in rs]
        assert all(d.status in ENDED for d in done), [(d.status, d.error) for d in done]
        assert runs_again(again) == 2
    finally:
        again.stop()


class Cuttable:
    """A TCP relay to the database that can be cut (every connection through it dropped, new ones refused) and
    restored: one replica's store outage, the other's store still there."""

    def __init__(self, upstream: int) -> None:
        self.upstream, self.port, self.open = upstream, free_port(), True
        self.conns: list[socket.socket] = []
        self.listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if not self.open:
                client.close()
                continue
            server = socket.create_connection(("127.0.0.1", self.upstream))
            self.conns += [client, server]
            for src, dst in ((client, server), (server, client)):
                threading.Thread(target=self.pump, args=(src, dst), daemon=True).start()

    @staticmethod
    def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.open = False
        for s in self.conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.conns = []

    def close(self) -> None:
        self.cut()
        self.listener.close()


def test_a_store_outage_past_the_lease_never_overwrites_the_final_response(pg_url: str) -> None:
    """A's store is cut off while it runs a background response, past the lease: B takes the run over. The store
    comes back before A's run ends: A finds its claim gone and stops; the final Response is B's, written once."""
    store = fresh_database(pg_url, "faults_bg_outage")
    head, tail = store.rsplit(":", 1)
    port, name = tail.split("/", 1)
    relay = Cuttable(int(port))
    a = replica(f"{head}:{relay.port}/{name}")
    b = replica(store)
    try:
        r = create(a, input="Run long.", background=True, max_output_tokens=600)  # 12 s at 20 ms a token
        until_running(a, r.id)
        time.sleep(0.5)  # its in_progress is in the store
        relay.cut()
        deadline = time.monotonic() + 20
        while runs_again(b) == 0:  # the lease (4 s) runs out, and b takes it over
            assert time.monotonic() < deadline, "never taken over"
            time.sleep(0.1)
        relay.open = True  # the store is back, before a's run ends
        first = until_done(a, r.id, timeout=40)
        assert first.status in ENDED and first.output and first.completed_at, first
        final = (first.status, first.completed_at, first.output)
        # Until neither replica runs anything (whatever either still had in hand has ended), and a while after.
        settled, deadline = time.monotonic() + 3, time.monotonic() + 30
        while time.monotonic() < settled or load(a) + load(b) > 0:
            assert time.monotonic() < deadline, "still running"
            for srv in (a, b):
                now = srv.client().responses.retrieve(r.id)
                assert (now.status, now.completed_at, now.output) == final, "a final Response was overwritten"
            time.sleep(0.2)
        assert runs_again(b) == 1 and runs_again(a) == 0, "run twice over"
        assert "claim was lost" in a.log()
        assert claims_left(store) == 0, "a claim left behind"
    finally:
        relay.close()
        a.stop()
        b.stop()
