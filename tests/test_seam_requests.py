"""What Python hands across the seam by name, never by position (issue 41): the codec's other calls take a
`CallInput` (`Codec.tokenize`, `detokenize`, `count_tokens`, as Rust's `Codec.call` builds it), and a request ring
takes a `SubmitInput` with its grammar and images as `SubmitConstraint` and `SubmitImages` records
(`Ring.push_submit`). Each shape goes through: the real codec, and a real ring read back as the rank reads it."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import MODEL

from deepinfer_server import _native
from deepinfer_server._native import CallInput, SubmitConstraint, SubmitImages, SubmitInput
from deepinfer_server.codec import Codec
from deepinfer_server.launcher import BUNDLED_TOKENIZER

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def codec() -> Codec:
    return Codec(BUNDLED_TOKENIZER, [MODEL], 4096)


def test_every_codec_call_reads_its_request_by_name(codec: Codec) -> None:
    chat = json.dumps(CHAT).encode()
    tokens = json.loads(codec.tokenize(CallInput(door=_native.DOOR_CHAT, body=chat)))  # type: ignore[arg-type]
    raw = json.loads(codec.tokenize(CallInput(door=_native.DOOR_CHAT, body=b'{"prompt": "hi"}')))  # type: ignore[arg-type]
    assert tokens["count"] == len(tokens["tokens"]) > raw["count"] == len(raw["tokens"]) > 0
    text = json.loads(codec.detokenize(CallInput(door=_native.DOOR_CHAT, body=json.dumps(raw).encode())))  # type: ignore[arg-type]
    assert "hi" in text["prompt"]
    for door in (_native.DOOR_CHAT, _native.DOOR_MESSAGES):
        body = json.dumps({**CHAT, "max_tokens": 4}).encode()
        counted = codec.count_tokens(CallInput(door=door, body=body))
        assert isinstance(counted, str) and json.loads(counted)["input_tokens"] == tokens["count"], door
    # An image's bytes ride in `images`, keyed by the URL the body names; the codec refuses what it cannot read.
    url = "https://example.com/a.png"
    with_image = {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}]}
    request = CallInput(door=_native.DOOR_CHAT, body=json.dumps(with_image).encode(), images={url: b"not a png"})
    assert (request.door, request.images) == (_native.DOOR_CHAT, {url: b"not a png"})
    assert isinstance(codec.count_tokens(request), _native.Refusal)


def test_a_call_input_built_wrong_fails_where_it_is_built() -> None:
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (ValueError, "door", lambda: CallInput(door=99, body=b"{}")),
        (TypeError, "body", lambda: CallInput(door=0, body="{}")),  # type: ignore[arg-type]
        (TypeError, "images", lambda: CallInput(door=0, body=b"{}", images=[b"x"])),  # type: ignore[arg-type]
        (TypeError, "positional", lambda: CallInput(0, b"{}")),  # type: ignore[misc]
    ]
    for kind, says, build in cases:
        with pytest.raises(kind, match=says):
            build()


def test_every_shape_of_a_submit_goes_through_a_real_ring(tmp_path: Path) -> None:
    path = str(tmp_path / "ring")
    prod, cons = _native.Ring.create(path, 1 << 16), None
    cons = _native.Ring.open(path)
    grammar = SubmitConstraint(schema_type=_native.SCHEMA_JSON, schema='{"type": "object"}', triggers=[], bound=None)
    tool = SubmitConstraint(schema_type=_native.SCHEMA_EBNF, schema="root ::= x", triggers=[5, 6], bound=7)
    pics = SubmitImages(path="/dev/shm/x-media/chatcmpl-1", extra_tokens=650, sizes=[(1036, 1036, 2006), (8, 9, 10)])
    le = (5).to_bytes(4, "little") + (6).to_bytes(4, "little")
    sent = [
        SubmitInput(request_id=1, prompt=[], max_tokens=1),
        SubmitInput(request_id=2, prompt=le, max_tokens=2, temperature=0.5, top_p=0.5, top_k=3, seed=2**64 - 1),
        SubmitInput(request_id=3, prompt=[1, 2**32 - 1], max_tokens=3, ignore_eos=True, logprobs=0),
        SubmitInput(request_id=4, prompt=[1], max_tokens=4, logprobs=20, prompt_logprobs=True, constraint=grammar),
        SubmitInput(request_id=5, prompt=[9, 9], max_tokens=5, constraint=tool, images=pics),
    ]
    for s in sent:
        prod.push_submit(s, timeout=1.0)
    got = cons.drain_requests()
    assert [type(g) for g in got] == [_native.Submit] * len(sent)
    fields = ("request_id", "prompt", "max_tokens", "top_k", "seed", "ignore_eos", "logprobs", "prompt_logprobs")
    for s, g in zip(sent, got, strict=True):
        assert all(getattr(g, f) == getattr(s, f) for f in fields), (s, g)
        assert (g.temperature, g.top_p) == (pytest.approx(s.temperature), pytest.approx(s.top_p))
    assert got[1].prompt == [5, 6] and (got[1].temperature, got[1].top_p) == (0.5, 0.5)
    named = [None if (c := g.constraint) is None else (c.schema_type, c.schema, c.triggers, c.bound) for g in got]
    assert named == [
        None,
        None,
        None,
        (_native.SCHEMA_JSON, '{"type": "object"}', [], None),
        (_native.SCHEMA_EBNF, "root ::= x", [5, 6], 7),
    ]
    im = got[4].images
    assert im is not None and (im.path, im.extra_tokens, im.sizes) == (pics.path, 650, [[1036, 1036, 2006], [8, 9, 10]])
    assert got[3].images is None and isinstance(got[3].constraint, SubmitConstraint)
    prod.close()


def test_a_submit_built_wrong_fails_where_it_is_built() -> None:
    s, c = SubmitInput, SubmitConstraint
    cases: list[tuple[type[Exception], str, Callable[[], object]]] = [
        (OverflowError, "out of range", lambda: s(request_id=1, prompt=[-1], max_tokens=1)),
        (ValueError, "little-endian", lambda: s(request_id=1, prompt=b"abc", max_tokens=1)),
        (TypeError, "positional", lambda: s(1, [1], 1)),  # type: ignore[misc]
        (TypeError, "unexpected", lambda: s(request_id=1, prompt=[1], max_tokens=1, timeout=1)),  # type: ignore[call-arg]
        (TypeError, "missing", lambda: s(request_id=1, prompt=[1])),  # type: ignore[call-arg]
        (TypeError, "constraint", lambda: s(request_id=1, prompt=[], max_tokens=1, constraint=(0, "", [], None))),  # type: ignore[arg-type]
        (TypeError, "images", lambda: s(request_id=1, prompt=[], max_tokens=1, images=("/x", 1, []))),  # type: ignore[arg-type]
        (TypeError, "missing", lambda: c(schema_type=0, schema="", triggers=[])),  # type: ignore[call-arg]
        (ValueError, "length 3", lambda: SubmitImages(path="/x", extra_tokens=0, sizes=[(1, 2)])),
    ]
    for kind, says, build in cases:
        with pytest.raises(kind, match=says):
            build()
