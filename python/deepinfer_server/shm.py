"""This server's names in /dev/shm: a prefix unique on the host, held by a lock file for as long as the server lives
(`claim_instance`), and the sweep of what servers that died left there (`clean_stale_segments`)."""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import shutil
from pathlib import Path

log = logging.getLogger("deepinfer_server")

SHM_DIR = Path("/dev/shm")
SHM_PREFIX = "deepinfer-"


def claim_instance() -> tuple[str, int]:
    """A name prefix for this server's shared-memory files, unique on the host, and an open file descriptor holding
    the prefix's lock file (`<prefix>-lock`, flock'ed until the process ends, however it ends).

    The lock, not the pid, says whether a prefix's owner lives: with host IPC (`docker run --ipc=host`, GPUStack)
    servers in several containers share /dev/shm, and each may be PID 1 in its own. The lock file is locked under a
    hidden name, then renamed into place, so no sweep ever sees it unlocked."""
    prefix = f"{SHM_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    hidden = SHM_DIR / f".{prefix}-lock"
    fd = os.open(hidden, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.rename(hidden, SHM_DIR / f"{prefix}-lock")
    return prefix, fd


def _owner_alive(prefix: str) -> bool:
    """Whether the server that made the files of `prefix` (deepinfer-PID-HEX) still runs: its lock file is held, or,
    for files of a server without one (an older version), its pid lives."""
    try:
        fd = os.open(SHM_DIR / f"{prefix}-lock", os.O_RDWR)
    except FileNotFoundError:
        pid = int(prefix.split("-")[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    except OSError:
        return True  # not ours to judge (another user's, say)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def clean_stale_segments() -> None:
    """Unlink the shared-memory files of servers that died before they could (see `claim_instance`)."""
    try:
        entries = list(SHM_DIR.glob(SHM_PREFIX + "*"))
    except OSError:
        return
    owners: dict[str, list[Path]] = {}
    for path in entries:
        parts = path.name.split("-")
        if len(parts) >= 3 and parts[1].isdigit():
            owners.setdefault("-".join(parts[:3]), []).append(path)
    for prefix, paths in owners.items():
        if _owner_alive(prefix):
            continue
        # The lock file goes last: until then a sweep running beside this one still sees the owner as dead.
        for path in sorted(paths, key=lambda p: p.name.endswith("-lock")):
            try:
                if path.is_dir():
                    shutil.rmtree(path)  # a media directory
                else:
                    path.unlink()
                log.info("removed stale shared-memory segment %s", path)
            except OSError:
                pass
