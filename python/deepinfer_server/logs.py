"""Python-side log lines (start-up, ranks) in the server's two formats: text with control characters escaped, or
one JSON object per line, so that no value can break a line or forge one."""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
from types import TracebackType

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def escape_controls(text: str) -> str:
    """Line breaks and other control characters as escapes (the Rust side writes the same)."""
    simple = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    return _CONTROL.sub(lambda m: simple.get(m.group(), f"\\u{{{ord(m.group()):x}}}"), text)


class TextFormatter(logging.Formatter):
    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escape_controls(record.message)
        return super().formatMessage(record)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = {"message": record.getMessage()}
        if record.exc_info:
            fields["exception"] = self.formatException(record.exc_info)
        line = {"timestamp": self.formatTime(record), "level": record.levelname, "target": record.name}
        return json.dumps({**line, "fields": fields}, ensure_ascii=False)


def configure(level: str, log_format: str, text_format: str) -> None:
    """Log to stderr at `level`, as JSON lines (`log_format` "json") or as `text_format`. Uncaught exceptions (in
    any thread) and warnings go through the same handler, so no traceback reaches stderr as raw lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(text_format))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    logging.captureWarnings(True)
    sys.excepthook = _log_uncaught
    threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback, a.thread)


def _log_uncaught(
    kind: type[BaseException],
    value: BaseException | None,
    tb: TracebackType | None,
    thread: threading.Thread | None = None,
) -> None:
    if issubclass(kind, KeyboardInterrupt) or value is None:
        return
    where = f" in thread {thread.name}" if thread is not None else ""
    logging.getLogger("deepinfer_server").critical("uncaught exception%s", where, exc_info=(kind, value, tb))
