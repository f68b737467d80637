"""Fuzzing: the OpenAPI document against a live server (schemathesis), the ring record codec through the Python
bindings (hypothesis), and random JSON bodies against the request parser over HTTP (hypothesis).

Bounded: each property runs a fixed number of examples with the deadline off, so the module stays well under a
minute on two cores.
"""

from __future__ import annotations

import copy
import json
import mmap
import re
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from conftest import MODEL, Server, start_server
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from deepinfer_server._native import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_STOP,
    Output,
    Ring,
    RingError,
    SubmitInput,
)
from ring_records import drained

OPENAPI = Path(__file__).resolve().parents[1] / "python" / "deepinfer_server" / "openapi.json"
# What a stack trace or a leaked source location looks like in an error message.
LEAK = re.compile(r"Traceback \(most recent call last\)|File \"|\.py\"?, line \d+|\.rs:\d+|panicked at|/home/|/work/")
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), print_blob=True)


def fuzz(max_examples: int) -> settings:
    return settings(FUZZ, max_examples=max_examples)


def assert_envelope(status: int, body: str, where: str = "") -> None:
    """A 4xx body is exactly the OpenAI error envelope, and leaks no stack trace or path."""
    try:
        doc = json.loads(body)
    except ValueError:
        raise AssertionError(f"{where}: {status} body is not JSON: {body[:300]!r}") from None
    assert isinstance(doc, dict) and set(doc) == {"error"}, f"{where}: {status} {body[:300]}"
    err = doc["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, f"{where}: {body[:300]}"
    assert isinstance(err["message"], str) and err["message"], body[:300]
    assert isinstance(err["type"], str), body[:300]
    assert err["param"] is None or isinstance(err["param"], str), body[:300]
    assert err["code"] is None or isinstance(err["code"], str), body[:300]
    assert not LEAK.search(err["message"]), f"{where}: error message leaks internals: {err['message'][:300]!r}"


def assert_healthy(srv: Server) -> None:
    assert srv.proc.poll() is None, f"server died (exit {srv.proc.returncode}):\n{srv.log()[-3000:]}"
    r = httpx.get(f"{srv.url}/health", timeout=5)
    assert r.status_code == 200, r.text


def small_server(max_model_len: int, *extra: str) -> Iterator[Server]:
    """One rank, 4 sequences, zero-cost sim: what the fuzzers throw at, stopped when the module is done."""
    srv = start_server(
        *("--served-model-name", MODEL, "--dp", "1", "--max-num-seqs", "4"),
        *("--max-model-len", str(max_model_len), "--sim-decode-step-ms", "0"),
        *extra,
    )
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[Server]:
    yield from small_server(4096)


# ----------------------------------------------------------------------------------------------- schemathesis


def load_openapi(srv: Server) -> tuple[dict[str, Any], str]:
    """The served document (GET /openapi.json), or the file on disk when the route does not serve it."""
    r = httpx.get(f"{srv.url}/openapi.json", timeout=5)
    if r.status_code == 200:
        return r.json(), "served"
    return json.loads(OPENAPI.read_text(encoding="utf-8")), f"disk (GET /openapi.json -> {r.status_code})"


def test_openapi_document_matches_the_file(fuzz_server: Server) -> None:
    doc, source = load_openapi(fuzz_server)
    print(f"\nopenapi source: {source}")
    assert doc == json.loads(OPENAPI.read_text(encoding="utf-8"))
    assert doc["openapi"].startswith("3.0")
    assert {"/v1/chat/completions", "/v1/models", "/health", "/metrics"} <= set(doc["paths"])


def bounded_for_fuzzing(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of the document that keeps generation cheap: the served model only, and at most 16 tokens."""
    doc = copy.deepcopy(doc)
    req = doc["components"]["schemas"]["ChatCompletionRequest"]
    req["properties"]["model"] = {"type": "string", "enum": [MODEL]}
    for key in ("max_tokens", "max_completion_tokens"):
        req["properties"][key]["maximum"] = 16
    req["required"] = [*req["required"], "max_tokens"]
    for name, key in (
        ("CompletionRequest", "max_tokens"),
        ("MessagesRequest", "max_tokens"),
        ("ResponsesRequest", "max_output_tokens"),
    ):
        req = doc["components"]["schemas"][name]
        req["properties"]["model"] = {"type": "string", "enum": [MODEL]}
        req["properties"][key]["maximum"] = 16
        req["required"] = sorted({*req["required"], key})
    return doc


def assert_anthropic_envelope(status: int, body: str, where: str = "") -> None:
    """A 4xx body on the Messages door is Anthropic's envelope, and leaks nothing."""
    doc = json.loads(body)
    assert set(doc) == {"type", "error"} and doc["type"] == "error", f"{where}: {status} {body[:300]}"
    assert set(doc["error"]) == {"type", "message"} and doc["error"]["message"], f"{where}: {body[:300]}"
    assert not LEAK.search(doc["error"]["message"]), f"{where}: error message leaks internals: {body[:300]}"


OPERATIONS = [
    ("/v1/chat/completions", "POST", "positive"),
    ("/v1/chat/completions", "POST", "negative"),
    ("/v1/models", "GET", "positive"),
    ("/health", "GET", "positive"),
    ("/metrics", "GET", "positive"),
    ("/v1/chat/completions/render", "POST", "positive"),
    ("/version", "GET", "positive"),
    ("/get_load", "GET", "positive"),
    ("/v1/loads", "GET", "positive"),
    ("/server_info", "GET", "positive"),
    ("/model_info", "GET", "positive"),
    *(
        (door, "POST", mode)
        for door in ("/v1/completions", "/v1/messages", "/v1/responses")
        for mode in ("positive", "negative")
    ),
    ("/v1/messages/count_tokens", "POST", "positive"),
    ("/tokenize", "POST", "positive"),
    ("/detokenize", "POST", "positive"),
]


@pytest.mark.parametrize(("path", "method", "mode"), OPERATIONS, ids=[f"{m} {p} {g}" for p, m, g in OPERATIONS])
def test_schemathesis(fuzz_server: Server, path: str, method: str, mode: str) -> None:
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.generation import GenerationMode
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    doc, source = load_openapi(fuzz_server)
    schema = schemathesis.openapi.from_dict(bounded_for_fuzzing(doc))
    op = schema[path][method]
    checks = [
        not_a_server_error,
        status_code_conformance,
        content_type_conformance,
        response_headers_conformance,
        response_schema_conformance,
    ]
    counts: dict[int, int] = {}
    gen_mode = GenerationMode.POSITIVE if mode == "positive" else GenerationMode.NEGATIVE

    @fuzz(60)
    @given(case=op.as_strategy(generation_mode=gen_mode))
    def run(case: Any) -> None:
        resp = case.call(base_url=fuzz_server.url, timeout=10)
        counts[resp.status_code] = counts.get(resp.status_code, 0) + 1
        assert resp.status_code < 500, f"{resp.status_code} for {case.body!r}: {resp.text[:500]}"
        case.validate_response(resp, checks=checks)
        if 400 <= resp.status_code < 500:
            check = assert_anthropic_envelope if path.startswith("/v1/messages") else assert_envelope
            check(resp.status_code, resp.text, f"{method} {path} {case.body!r}"[:300])

    run()
    print(f"\nschemathesis {method} {path} ({mode}, schema from {source}): statuses {dict(sorted(counts.items()))}")
    assert_healthy(fuzz_server)


# ------------------------------------------------------------------------------------------- ring record codec


def f32_round_trip(x: float) -> float:
    """What a float becomes through an f32 field: rounded to f32, then read back as its shortest decimal."""
    return float(str(np.float32(x)))


def as_f32(records: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """SUBMIT tuples with temperature and top_p as f32: a value halfway between two shortest decimals (1048576.25)
    reads back as either (Rust prints 1048576.3, numpy 1048576.2), and both are the same f32."""
    return [(*r[:4], np.float32(r[4]), np.float32(r[5]), *r[6:]) if r[0] == 1 else r for r in records]


U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
F32_RANGE = st.floats(min_value=-3.0e38, max_value=3.0e38, allow_nan=False, allow_infinity=False)
SUBMIT = st.tuples(
    st.just("submit"),
    U64,  # request_id
    st.lists(U32, max_size=64),  # prompt (0 allowed)
    U32,  # max_tokens
    F32_RANGE,  # temperature
    F32_RANGE,  # top_p
    st.integers(-(2**31), 2**31 - 1),  # top_k
    st.none() | U64,  # seed
    st.booleans(),  # ignore_eos
    st.booleans(),  # prompt as bytes
)
ABORT = st.tuples(st.just("abort"), U64)
SHUTDOWN = st.tuples(st.just("shutdown"))
ENTRY = st.tuples(
    U64,
    st.lists(U32, max_size=48),
    st.sampled_from([FINISH_NONE, FINISH_STOP, FINISH_LENGTH, FINISH_ABORT, FINISH_ERROR]),
    st.none() | st.text(max_size=40),
    st.booleans(),  # the token list as a tuple
)


@fuzz(150)
@given(ops=st.lists(st.one_of(SUBMIT, ABORT, SHUTDOWN), max_size=24))
def test_request_records_round_trip(ring_path: Any, ops: list[tuple[Any, ...]]) -> None:
    p = ring_path()
    prod = Ring.create(p, 1 << 16)
    try:
        cons = Ring.open(p)
        expected: list[tuple[Any, ...]] = []
        for op in ops:
            if op[0] == "submit":
                _, rid, prompt, max_tokens, temp, top_p, top_k, seed, ignore_eos, as_bytes = op
                arg = b"".join(struct.pack("<I", t) for t in prompt) if as_bytes else prompt
                submit = SubmitInput(
                    request_id=rid,
                    prompt=arg,
                    max_tokens=max_tokens,
                    temperature=temp,
                    top_p=top_p,
                    top_k=top_k,
                    seed=seed,
                    ignore_eos=ignore_eos,
                )
                prod.push_submit(submit, timeout=0)
                expected.append(
                    (
                        1,
                        rid,
                        prompt,
                        max_tokens,
                        f32_round_trip(temp),
                        f32_round_trip(top_p),
                        top_k,
                        seed,
                        ignore_eos,
                        (None, False),
                        None,
                        None,
                    )
                )
            elif op[0] == "abort":
                prod.push_abort(op[1], timeout=0)
                expected.append((2, op[1]))
            else:
                prod.push_shutdown(timeout=0)
                expected.append((3,))
        got = drained(cons)
        assert as_f32(got) == as_f32(expected)
        assert cons.drain_requests() == []
        assert prod.used_bytes == 0
    finally:
        prod.close()


@fuzz(150)
@given(batches=st.lists(st.lists(ENTRY, max_size=8), max_size=8))
def test_token_records_round_trip(ring_path: Any, batches: list[list[tuple[Any, ...]]]) -> None:
    p = ring_path()
    prod = Ring.create(p, 1 << 16)
    try:
        cons = Ring.open(p)
        expected: list[Output] = []
        for batch in batches:
            entries = []
            for rid, tokens, finish, reason, as_tuple in batch:
                ids = tuple(tokens) if as_tuple else tokens
                entries.append(Output(request_id=rid, tokens=ids, finish=finish, reason=reason))
                # the reason travels only with FINISH_ERROR ("" when absent)
                reason = (reason or "") if finish == FINISH_ERROR else None
                expected.append(Output(request_id=rid, tokens=tokens, finish=finish, reason=reason))
            prod.publish(entries, timeout=0)
        assert cons.drain_tokens() == expected
        assert prod.used_bytes == 0
    finally:
        prod.close()


# Raw bytes written straight into the mapped ring: the reader must reject them with RingError, never crash.
HEAD_OFFSET, TAIL_OFFSET, DATA_OFFSET = 64, 128, 4096


def write_raw(path: str, data: bytes, head: int | None = None) -> None:
    with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        assert struct.unpack_from("<Q", m, TAIL_OFFSET)[0] == 0
        m[DATA_OFFSET : DATA_OFFSET + len(data)] = data
        struct.pack_into("<Q", m, HEAD_OFFSET, len(data) if head is None else head)


def framed(kind: int, payload: bytes, declared: int | None = None) -> bytes:
    n = len(payload) if declared is None else declared
    return struct.pack("<II", n, kind) + payload + b"\0" * (-len(payload) % 8)


RECORD = st.tuples(
    st.sampled_from([1, 2, 3, 16, 0, 17, 2**32 - 1]) | U32,
    st.binary(max_size=160),
    st.none() | st.sampled_from([0, 7, 8, 48, 2**31, 2**32 - 1]) | st.integers(0, 400),
)
# Valid-looking headers with lying counts: a SUBMIT claiming more prompt ids, a TOKENS batch claiming more entries.
LYING = st.one_of(
    st.builds(
        lambda n, tail: framed(1, struct.pack("<QIIffiIQII", 1, 1, 0, 1.0, 1.0, -1, 0, 0, n, 0) + tail),
        U32,
        st.binary(max_size=64),
    ),
    st.builds(lambda n, tail: framed(16, struct.pack("<II", n, 0) + tail), U32, st.binary(max_size=64)),
    st.builds(
        lambda n, fin, rl, tail: framed(16, struct.pack("<IIQII", 1, 0, 1, fin, n) + struct.pack("<I", rl) + tail),
        U32,
        st.sampled_from([0, 4, 5, 2**32 - 1]),
        U32,
        st.binary(max_size=32),
    ),
)


def drain_both(path_req: str, path_out: str) -> tuple[Any, Any]:
    """Drain the same bytes as requests and as tokens; a result or a RingError each, anything else fails."""
    out: list[Any] = []
    for path, method in ((path_req, "drain_requests"), (path_out, "drain_tokens")):
        ring = Ring.open(path)
        try:
            out.append(getattr(ring, method)())
        except RingError as e:
            out.append(e)
        # the ring stays usable for bookkeeping afterwards
        assert ring.used_bytes >= 0
        ring.close()
    return out[0], out[1]


@fuzz(200)
@given(
    records=st.lists(RECORD, max_size=6),
    lying=st.lists(LYING, max_size=2),
    garbage=st.binary(max_size=256),
    head_delta=st.integers(-64, 64),
)
def test_garbage_records_never_crash_the_reader(
    ring_path: Any, records: list[tuple[int, bytes, int | None]], lying: list[bytes], garbage: bytes, head_delta: int
) -> None:
    data = b"".join(framed(k, pl, d) for k, pl, d in records) + b"".join(lying) + garbage
    data = data[: 1 << 15]
    paths = []
    for _ in range(2):
        p = ring_path()
        Ring.create(p, 1 << 16).close()
        head = max(0, len(data) + head_delta)
        write_raw(p, data, head)
        paths.append(p)
    reqs, toks = drain_both(*paths)
    for res in (reqs, toks):
        assert isinstance(res, (list, RingError)), res


def test_garbage_examples_are_rejected_not_accepted(ring_path: Any) -> None:
    """A few fixed malformed inputs: each is a RingError (not a crash, not silently accepted)."""
    cases = {
        "partial header": (b"\1\0\0\0", 4),
        "record past head": (framed(2, b"\0" * 8, declared=4000), None),
        "submit lying about prompt": (framed(1, struct.pack("<QIIffiIQII", 1, 1, 0, 1, 1, -1, 0, 0, 99, 0)), None),
        "unknown kind": (framed(99, b"\0" * 8), None),
        "tokens lying about entries": (framed(16, struct.pack("<II", 5, 0)), None),
        "misaligned head": (framed(2, b"\0" * 8), 13),
    }
    for name, (data, head) in cases.items():
        p, q = ring_path(), ring_path()
        for path in (p, q):
            Ring.create(path, 1 << 16).close()
            write_raw(path, data, head)
        reqs, toks = drain_both(p, q)
        print(f"\n{name}: requests -> {reqs!r}; tokens -> {toks!r}")
        if name != "unknown kind":
            assert isinstance(reqs, RingError), (name, reqs)
        assert isinstance(toks, RingError), (name, toks)


# ------------------------------------------------------------------------------------- request parser over HTTP

SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(2**200), max_value=2**200)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=40)
    | st.sampled_from(["", "\u0000", "\ud7ff\U0010ffff", "𝔘𝔫𝔦", "user", "assistant", "tool", "text", MODEL])
)


