"""The bounded cache of checked grammars (`GrammarCache`): each new grammar is compiled and checked in the
sandbox's child process (grammar/sandbox.py), and the answer, a grammar or why it failed, kept by bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict

from deepinfer_server.grammar.base import GrammarError, GrammarLimits, GrammarTooCostly
from deepinfer_server.grammar.check import compile_checked
from deepinfer_server.grammar.sandbox import GrammarSandbox


class GrammarCache:
    """Checked grammars by (schema_type, schema): the llguidance grammar, or why it failed. An LRU bounded in
    bytes (`limits.cache_bytes`); a grammar over `limits.max_bytes` is refused before any work."""

    def __init__(self, limits: GrammarLimits | None = None, isolated: bool = True) -> None:
        self.limits = limits or GrammarLimits()
        self.parser_limits = self.limits.parser_limits()
        # A client's grammar goes through llguidance in a child process (grammar/sandbox.py).
        self.sandbox = GrammarSandbox(self.limits) if isolated else None
        self.entries: OrderedDict[tuple[str, str], tuple[str | None, str | None]] = OrderedDict()
        self.bytes = 0
        self.lock = threading.Lock()
        self.hits = self.misses = 0

    def check(self, schema_type: str, schema: str) -> str:
        """The compiled grammar; raises GrammarError (cached too) for one that fails."""
        size = len(schema.encode())
        if size > self.limits.max_bytes:
            raise GrammarTooCostly(
                f"the grammar is {size} bytes; this server takes at most {self.limits.max_bytes} (--max-grammar-bytes)"
            )
        key = (schema_type, schema)
        with self.lock:
            hit = self.entries.get(key)
            if hit is not None:
                self.entries.move_to_end(key)
                self.hits += 1
        if hit is None:
            self.misses += 1
            hit = self.sandbox.compile(schema_type, schema) if self.sandbox else self._compile(schema_type, schema)
            self._store(key, hit)
        grammar, error = hit
        if error is not None:
            raise GrammarError(error)
        assert grammar is not None
        return grammar

    def _compile(self, schema_type: str, schema: str) -> tuple[str | None, str | None]:
        return compile_checked(schema_type, schema, self.limits, self.parser_limits)

    def _store(self, key: tuple[str, str], hit: tuple[str | None, str | None]) -> None:
        cost = _entry_bytes(key, hit)
        if cost > self.limits.cache_bytes:
            return
        with self.lock:
            if key in self.entries:
                return
            self.entries[key] = hit
            self.bytes += cost
            while self.bytes > self.limits.cache_bytes:
                old_key, old = self.entries.popitem(last=False)
                self.bytes -= _entry_bytes(old_key, old)


def _entry_bytes(key: tuple[str, str], hit: tuple[str | None, str | None]) -> int:
    """What an entry holds: its key's text and its grammar or error (Python strings, about a byte a character)."""
    return 128 + len(key[1]) + len(hit[0] or "") + len(hit[1] or "")
