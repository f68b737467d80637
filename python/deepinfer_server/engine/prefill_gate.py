"""`--max-num-partial-prefills K`: at most K requests of a rank are in prefill at once, the rest wait here, in
arrival order, before the engine sees them (vLLM's flag of the same name). `--max-long-partial-prefills L` bounds
only the prompts of `--long-prefill-token-threshold` tokens or more (vLLM's flags too): a short prompt passes the
long ones waiting here, and a burst of short chat prompts is never held back.

Why: an engine with chunked prefill runs every admitted prompt's chunks side by side, so a burst of long prompts
on one rank all finish prefill together, at the end: every request gets the worst TTFT, and the decode steps of the
running streams stretch with the combined chunks. Handing the engine K prompts at a time, first come first served,
gives the first ones their tokens early and keeps the other streams' steps short, for the same total prefill work.

The gate wraps the engine and counts a request as prefilling from `add` until the engine reports its first token
(`first_token_times`, which the engine already keeps for the TTFT breakdown: no per-token work here) or its end.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any, cast

from deepinfer_server.engine.base import Engine, Output, Published, Submit, TimesFirstTokens


class PrefillGate:
    """An engine in front of an engine: the rank loop drives it as it drives the engine itself."""

    def __init__(self, engine: Engine, limit: int, long_limit: int = 0, long_tokens: int = 0) -> None:
        self.engine, self.limit = engine, limit
        self.long_limit, self.long_tokens = long_limit, long_tokens
        self.waiting: deque[Submit] = deque()
        self.prefilling: set[int] = set()
        self.prefilling_long: set[int] = set()
        # When the rank took each request from its ring: the engine's own "taken" would start at its release
        # from the gate, and hide the wait here (the TTFT breakdown counts it in `engine_queue`).
        self.taken: dict[int, float] = {}
        self._firsts: list[tuple[int, float, float]] = []
        self._times = cast(TimesFirstTokens, engine).first_token_times  # the rank wraps only engines that have it

    def __getattr__(self, name: str) -> Any:  # everything the gate does not change: the engine's own
        return getattr(self.engine, name)

    @property
    def quiet_step(self) -> bool:
        return self.engine.quiet_step

    @quiet_step.setter
    def quiet_step(self, value: bool) -> None:
        self.engine.quiet_step = value

    # -- requests ------------------------------------------------------------------------------------------------
    def add(self, req: Submit) -> list[Output]:
        self.taken[req.request_id] = time.perf_counter()
        if not self._fits(req) or (self.waiting and self._is_long(req)):  # long ones keep their order
            self.waiting.append(req)
            return []
        return self._admit(req)

    def _is_long(self, req: Submit) -> bool:
        return self.long_limit > 0 and len(req.prompt) >= self.long_tokens

    def _fits(self, req: Submit) -> bool:
        if self.limit and len(self.prefilling) >= self.limit:
            return False
        return not (self._is_long(req) and len(self.prefilling_long) >= self.long_limit)

    def abort(self, request_ids: list[int]) -> None:
        gone = set(request_ids)
        if self.waiting:
            self.waiting = deque(r for r in self.waiting if r.request_id not in gone)
        self.prefilling -= gone
        self.prefilling_long -= gone
        for rid in gone:
            self.taken.pop(rid, None)
        self.engine.abort(request_ids)
        # Waiting requests move up at the next step (`_after`), whose outputs can carry a refusal of theirs.

    def has_work(self) -> bool:
        return bool(self.waiting) or self.engine.has_work()

    def load(self) -> tuple[int, int]:
        n, tokens = self.engine.load()
        return n + len(self.waiting), tokens + sum(len(r.prompt) for r in self.waiting)

    # -- steps: each way the engine hands out tokens ---------------------------------------------------------------
    def step(self) -> list[Published]:
        return self._after(self.engine.step())

    def commit(self) -> list[Published]:  # the sim in lockstep: plan() then commit()
        return self._after(self.engine.commit())  # type: ignore[attr-defined]

    def flush(self) -> list[Published]:  # DeepInfer going idle
        return self._after(self.engine.flush())  # type: ignore[attr-defined]

    def first_token_times(self) -> list[tuple[int, float, float]]:
        out, self._firsts = self._firsts, []
        return out

    def close(self) -> None:
        self.waiting.clear()
        self.engine.close()

    def _admit(self, req: Submit) -> list[Output]:
        out = self.engine.add(req)
        if out:  # an immediate output is the engine refusing it: never prefilling
            self.taken.pop(req.request_id, None)
        else:
            self.prefilling.add(req.request_id)
            if self._is_long(req):
                self.prefilling_long.add(req.request_id)
        return out

    def _after(self, out: list[Published]) -> list[Published]:
        firsts = self._times()  # first outputs, an engine error included (the engines report those too)
        for rid, taken, scheduled in firsts:
            self.prefilling.discard(rid)
            self.prefilling_long.discard(rid)
            self._firsts.append((rid, self.taken.pop(rid, taken), scheduled))
        self._release(out)
        return out

    def _release(self, out: list[Published]) -> None:
        """Admit waiting requests in arrival order while they fit; a short one may pass a long one that does not."""
        if not self.waiting:
            return
        kept: deque[Submit] = deque()
        for req in self.waiting:
            if self._fits(req) and not (kept and self._is_long(req)):
                out += self._admit(req)
            else:
                kept.append(req)
        self.waiting = kept
