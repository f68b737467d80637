"""The interface every engine behind a rank implements (simulated or DeepInfer), the abilities only some have, and
what an engine's server side hands the launcher (engine/registry.py holds each engine's entry).
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from enum import Enum
from typing import Any, NamedTuple, Protocol, TypeAlias

from deepinfer_server import _native

log = logging.getLogger("deepinfer_server.engine")


@dataclass(frozen=True, slots=True)
class Images:
    """A prompt's images, in placeholder order: encoded bytes (WebP, preprocessed by deepseek-recipe), their
    (width, height), and the prompt tokens they take beyond their placeholders."""

    data: list[bytes]
    sizes: list[tuple[int, int]]
    extra_tokens: int


@dataclass(slots=True)
class Submit:
    """One request as it arrives from the request ring."""

    request_id: int
    prompt: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    ignore_eos: bool
    # Logprobs wanted: None, or how many alternatives per token (0: the sampled token's own logprob alone).
    logprobs: int | None = None
    # A grammar on the output: DeepInfer's so_args, {"schema_type", "schema", "trigger_token_ids", "bound_token_id"}.
    so_args: dict[str, object] | None = None
    images: Images | None = None
    # The prompt tokens' logprobs wanted (their own, no alternatives), returned with the first token.
    prompt_logprobs: bool = False


# One token's logprob and its alternatives [(token id, logprob), ...], best first.
TokenLogprob = tuple[float, list[tuple[int, float]]]

# One request's part of a step, as the rank publishes it (rust/ring/py/entries.rs): `_native.Output`, built with
# named fields (request_id, tokens: new token ids or one token id, finish, reason of an error finish, logprobs one
# per token for a request that asked for them, the prompt's logprobs once with the first token of one that did).
Output = _native.Output
# A step's plain rows (new tokens and a finish code, nothing else) as columns: one record per step where an Output
# per row would cost a class construction each (rust/ring/py/step.rs). Published beside the step's Output records.
StepOutputs = _native.StepOutputs
# What an engine step returns and a rank publishes.
Published: TypeAlias = Output | StepOutputs


def rows(published: list[Published]) -> list[Output]:
    """The published rows one Output each, the columns' rows too (for readers that look at every row)."""
    out: list[Output] = []
    for item in published:
        if isinstance(item, StepOutputs):
            out += item.outputs()
        else:
            out.append(item)
    return out


def failed(request_id: int, reason: str) -> Output:
    """The output that ends a request with an error the client is told (`reason`)."""
    return Output(request_id=request_id, tokens=[], finish=_native.FINISH_ERROR, reason=reason)


# The ring's schema codes (rust/ring/records.rs, exported) -> so_args' schema_type.
SCHEMA_TYPES = {_native.SCHEMA_JSON: "json", _native.SCHEMA_REGEX: "regex", _native.SCHEMA_EBNF: "ebnf"}


def load_images(record: _native.SubmitImages | None) -> Images | str | None:
    """A SUBMIT record's images: read from the file it names, which is then unlinked. A string: why they could not
    be read (the request fails with it)."""
    if record is None:
        return None
    path, extra_tokens, sizes = record.path, record.extra_tokens, record.sizes
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        log.warning("cannot read a request's image file: %s", e)
        return "the request's image file could not be read"
    finally:
        with contextlib.suppress(OSError):
            os.unlink(path)
    if len(blob) != sum(n for _, _, n in sizes):
        return "the request's image file does not hold what its record says"
    data, at = [], 0
    for _, _, n in sizes:
        data.append(blob[at : at + n])
        at += n
    return Images(data, [(w, h) for w, h, _ in sizes], extra_tokens)


def so_args(constraint: _native.SubmitConstraint | None) -> dict[str, object] | None:
    """A SUBMIT record's constraint as DeepInfer's `SamplingParams.so_args`."""
    if constraint is None:
        return None
    schema_type, schema, triggers, bound = (
        constraint.schema_type,
        constraint.schema,
        constraint.triggers,
        constraint.bound,
    )
    args: dict[str, object] = {"schema_type": SCHEMA_TYPES[schema_type], "schema": schema}
    if triggers:
        args["trigger_token_ids"] = list(triggers)
    if bound is not None:
        args["bound_token_id"] = bound
    return args


