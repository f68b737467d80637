"""Two sim replicas behind nginx (Debian's package) with passive health checks and retries on connection errors and
503 (bench/nginx_replicas.py, the documented command, has the setup): a rolling restart under streamed load loses no
request, a SIGKILL cuts only the killed replica's streams, and what the clients see when one replica's sim fails on
purpose (a rank crash, a stalled rank, engine errors and aborts).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import nginx_replicas as nx

pytestmark = pytest.mark.skipif(
    nx.NGINX is None, reason="nginx is not installed (scripts/test.sh installs Debian's nginx package as root)"
)


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


def test_rolling_restart_behind_nginx_loses_no_request(workdir: Path) -> None:
    with nx.setup(workdir) as (nginx, replicas):
        f = nx.rolling_restart(nginx, replicas, clients=4, max_tokens=60)
    nx.print_restart(f)
    assert f["failures"] == 0, f["failure_samples"]
    assert set(f["per_replica"]) == {r.addr for r in replicas} and f["requests"] > 40, f
    for step in f["steps"]:
        assert step["exit_status"] == 0, step  # the drain cut nothing
        # the streams the draining replica held when it got the SIGTERM finished there
        assert step["in_flight_at_sigterm"] >= 1 and step["in_flight_finished"] == step["in_flight_at_sigterm"], step
        # requests that arrived while it drained were answered by the other replica (its 503s retried by nginx)
        assert step["started_while_draining"] >= 1, step
        assert step["started_while_draining_on_other"] == step["started_while_draining"], step
    assert f["longest_stall_s"] < 5.0, f


def test_sigkill_behind_nginx_cuts_only_the_killed_replicas_streams(workdir: Path) -> None:
    with nx.setup(workdir) as (nginx, replicas):
        f = nx.sigkill(nginx, replicas)
    nx.print_sigkill(f)
    assert f["long_on_killed"] >= 2 and f["long_on_survivor"] >= 2, f
    assert f["long_on_killed_cut"] == f["long_on_killed"], f  # a stream already under way cannot move
    assert f["cut_samples"] == ["RemoteProtocolError"], f  # nginx closes the client's connection mid-body
    assert f["long_on_survivor_failed"] == 0, f
    # new requests: the dead replica refuses the connection, nginx retries on the survivor
    assert f["short_requests_after_kill"] >= 10 and f["short_after_kill_failed"] == 0, f["short_failure_samples"]
    assert f["short_after_kill_on_survivor"] == f["short_requests_after_kill"], f


def run_load(nginx: nx.Nginx, seconds: float, clients: int = 4, max_tokens: int = 30) -> list[nx.Result]:
    with nx.Load(nginx.url, clients, max_tokens) as load:
        time.sleep(seconds)
    return load.results


@pytest.fixture
def faulty(workdir: Path, request: pytest.FixtureRequest) -> Iterator[tuple[nx.Nginx, list[nx.Replica]]]:
    """Replica 0 runs with the sim fault flags the test names; replica 1 behaves."""
    with nx.setup(workdir, (*nx.REPLICA_ARGS, *request.param), nx.REPLICA_ARGS) as pair:
        yield pair


@pytest.mark.parametrize("faulty", [("--sim-crash-after", "6", "--exit-on-rank-failure", "1")], indirect=True)
def test_a_rank_crash_behind_nginx_fails_only_the_streams_it_held(faulty: tuple[nx.Nginx, list[nx.Replica]]) -> None:
    nginx, (bad, good) = faulty
    results = run_load(nginx, 4.0)
    assert bad.wait(timeout=10) == 1  # exit on rank failure
    failed = [r for r in results if r.failure]
    assert failed, "the crash cut no stream"
    assert len(failed) <= 4, [r.failure for r in failed]  # at most what it held at the crash (4 clients)
    for r in failed:  # cut mid-stream: the replica's error event (503 service_unavailable) and [DONE]
        assert r.upstream == bad.addr and r.failure.startswith("error event"), r
        assert "service_unavailable" in r.failure, r
    crash = max(r.end for r in failed)
    after = [r for r in results if r.start > crash]
    assert len(after) >= 10 and all(not r.failure and r.upstream == good.addr for r in after)


@pytest.mark.parametrize(
    "faulty", [("--sim-stall-after", "6", "--watchdog-timeout", "2", "--exit-on-rank-failure", "1")], indirect=True
)
def test_a_stalled_rank_behind_nginx_holds_its_streams_until_the_watchdog(
    faulty: tuple[nx.Nginx, list[nx.Replica]],
) -> None:
    """nginx's passive checks cannot see a stall (the replica still accepts and answers /health 200): its streams
    wait until the watchdog ends them, then the replica leaves."""
    nginx, (bad, good) = faulty
    results = run_load(nginx, 6.0)
    assert bad.wait(timeout=10) == 1
    failed = [r for r in results if r.failure]
    assert failed and all(r.upstream == bad.addr for r in failed), [(r.upstream, r.failure) for r in failed]
    assert all("stopped responding" in r.failure for r in failed), [r.failure for r in failed]
    assert max(r.stall for r in failed) >= 1.8  # the clients waited for the watchdog (2 s)
    last_cut = max(r.end for r in failed)
    after = [r for r in results if r.start > last_cut]
    assert len(after) >= 5 and all(not r.failure and r.upstream == good.addr for r in after)


@pytest.mark.parametrize(
    "faulty", [("--sim-error-rate", "0.2", "--sim-abort-rate", "0.2", "--sim-fault-seed", "7")], indirect=True
)
def test_engine_errors_and_aborts_behind_nginx_reach_the_client(faulty: tuple[nx.Nginx, list[nx.Replica]]) -> None:
    """A stream has its 200 before the engine fails, so nginx cannot retry it: the client gets the error event."""
    nginx, (bad, good) = faulty
    results = run_load(nginx, 4.0)
    on_bad = [r for r in results if r.upstream == bad.addr]
    failed = [r for r in results if r.failure]
    assert all(r.upstream == bad.addr for r in failed)
    assert sum(1 for r in results if r.upstream == good.addr) >= 20  # and none of those failed
    assert len(on_bad) >= 20 and 0.15 <= len(failed) / len(on_bad) <= 0.65, (len(failed), len(on_bad))
    errors = [json.loads(r.failure.split(": ", 1)[1])["error"]["message"] for r in failed]
    assert any("sim_engine_error" in m for m in errors) and any("aborted" in m for m in errors), errors
