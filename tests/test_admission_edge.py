"""Admission at the edge: a closed loop of exactly capacity clients, each sending its next request the moment it has
the whole previous response, must never see a 429. The previous request's slot has to be free before its last byte
reaches the client (it used to be freed only after the rank_io thread finished the whole batch)."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import pytest
from conftest import MODEL, Server

DP, SEQS = 2, 16
CAPACITY = DP * SEQS
PER_CLIENT = 40


def closed_loop(srv: Server, stream: bool, path: str, body: dict[str, Any]) -> dict[int, int]:
    """CAPACITY clients on keep-alive sockets, each sending its next request as soon as its response is complete."""
    host, port = srv.url.removeprefix("http://").split(":")
    raw = json.dumps({"model": MODEL, "stream": stream, **body}).encode()
    request = (
        f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw
    statuses: dict[int, int] = {}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def client() -> None:
        try:
            with socket.create_connection((host, int(port)), timeout=30) as s:
                f = s.makefile("rb")
                for _ in range(PER_CLIENT):
                    s.sendall(request)
                    status = int(f.readline().split()[1])
                    headers = {}
                    while (line := f.readline()) not in (b"\r\n", b""):
                        k, _, v = line.decode().partition(":")
                        headers[k.strip().lower()] = v.strip()
                    if "content-length" in headers:
                        f.read(int(headers["content-length"]))
                    else:  # chunked: read to the terminating chunk
                        while True:
                            size = int(f.readline().strip(), 16)
                            f.read(size + 2)
                            if size == 0:
                                break
                    with lock:
                        statuses[status] = statuses.get(status, 0) + 1
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(CAPACITY)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    return statuses


DOORS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}),
    "completions": ("/v1/completions", {"prompt": "x", "max_tokens": 4}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4}),
    "responses": ("/v1/responses", {"input": "x", "max_output_tokens": 4}),
}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("door", sorted(DOORS))
def test_closed_loop_at_capacity_gets_no_429(make_server: Any, door: str, stream: bool) -> None:
    srv = make_server("--dp", str(DP), "--max-num-seqs", str(SEQS), "--sim-decode-step-ms", "1")
    path, body = DOORS[door]
    statuses = closed_loop(srv, stream, path, {**body, "ignore_eos": True})
    assert statuses == {200: CAPACITY * PER_CLIENT}, statuses