class Engine(Protocol):
    """What the rank loop drives. All calls happen on the rank's single engine thread."""

    # True when the last step gave no request its first token and ended none: the rank may publish it without
    # waking the server (engine/loop.py). An engine that cannot tell keeps it False.
    quiet_step: bool

    def add(self, req: Submit) -> list[Output]:
        """Queue a request. Returns immediate outputs, e.g. an error finish for a prompt the engine rejects."""

    def abort(self, request_ids: list[int]) -> None:
        """Stop requests. The server has already ended them: nothing more may be published for them."""

    def has_work(self) -> bool:
        """True while any request is waiting or running on this rank."""

    def step(self) -> list[Published]:
        """Run one engine step and return the tokens it produced."""

    def load(self) -> tuple[int, int]:
        """(running + waiting requests, prompt tokens still to prefill), for dispatch by load."""

    def kv_usage(self) -> float:
        """Fraction of the KV cache in use (0-1)."""

    def kv_capacity_tokens(self) -> int:
        """Tokens the KV cache holds in all (0 if unknown); reported to gateways in /v1/loads."""

    def close(self) -> None:
        """Release the engine."""


class Ability(Enum):
    """What an engine does beyond `Engine`, each named by the members it stands for. An engine's entry in the
    registry (engine/registry.py) declares its abilities; the launcher and the rank use exactly those and never
    probe the engine for them (tests/test_engines.py holds each declaration against the engine's class)."""

    # It says when it took each request whose first token it just returned and when that step started
    # (`first_token_times`): the server's TTFT breakdown, and what --max-num-partial-prefills counts with
    # (engine/prefill_gate.py).
    FIRST_TOKEN_TIMES = ("first_token_times",)
    # It counts what /metrics shows of a real engine: speculative tokens drafted and accepted (`spec_tokens`),
    # preemptions (`preemptions`) and aborts sent again after the engine lost them (`re_aborts`).
    COUNTERS = ("spec_tokens", "preemptions", "re_aborts")
    # Its ranks step together through its own collectives: `sync`, the one all-reduce of a loop iteration, and
    # `flush` (engine/lockstep.py `LockstepEngine`, the loop `serve_lockstep`).
    COLLECTIVES = ("sync", "flush")
    # Its ranks can step together at the server's barrier (--sim-lockstep, _native.Lockstep), each step as long as
    # the slowest rank's: the step split in parts that engine/loop.py `serve_sim_lockstep` drives.
    BARRIER = ("step_start", "plan", "ride_along", "wait_until", "step_done", "commit")
    # It loads another checkpoint in place (`reload`: /update_weights_from_disk, rust/path/reload.rs), the rank
    # process and its rings staying up; if that fails it keeps serving what it served.
    RELOAD = ("reload",)


class TimesFirstTokens(Protocol):
    """An engine with `Ability.FIRST_TOKEN_TIMES`."""

    def first_token_times(self) -> list[tuple[int, float, float]]:
        """(request, taken, step start) of the first tokens in the outputs just returned, once each."""


class Reloads(Protocol):
    """An engine with `Ability.RELOAD`."""

    def reload(self, model_path: str) -> None:
        """Serve the checkpoint in `model_path` from now on (the server drained this rank first); raise, still
        serving the old one, if it cannot (`EngineLost` if it serves neither)."""


class Counting(Protocol):
    """An engine with `Ability.COUNTERS`: totals since it started."""

    re_aborts: int

    def spec_tokens(self) -> tuple[int, int]:
        """(draft tokens proposed, accepted)."""

    def preemptions(self) -> int:
        """Sequences preempted (and recomputed)."""


class ConfigError(ValueError):
    """A deployment setting the engine cannot run with; the message names the setting."""


class EngineLost(RuntimeError):
    """The engine is gone and cannot be brought back (a reload that could load neither checkpoint): the rank ends."""


class RankLaunch(NamedTuple):
    """One rank as its engine's server side sets it up before any rank starts (an entry's `launch`)."""

    engine_config: dict[str, Any]  # what the engine's `build` gets in the rank process
    env: dict[str, str]  # variables the rank's environment gets over the server's
