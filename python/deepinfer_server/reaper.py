"""Kills what a dead server leaves behind: `python -m deepinfer_server.reaper SHM_PREFIX [LOG_FORMAT]`, stdin a
pipe.

The launcher starts it before the ranks and writes each rank's pid (its process group: every rank leads one) to
the pipe. Only the server holds the pipe's write end, so end-of-file means the server is gone, however it ended
(SIGKILL included). The ranks die with the server (PR_SET_PDEATHSIG), but what they started does not: CP workers
that missed their own death signal, the engine's forked vision-encoder worker, processes stopped with SIGSTOP.
On EOF the reaper SIGKILLs every process still in those groups, removes the server's shared-memory files, and
exits. After a normal shutdown the launcher has already done both, and this finds nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

from deepinfer_server import logs

log = logging.getLogger("deepinfer_server.reaper")

SHM_DIR = Path("/dev/shm")


def _stat(pid: str) -> tuple[str, int, int] | None:
    """(state, process group, start time in clock ticks since boot) of a /proc entry, or None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) "; comm may contain spaces
    return fields[0], int(fields[2]), int(fields[19])


def _now_ticks() -> int:
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return int(uptime * os.sysconf("SC_CLK_TCK"))


def kill_groups(pgids: set[int], born_before: int | None = None) -> int:
    """SIGKILL every process in `pgids` (started before `born_before` ticks, so a group id reused after its
    members died is left alone). Stopped processes die too. Returns how many were signalled."""
    killed: set[int] = set()
    for _ in range(3):  # a member may fork while we scan
        found = 0
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in killed or int(entry) == os.getpid():
                continue
            st = _stat(entry)
            if st is None or st[0] in "ZX" or st[1] not in pgids or (born_before is not None and st[2] > born_before):
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(int(entry), signal.SIGKILL)
                killed.add(int(entry))
                found += 1
        if not found:
            break
    return len(killed)


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to SIGKILL this process when the server dies (Linux PR_SET_PDEATHSIG): the ranks and the
    grammar sandbox call it first thing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before the prctl took effect
        os._exit(1)


def main(argv: list[str]) -> int:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)  # only the end of the server ends this process
    prefix = argv[0] if argv else ""
    logs.configure("INFO", argv[1] if len(argv) > 1 else "text", "deepinfer-server reaper: %(message)s")
    data = b""
    while chunk := os.read(0, 4096):
        data += chunk
    born_before = _now_ticks()
    pgids = {int(x) for x in data.split() if x.isdigit()}
    killed = kill_groups(pgids, born_before) if pgids else 0
    removed = 0
    if prefix.startswith("deepinfer-"):
        for path in SHM_DIR.glob(prefix + "*"):
            with contextlib.suppress(OSError):
                if path.is_dir():
                    shutil.rmtree(path)  # the media directory
                else:
                    path.unlink()
                removed += 1
    if killed or removed:
        log.warning("killed %d leftover process(es), removed %d file(s)", killed, removed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
