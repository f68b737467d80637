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
from collections.abc import Iterator

# Set in the re-executed process: the preloaded library, so the switch happens once and ranks can undo it.
PRELOADED = "DEEPINFER_SERVER_PRELOADED_MALLOC"
# mimalloc's option for how long a freed page waits before it goes back to the OS: `mi_option_purge_delay` in 2.1+
# and 3.x, `mi_option_reset_delay` in 2.0 (MIMALLOC_PURGE_DELAY / MIMALLOC_RESET_DELAY in the environment).
MI_OPTION_PURGE_DELAY = 15
_SEARCH = ("/usr/lib/*-linux-gnu/libmimalloc.so.*", "/usr/lib64/libmimalloc.so.*", "/usr/local/lib/libmimalloc.so*")


def find_mimalloc() -> str | None:
    """A loadable libmimalloc, or None."""
    for pattern in _SEARCH:
        for path in sorted(glob.glob(pattern)):
            if os.path.isfile(path):
                return path
    name = ctypes.util.find_library("mimalloc")
    return name or None


def reexec_on_mimalloc(choice: str, argv: list[str] | None = None, extra_env: dict[str, str] | None = None) -> None:
    """`choice`: auto (mimalloc if installed), mimalloc (required), system (glibc). Returns only if no switch
    is needed and no `argv` replaces the arguments; otherwise replaces the process (same pid), with `extra_env`."""
    env = {**os.environ, **(extra_env or {})}
    lib = None if choice == "system" or os.environ.get(PRELOADED) else find_mimalloc()
    if lib is None and choice == "mimalloc" and not os.environ.get(PRELOADED):
        raise SystemExit("--malloc mimalloc: libmimalloc not found (Debian/Ubuntu: apt-get install libmimalloc2.0)")
    if lib is None and argv is None:
        return
    if lib is not None:
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
        env[PRELOADED] = lib
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *(sys.orig_argv[1:] if argv is None else argv)], env)


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


def mimalloc_purge_delay() -> int | None:
    """mimalloc's purge delay in ms, or None when the process does not run on mimalloc."""
    if not os.environ.get(PRELOADED):
        return None
    get = ctypes.CDLL(None).mi_option_get
    get.restype = ctypes.c_long
    return int(get(MI_OPTION_PURGE_DELAY))


@contextlib.contextmanager
def returning_freed_memory() -> Iterator[None]:
    """Start-up builds and drops large transient objects (parsing a 128k tokenizer.json); give that memory back.

    mimalloc purges a freed page only after a delay, and only when the thread that freed it allocates again: the
    thread that starts the server then blocks serving, so ~50 MB would stay resident for good. Inside the block it
    purges at once; afterwards the delay is what it was (the default suits the hot path). glibc keeps freed heap
    memory until `malloc_trim`."""
    delay = mimalloc_purge_delay()
    if delay is not None:
        ctypes.CDLL(None).mi_option_set(MI_OPTION_PURGE_DELAY, ctypes.c_long(0))
    try:
        yield
    finally:
        gc.collect()
        if delay is not None:
            ctypes.CDLL(None).mi_option_set(MI_OPTION_PURGE_DELAY, ctypes.c_long(delay))
        else:
            with contextlib.suppress(OSError, AttributeError):  # AttributeError: not glibc
                ctypes.CDLL(None).malloc_trim(0)
