"""Client grammars compiled and checked in a child process. llguidance is native code: a schema that crashes it
(integer bounds next to -2^63 made it recurse until the stack ran out, a segfault that took the whole server with
it) or runs away with time or memory takes down only this child. A child that dies or overruns is replaced and
the grammar refused with a 400; the server never runs the client's grammar through llguidance in its own process.

The protocol is a line of JSON each way: `[schema_type, schema]` in, `[grammar, error]` out (JSON strings carry no
raw newline). One check at a time; the parent holds a lock, and the grammar thread is the only steady caller."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref

from deepinfer_server.grammar.base import GrammarLimits, cpu_message

# The child's address space: llguidance and Python take about 1.1 GiB of it idle; a grammar that wants more than
# this is refused (an allocation failure aborts the child, not the server).
CHILD_ADDRESS_SPACE = 6 << 30


class GrammarSandbox:
    """Runs `check.compile_checked` in a child process (started on first use, replaced when it fails)."""

    def __init__(self, limits: GrammarLimits) -> None:
        self.limits = limits
        # Wall time for one check: its CPU limit with room for a loaded machine; past it the child is killed.
        self.wall_seconds = max(5.0, 10 * limits.cpu_seconds)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ended: weakref.finalize[[subprocess.Popen[bytes]], GrammarSandbox] | None = None
        self.lock = threading.Lock()
        self.restarts = 0

    def compile(self, schema_type: str, schema: str) -> tuple[str | None, str | None]:
        """(grammar, None) or (None, why)."""
        with self.lock:
            proc = self._child()
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps([schema_type, schema]).encode() + b"\n")
                proc.stdin.flush()
                line = self._answer(proc)
            except OSError:
                line = None
            if isinstance(line, bytes):
                grammar, error = json.loads(line)
                return grammar, error
            self._replace()
            if line == "timeout":
                return None, cpu_message(self.limits)
            return None, "the grammar compiler failed on this grammar; simplify the schema or pattern"

    def close(self) -> None:
        with self.lock:
            self._replace()

    def _child(self) -> subprocess.Popen[bytes]:
        if self.proc is None or self.proc.poll() is not None:
            limits = (self.limits.max_bytes, self.limits.cpu_seconds, self.limits.cache_bytes)
            args = [str(os.getpid()), *map(str, limits)]
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "deepinfer_server.grammar.child", *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                close_fds=True,
            )
            # Ended with its owner (a codec dropped in a test) or at exit: end of input ends the child.
            self.ended = weakref.finalize(self, _end, self.proc)
        return self.proc

    def _answer(self, proc: subprocess.Popen[bytes]) -> bytes | str:
        """The child's answer line, "timeout" past the wall limit, or "died"."""
        assert proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + self.wall_seconds
        chunks: list[bytes] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return "died"
            chunks.append(chunk)
            if chunk.endswith(b"\n"):
                return b"".join(chunks)

    def _replace(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            if self.ended is not None:
                self.ended()
            self.proc = None
            self.restarts += 1


def _end(proc: subprocess.Popen[bytes]) -> None:
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            pipe.close()
    try:
        proc.wait(2)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
