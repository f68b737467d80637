"""Fake torch.distributed whose collectives really run across processes.

A TCP star rooted at rank 0, which listens on the rendezvous address (`init_method="tcp://host:port"`, the port
DeepInfer derives from MASTER_PORT - 50), so a port in use fails like the real thing. Every collective carries a
tag and a sequence number; rank 0 checks that all ranks are in the same collective, else every rank raises
"lockstep violation" — the fake's way of making a wrong-step collective of the real engine loud. A dead or
stopped peer makes the collective hang forever, as NCCL's do: only the server's watchdog or a kill ends it.
"""

from __future__ import annotations

import contextlib
import json
import socket
import sys
import time
from datetime import timedelta
from typing import Any, NoReturn


class ReduceOp:
    SUM = "sum"
    MAX = "max"
    MIN = "min"


class ProcessGroup:
    def __init__(self, ranks: list[int], rank: int, backend: str = "gloo") -> None:
        self.ranks = ranks
        self._rank = rank
        self.backend = backend

    def size(self) -> int:
        return len(self.ranks)

    def rank(self) -> int:
        return self._rank


class _State:
    def __init__(self, rank: int, world: int, timeout: float) -> None:
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.server: socket.socket | None = None
        self.peers: dict[int, Any] = {}  # rank 0: rank -> file; others: {0: file}
        self.seqs: dict[str, int] = {}  # collectives so far, per group
        self.world_group = ProcessGroup(list(range(world)), rank)


_state: _State | None = None


def is_initialized() -> bool:
    return _state is not None


def get_rank(group: ProcessGroup | None = None) -> int:
    assert _state is not None
    return _state.rank


def get_world_size(group: ProcessGroup | None = None) -> int:
    assert _state is not None
    return _state.world


def init_process_group(
    backend: str = "gloo",
    init_method: str | None = None,
    timeout: timedelta | None = None,
    world_size: int = -1,
    rank: int = -1,
    **_: Any,
) -> None:
    global _state
    if _state is not None:
        raise RuntimeError("trying to initialize the default process group twice!")
    assert init_method and init_method.startswith("tcp://"), init_method
    host, port_s = init_method[len("tcp://") :].rsplit(":", 1)
    port = int(port_s)
    limit = timeout.total_seconds() if timeout is not None else 1800.0
    st = _State(rank, world_size, limit)
    if world_size > 1:
        deadline = time.monotonic() + min(limit, 120.0)
        if rank == 0:
            try:
                srv = socket.create_server((host, port), reuse_port=False)
            except OSError as e:
                raise RuntimeError(
                    f"The server socket has failed to listen on any local network address. port: {port}, "
                    f"useIpv6: 0, code: -98, name: EADDRINUSE, message: address already in use ({e})"
                ) from e
            st.server = srv
            srv.settimeout(max(0.1, deadline - time.monotonic()))
            while len(st.peers) < world_size - 1:
                conn, _ = srv.accept()
                conn.settimeout(None)
                f = conn.makefile("rwb")
                hello = json.loads(f.readline())
                st.peers[int(hello["rank"])] = f
        else:
            while True:
                try:
                    conn = socket.create_connection((host, port), timeout=1.0)
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"fake gloo: timed out connecting to rendezvous {host}:{port}") from None
                    time.sleep(0.05)
            conn.settimeout(None)
            f = conn.makefile("rwb")
            f.write(json.dumps({"rank": rank}).encode() + b"\n")
            f.flush()
            st.peers[0] = f
    _state = st


def _reduce(op: str | None, columns: list[list[Any]]) -> list[Any]:
    if op is None or not columns or not columns[0]:
        return []
    fn = {ReduceOp.MAX: max, ReduceOp.MIN: min, ReduceOp.SUM: sum}[op]
    return [fn(col) for col in zip(*columns, strict=True)]


def _collective(tag: str, values: list[Any], op: str | None, group: ProcessGroup | None = None) -> list[Any]:
    """Run one collective over `group` (default: the world). Rank 0 relays every collective, so a group must
    contain it. Hangs on a dead or stopped member; raises when members are in different collectives."""
    st = _state
    if st is None:
        raise RuntimeError("Default process group has not been initialized")
    members = list(range(st.world)) if group is None else sorted(group.ranks)
    assert st.rank in members, f"rank {st.rank} is not in group {members}"
    key = ",".join(map(str, members))
    seq = st.seqs[key] = st.seqs.get(key, 0) + 1
    if len(members) == 1:
        return values
    assert 0 in members, f"the fake relays collectives through rank 0: group {members} lacks it"
    me = {"tag": tag, "seq": seq, "group": key, "values": values, "op": op, "rank": st.rank}
    if st.rank == 0:
        got = [me]
        for r in members[1:]:
            try:
                line = st.peers[r].readline()  # a stopped member: blocks here
            except OSError:
                line = b""
            if not line:
                _hang(f"rank {r} is gone (connection closed) during {tag}#{seq}")
            got.append(json.loads(line))
        keys = {(g["tag"], g["seq"], g["group"]) for g in got}
        if len(keys) > 1:
            where = ", ".join(f"rank {g['rank']} in {g['tag']}#{g['seq']} over [{g['group']}]" for g in got)
            _fail(st, f"lockstep violation: {where}")
        result = _reduce(op, [g["values"] for g in got])
        reply = json.dumps({"ok": True, "values": result}).encode() + b"\n"
        for r in members[1:]:
            try:
                st.peers[r].write(reply)
                st.peers[r].flush()
            except OSError:
                pass
        return result
    f = st.peers[0]
    try:
        f.write(json.dumps(me).encode() + b"\n")
        f.flush()
    except OSError as e:
        _hang(f"rank 0 is gone during {tag}#{seq}: {e}")
    try:
        line = f.readline()
    except OSError:
        line = b""
    if not line:
        _hang(f"rank 0 is gone (connection closed) during {tag}#{seq}")
    reply = json.loads(line)
    if not reply.get("ok"):
        raise RuntimeError(f"fake gloo: {reply.get('error')}")
    return list(reply["values"])


def _hang(message: str) -> NoReturn:
    """A collective whose peer is gone never completes (NCCL waits for it forever)."""
    sys.stderr.write(f"fake gloo: {message}: the collective hangs, as NCCL's would\n")
    sys.stderr.flush()
    while True:
        time.sleep(3600)


def _fail(st: _State, message: str) -> None:
    data = json.dumps({"ok": False, "error": message}).encode() + b"\n"
    for f in st.peers.values():
        try:
            f.write(data)
            f.flush()
        except OSError:
            pass
    raise RuntimeError(f"fake gloo: {message}")


def all_reduce(tensor: Any, op: str = ReduceOp.SUM, group: ProcessGroup | None = None, async_op: bool = False) -> None:
    result = _collective("all_reduce", list(tensor.values), op, group)
    tensor.values[:] = result


def barrier(group: ProcessGroup | None = None) -> None:
    _collective("barrier", [], None, group)


def new_group(ranks: list[int] | None = None, backend: str | None = None, **_: Any) -> ProcessGroup:
    """A group of `ranks` (default: the world). As in torch, every rank calls it for every group."""
    assert _state is not None
    ranks = list(range(_state.world)) if ranks is None else sorted(ranks)
    return ProcessGroup(ranks, ranks.index(_state.rank) if _state.rank in ranks else -1, backend or "gloo")


def destroy_process_group(group: ProcessGroup | None = None) -> None:
    global _state
    st = _state
    _state = None
    if st is None:
        return
    for f in st.peers.values():
        with contextlib.suppress(OSError):
            f.close()
    if st.server is not None:
        st.server.close()