def _nest(inner: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    # A named function: hypothesis checks that `extend` uses its argument by reading its source, which can fail for
    # a lambda when the source it finds is not this line.
    return st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)


JSON = st.recursive(SCALARS, _nest, max_leaves=25)
ROLE = st.sampled_from(["system", "user", "assistant", "tool", "developer", "latest_reminder", "bogus", ""]) | JSON
PART = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", ""]) | JSON}, optional={"text": JSON})
CONTENT = st.text(max_size=60) | st.lists(PART, max_size=3) | JSON
MESSAGE = st.fixed_dictionaries(
    {"role": ROLE},
    optional={
        "content": CONTENT,
        "tool_calls": JSON,
        "tool_call_id": st.text(max_size=8) | JSON,
        "name": JSON,
        "reasoning_content": JSON,
    },
)
KNOWN: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL) | st.text(max_size=20) | JSON,
    "messages": st.lists(MESSAGE, max_size=4) | JSON,
    "stream": st.booleans() | JSON,
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": JSON, "continuous_usage_stats": JSON})
    | JSON,
    "max_tokens": st.integers(-5, 600) | JSON,
    "max_completion_tokens": st.integers(-5, 600) | JSON,
    "temperature": st.floats(allow_nan=False, allow_infinity=False) | JSON,
    "top_p": st.floats(allow_nan=False, allow_infinity=False) | JSON,
    "top_k": st.integers(-(2**40), 2**40) | JSON,
    "seed": st.integers(-(2**70), 2**70) | JSON,
    "stop": st.lists(st.text(max_size=5), max_size=20) | JSON,
    "ignore_eos": st.booleans() | JSON,
    "thinking": st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled", "x"]) | JSON}) | JSON,
    "reasoning_effort": st.sampled_from(["low", "high", "max", "nope"]) | JSON,
    "tools": JSON,
    "tool_choice": st.sampled_from(["auto", "none", "required"]) | JSON,
    "n": st.integers(-2, 3) | JSON,
    "response_format": JSON,
    "logprobs": JSON,
}
BODY = st.one_of(
    # mostly: a valid core with random known and unknown fields on top
    st.fixed_dictionaries(
        {"model": st.just(MODEL), "messages": st.just([{"role": "user", "content": "hi"}])},
        optional={k: v for k, v in KNOWN.items() if k not in ("model", "messages")},
    ).flatmap(lambda d: st.dictionaries(st.text(max_size=10), JSON, max_size=3).map(lambda extra: {**extra, **d})),
    st.fixed_dictionaries({}, optional=KNOWN),
    JSON,
)


@pytest.fixture(scope="module")
def parser_server() -> Iterator[Server]:
    yield from small_server(512)  # short context: long random bodies also hit the prompt-length check


def test_random_json_bodies(parser_server: Server) -> None:
    counts: dict[int, int] = {}
    with httpx.Client(base_url=parser_server.url, timeout=10) as client:

        @fuzz(150)
        @given(body=BODY, raw_tail=st.sampled_from([b"", b"", b"", b" ", b"}", b"\xff", b"\0"]))
        def run(body: Any, raw_tail: bytes) -> None:
            raw = json.dumps(body, allow_nan=False).encode() + raw_tail
            r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            assert r.status_code < 500, f"{r.status_code} for {raw[:500]!r}: {r.text[:500]}"
            if r.status_code >= 400:
                assert_envelope(r.status_code, r.text, repr(raw[:200]))
            else:
                assert r.status_code == 200
                if r.headers["content-type"].startswith("text/event-stream"):
                    assert r.text.rstrip().endswith("data: [DONE]"), r.text[-300:]
                else:
                    assert r.json()["object"] == "chat.completion"

        run()
    print(f"\nrandom JSON bodies: statuses {dict(sorted(counts.items()))}")
    assert_healthy(parser_server)
