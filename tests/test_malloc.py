"""`--malloc`: the entrypoint re-executes itself once on mimalloc when the system has it; ranks of a GPU engine
keep the system allocator."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import Server

from deepinfer_server.malloc import PRELOADED, find_mimalloc, without_preload
from deepinfer_server.ranks import Ranks

needs_mimalloc = pytest.mark.skipif(find_mimalloc() is None, reason="libmimalloc not installed (libmimalloc2.0)")


def maps_mimalloc(pid: int) -> bool:
    return "libmimalloc" in Path(f"/proc/{pid}/maps").read_text()


@needs_mimalloc
def test_auto_runs_server_and_sim_ranks_on_mimalloc(make_server: Callable[..., Server]) -> None:
    srv = make_server("--dp", "1")
    assert maps_mimalloc(srv.proc.pid)  # the same pid: the entrypoint re-executed itself
    assert all(maps_mimalloc(pid) for pid in srv.rank_pids())
    assert "memory allocator: mimalloc" in srv.log()
    r = srv.client().chat.completions.create(model="deepseek-v4.1-flash", messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].message.content


def test_system_keeps_glibc(make_server: Callable[..., Server]) -> None:
    srv = make_server("--dp", "1", "--malloc", "system")
    assert not maps_mimalloc(srv.proc.pid)
    assert "memory allocator: system (glibc)" in srv.log()


def test_gpu_engine_ranks_get_the_system_allocator_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LD_PRELOAD", "/lib/libmimalloc.so.2:/opt/other.so")
    monkeypatch.setenv(PRELOADED, "/lib/libmimalloc.so.2")
    sim = Ranks(argparse.Namespace(engine="sim"), Path("tok.json")).rank_env(0)
    gpu = Ranks(argparse.Namespace(engine="deepinfer"), Path("tok.json")).rank_env(0)
    assert sim["LD_PRELOAD"] == "/lib/libmimalloc.so.2:/opt/other.so"
    assert gpu["LD_PRELOAD"] == "/opt/other.so" and PRELOADED not in gpu
    only = without_preload({"LD_PRELOAD": "/lib/libmimalloc.so.2", PRELOADED: "/lib/libmimalloc.so.2", "A": "1"})
    assert only == {"A": "1"}


def test_required_mimalloc_missing_is_a_clear_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_server import malloc

    monkeypatch.delenv(PRELOADED, raising=False)
    monkeypatch.setattr(malloc, "find_mimalloc", lambda: None)
    with pytest.raises(SystemExit, match=r"apt-get install libmimalloc2\.0"):
        malloc.reexec_on_mimalloc("mimalloc")
    malloc.reexec_on_mimalloc("auto")  # without the library, auto keeps glibc and returns


@needs_mimalloc
def test_start_up_returns_freed_memory_and_then_restores_the_purge_delay() -> None:
    """Start-up frees tens of MB (a 128k tokenizer.json's parse) on a thread that then blocks serving; mimalloc's
    delayed purge would leave them resident. The option index must be mimalloc's purge delay: a value set through
    its environment variables reads back, is 0 inside the block and restored after it."""
    lib = find_mimalloc()
    assert lib is not None
    script = (
        "from deepinfer_server.malloc import mimalloc_purge_delay as d, returning_freed_memory as r\n"
        "before = d()\n"
        "with r():\n"
        "    inside = d()\n"
        "print(before, inside, d())\n"
    )
    env = {**os.environ, "LD_PRELOAD": lib, PRELOADED: lib, "MIMALLOC_RESET_DELAY": "77", "MIMALLOC_PURGE_DELAY": "77"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["77", "0", "77"]


def test_on_glibc_start_up_trims_the_heap(monkeypatch: pytest.MonkeyPatch) -> None:
    from deepinfer_server import malloc

    monkeypatch.delenv(PRELOADED, raising=False)
    assert malloc.mimalloc_purge_delay() is None
    with malloc.returning_freed_memory():  # malloc_trim afterwards; no mimalloc symbol is touched
        pass
