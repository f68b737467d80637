"""Wire conformance of the Messages door: every body and SSE event against the `anthropic` SDK's own types, strictly
(pydantic's strict mode, and no key the type does not declare). Called by `wire_schema.check_response`."""

from __future__ import annotations

import json
from typing import Any

import anthropic.types as t
import pydantic
import wire_schema

_EVENTS = pydantic.TypeAdapter(t.RawMessageStreamEvent)
# Documented by Anthropic (413) but not among the SDK's error types.
_UNTYPED_ERRORS = {"request_too_large"}


def _extras(value: Any, path: str = "") -> list[str]:
    """Keys a model did not declare, anywhere inside `value`."""
    found: list[str] = []
    if isinstance(value, pydantic.BaseModel):
        found += [f"{path}.{k}".lstrip(".") for k in (value.model_extra or {})]
        for name in type(value).model_fields:
            found += _extras(getattr(value, name), f"{path}.{name}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found += _extras(v, f"{path}.{i}")
    return found


def _validate(kind: Any, doc: Any) -> list[str]:
    try:
        if isinstance(kind, pydantic.TypeAdapter):
            model = kind.validate_python(doc, strict=True)
        else:
            model = kind.model_validate(doc, strict=True)
    except pydantic.ValidationError as e:
        return [f"{getattr(kind, '__name__', 'event')}: {err['loc']}: {err['msg']}" for err in e.errors()[:5]]
    return [f"undeclared key {k}" for k in _extras(model)]


def _error(doc: Any) -> list[str]:
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict) and doc["error"].get("type") in _UNTYPED_ERRORS:
        doc = {**doc, "error": {**doc["error"], "type": "api_error"}}
    return _validate(t.ErrorResponse, doc)


def check(path: str, status: int, content_type: str, body: bytes, complete: bool) -> list[str]:
    if not body:
        return []
    if content_type.startswith("text/event-stream"):
        events, found = wire_schema.sse_events(body, complete)
        for name, data in events:
            doc = json.loads(data)
            if doc.get("type") != name:
                found.append(f"event {name!r} carries type {doc.get('type')!r}")
            if name == "ping":
                found += [] if doc == {"type": "ping"} else [f"ping event {data!r}"]
            elif name == "error":
                found += _error(doc)
            else:
                found += _validate(_EVENTS, doc)
        if complete and events and events[-1][0] not in ("message_stop", "error"):
            found.append(f"the stream ended with {events[-1][0]!r}, not message_stop")
        return found
    if not complete or not content_type.startswith("application/json"):
        return []
    doc = json.loads(body)
    if status >= 400:
        return _error(doc)
    return _validate(t.MessageTokensCount if path.endswith("count_tokens") else t.Message, doc)
