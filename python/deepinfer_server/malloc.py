"""Run the server on mimalloc when the system has it (Debian/Ubuntu: `apt-get install libmimalloc2.0`).

Prompt encoding in deepseek-recipe's tokenizer allocates heavily from several threads at once, a pattern glibc
malloc handles poorly (arena locks, consolidation). Preloading mimalloc measured 14 % more non-streaming
requests/s and 6 % less CPU per streamed token here (BENCHMARKS.md). A preload must be in place before the
process starts, so the entrypoint re-executes itself once with LD_PRELOAD set.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import glob
import os
import sys

# Set in the re-executed process: the preloaded library, so the switch happens once and ranks can undo it.
PRELOADED = "DEEPINFER_SERVER_PRELOADED_MALLOC"
# mimalloc returns a freed page to the OS only after a delay, and only when the thread that freed it allocates again.
# The thread that parses tokenizer.json at start-up then blocks serving, so ~50 MB of a 128k vocabulary's transient
# objects would stay resident for good. Purge at once instead: measured no cost per token (BENCHMARKS.md).
# mimalloc 2.0 reads MIMALLOC_RESET_DELAY, 2.1+ MIMALLOC_PURGE_DELAY; each ignores the other. A user's setting wins.
PURGE_AT_ONCE = {"MIMALLOC_RESET_DELAY": "0", "MIMALLOC_PURGE_DELAY": "0"}
_SEARCH = ("/usr/lib/*-linux-gnu/libmimalloc.so.*", "/usr/lib64/libmimalloc.so.*", "/usr/local/lib/libmimalloc.so*")


def find_mimalloc() -> str | None:
    """A loadable libmimalloc, or None."""
    for pattern in _SEARCH:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return path
    name = ctypes.util.find_library("mimalloc")
    return name or None


def reexec_on_mimalloc(choice: str) -> None:
    """`choice`: auto (mimalloc if installed), mimalloc (required), system (glibc). Returns only if no switch
    is needed; otherwise replaces the process (same pid, same arguments)."""
    if choice == "system" or os.environ.get(PRELOADED):
        return
    lib = find_mimalloc()
    if lib is None:
        if choice == "mimalloc":
            raise SystemExit("--malloc mimalloc: libmimalloc not found (Debian/Ubuntu: apt-get install libmimalloc2.0)")
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[PRELOADED] = lib
    for key, value in PURGE_AT_ONCE.items():
        env.setdefault(key, value)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def without_preload(env: dict[str, str]) -> dict[str, str]:
    """`env` with our preload taken out again (for processes that should keep the system allocator)."""
    lib = env.pop(PRELOADED, None)
    if lib:
        rest = [p for p in env.get("LD_PRELOAD", "").split(":") if p and p != lib]
        if rest:
            env["LD_PRELOAD"] = ":".join(rest)
        else:
            env.pop("LD_PRELOAD", None)
    return env


def return_freed_memory() -> None:
    """After start-up: give the memory its transient objects used back to the OS. mimalloc does so by itself
    (`PURGE_AT_ONCE`); glibc keeps freed heap memory until `malloc_trim`."""
    gc.collect()
    if os.environ.get(PRELOADED):
        return
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
        ctypes.CDLL(None).malloc_trim(0)
