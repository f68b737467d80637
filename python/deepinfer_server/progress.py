"""`run-batch`'s progress: a bar redrawn in place on a terminal, plain lines when stderr is piped (a log file or
CI shows one line each time the counts move, at most every `PLAIN_EVERY_S`, and the last one always)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

BAR_WIDTH = 30
PLAIN_EVERY_S = 5.0


class Progress:
    """A batch's counts (`request_counts` of the Batch API) as they move."""

    def __init__(self, label: str, stream: TextIO | None = None) -> None:
        self.label = label
        self.out = stream or sys.stderr
        self.tty = self.out.isatty()
        self.start = time.monotonic()
        self.last_plain = 0.0
        self.last_text = ""

    def update(self, batch: dict[str, Any], final: bool = False) -> None:
        counts = batch.get("request_counts") or {}
        total, completed, failed = (int(counts.get(k) or 0) for k in ("total", "completed", "failed"))
        done = completed + failed
        elapsed = time.monotonic() - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"{(total - done) / rate:.0f} s" if rate > 0 and total > done else "-"
        pct = 100 * done // total if total else (100 if final else 0)
        text = f"{done}/{total} ({pct} %), {failed} failed, {rate:.1f}/s, ETA {eta}, {batch.get('status')}"
        if self.tty:
            filled = BAR_WIDTH * pct // 100
            bar = "#" * filled + "." * (BAR_WIDTH - filled)
            self.out.write(f"\r\x1b[K{self.label} [{bar}] {text}" + ("\n" if final else ""))
            self.out.flush()
            return
        now = time.monotonic()
        moved = text.split(",")[0] != self.last_text.split(",")[0]
        if final or (moved and now - self.last_plain >= PLAIN_EVERY_S):
            self.out.write(f"run-batch: {self.label} {text}\n")
            self.out.flush()
            self.last_plain, self.last_text = now, text
