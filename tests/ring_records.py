"""The ring's request records as plain tuples, so a test can compare a whole drain with one `==`:
`(KIND_SUBMIT, request_id, prompt, max_tokens, temperature, top_p, top_k, seed, ignore_eos, (logprobs,
prompt_logprobs), constraint, images)`, `(KIND_ABORT, request_id)`, `(KIND_SHUTDOWN,)`; a constraint as
`(schema_type, schema, triggers, bound)` and images as `(path, extra_tokens, sizes)`."""

from __future__ import annotations

from typing import Any

from deepinfer_server import _native


def as_tuple(r: _native.Submit | _native.Abort | _native.Shutdown) -> tuple[Any, ...]:
    if isinstance(r, _native.Submit):
        return (
            _native.KIND_SUBMIT,
            r.request_id,
            r.prompt,
            r.max_tokens,
            r.temperature,
            r.top_p,
            r.top_k,
            r.seed,
            r.ignore_eos,
            (r.logprobs, r.prompt_logprobs),
            None if (c := r.constraint) is None else (c.schema_type, c.schema, c.triggers, c.bound),
            None if (im := r.images) is None else (im.path, im.extra_tokens, im.sizes),
        )
    if isinstance(r, _native.Abort):
        return (_native.KIND_ABORT, r.request_id)
    assert isinstance(r, _native.Shutdown), r
    return (_native.KIND_SHUTDOWN,)


def drained(ring: _native.Ring) -> list[tuple[Any, ...]]:
    """Everything waiting in a request ring, as tuples."""
    return [as_tuple(r) for r in ring.drain_requests()]
