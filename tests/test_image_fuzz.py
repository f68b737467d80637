"""Fuzzing image input over HTTP (hypothesis): image parts on the chat door (data URLs), the Messages door (base64
blocks) and Responses (input_image data URLs), made of random bytes, real PNG/JPEG/GIF/WebP cut at random points,
PNGs whose IHDR declares huge (or zero) dimensions with a right or wrong CRC, JPEGs whose SOF does, valid images
under a lying media type, empty data, bad base64, images just over --max-image-bytes and more images than
--max-images-per-request. Every answer is a 200 (only when an image got through) or a 4xx in the door's error
envelope with a message; never a 5xx, never a hang; the server stays healthy and still answers text.

Bounded: a fixed, derandomized example set per door, so the module stays well under a minute on two cores.
"""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from conftest import MODEL, Server
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from test_fuzz import assert_anthropic_envelope, assert_envelope, assert_healthy, small_server

MAX_IMAGES = 4
MAX_BYTES = 48 << 10  # --max-image-bytes: small, so "just over" stays cheap to send
MAX_TOTAL = 128 << 10  # --max-image-total-bytes
FUZZ = settings(
    max_examples=60,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
    print_blob=True,
)
MIMES = ["image/png", "image/jpeg", "image/gif", "image/webp"]
OTHER_MIMES = ["image/bmp", "image/svg+xml", "text/plain", "application/octet-stream", "", "image/PNG", "image/x"]


def _sample(fmt: str, width: int = 48, height: int = 32) -> bytes:
    """A small photo-like image (noise over a gradient, fixed seed) in `fmt`."""
    rng = random.Random(7)
    img = Image.new("RGB", (width, height))
    img.putdata([(rng.randrange(256), x * 5 % 256, y * 8 % 256) for y in range(height) for x in range(width)])
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


REAL = {mime: _sample(mime.split("/")[1].upper()) for mime in MIMES}


def tampered_ihdr(width: int, height: int, crc_ok: bool) -> bytes:
    """The real PNG with its IHDR declaring `width` x `height`, its CRC recomputed or left wrong."""
    png = REAL["image/png"]
    chunk = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    crc = zlib.crc32(chunk) if crc_ok else zlib.crc32(chunk) ^ 0x5A5A5A5A
    return png[:8] + struct.pack(">I", 13) + chunk + struct.pack(">I", crc) + png[33:]


def tampered_sof(width: int, height: int) -> bytes:
    """The real JPEG with its SOF0 frame header declaring `width` x `height`."""
    jpeg = REAL["image/jpeg"]
    at = jpeg.index(b"\xff\xc0") + 5  # marker, length (2), precision (1), then height and width
    return jpeg[:at] + struct.pack(">HH", height, width) + jpeg[at + 4 :]


@dataclass(frozen=True)
class Part:
    """One image: what it is (`kind`, for the report), its media type and its base64 text."""

    kind: str
    mime: str
    b64: str
    valid: bool = False  # certainly decodable, of the right type, within the limits
    invalid: bool = False  # certainly refused (whatever else the request holds)

    def __repr__(self) -> str:
        return f"Part({self.kind}, mime={self.mime!r}, b64 {len(self.b64)} chars: {self.b64[:24]!r}...)"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


VALID = st.sampled_from(MIMES).map(lambda m: Part(f"valid {m}", m, b64(REAL[m]), valid=True))
LYING = st.tuples(st.sampled_from(MIMES), st.sampled_from(MIMES + OTHER_MIMES)).filter(lambda t: t[0] != t[1])
RANDOM = st.tuples(st.binary(max_size=3000), st.sampled_from(MIMES + OTHER_MIMES))
TRUNCATED = st.sampled_from(MIMES).flatmap(lambda m: st.tuples(st.just(m), st.integers(0, len(REAL[m]) - 1)))
DIMENSIONS = st.sampled_from([60000, 30000, 16385, 1, 0, 2**31 - 1, 2**32 - 1])
BAD_B64 = st.sampled_from(["@@@@", "a", "a===", "====", "Zm9v!YmFy", "%%%%", "Zm9v\x00", "é", "iVBORw0KGgo"]) | st.text(
    alphabet="!#$%&*,.:;<>?@[]^_`{|}~ \t\n-", min_size=1, max_size=40
)
OVER = st.tuples(st.sampled_from(MIMES), st.integers(MAX_BYTES + 1, MAX_BYTES + 4096), st.booleans())


def _over(mime: str, size: int, garbage: bool) -> Part:
    """A real image padded to `size` bytes (trailing bytes decoders ignore), or that many random bytes."""
    data = REAL[mime] + bytes(size - len(REAL[mime])) if not garbage else random.Random(size).randbytes(size)
    return Part(f"over the limit ({size} bytes)", mime, b64(data), invalid=True)


KINDS: dict[str, st.SearchStrategy[Part]] = {
    "valid": VALID,
    "lying": LYING.map(lambda t: Part(f"{t[0]} labelled {t[1]!r}", t[1], b64(REAL[t[0]]))),
    "random": RANDOM.map(lambda t: Part(f"random {len(t[0])} bytes", t[1], b64(t[0]), invalid=True)),
    "truncated": TRUNCATED.map(lambda t: Part(f"{t[0]} cut at {t[1]}", t[0], b64(REAL[t[0]][: t[1]]))),
    "ihdr": st.tuples(DIMENSIONS, DIMENSIONS, st.booleans()).map(
        lambda t: Part(f"png IHDR {t[0]}x{t[1]} crc {'ok' if t[2] else 'bad'}", "image/png", b64(tampered_ihdr(*t)))
    ),
    "sof": st.tuples(st.sampled_from([65500, 40000, 0, 1]), st.sampled_from([65535, 30000, 0])).map(
        lambda t: Part(f"jpeg SOF {t[0]}x{t[1]}", "image/jpeg", b64(tampered_sof(*t)))
    ),
    "empty": st.sampled_from(MIMES).map(lambda m: Part("empty", m, "", invalid=True)),
    "bad base64": st.tuples(st.sampled_from(MIMES), BAD_B64).map(
        lambda t: Part("bad base64", t[0], t[1], invalid=True)
    ),
    "over": OVER.map(lambda t: _over(*t)),
}
# A kind first, uniformly, then its inputs: each kind gets its share of the fixed example budget.
PART = st.sampled_from(list(KINDS)).flatmap(lambda k: KINDS[k])
PNG_PART = Part("valid image/png", "image/png", b64(REAL["image/png"]), valid=True)
PARTS = st.one_of(
    PART.map(lambda p: [p]),
    st.lists(PART, min_size=2, max_size=MAX_IMAGES),
    st.integers(MAX_IMAGES + 1, 3 * MAX_IMAGES).map(lambda n: [PNG_PART] * n),
)
# Each input the module is about, at least once per door whatever the draw.
EXAMPLES = [
    [Part("random 512 bytes", "image/png", b64(random.Random(1).randbytes(512)), invalid=True)],
    [PNG_PART, Part("image/png cut at 100", "image/png", b64(REAL["image/png"][:100]))],
    [Part("image/jpeg cut at 300", "image/jpeg", b64(REAL["image/jpeg"][:300]))],
    [Part("png IHDR 60000x60000 crc ok", "image/png", b64(tampered_ihdr(60000, 60000, True)))],
    [Part("png IHDR 60000x60000 crc bad", "image/png", b64(tampered_ihdr(60000, 60000, False)))],
    [Part("image/png labelled 'image/jpeg'", "image/jpeg", b64(REAL["image/png"]))],
    [Part("empty", "image/png", "", invalid=True)],
    [Part("bad base64", "image/png", "@@@@", invalid=True)],
    [_over("image/png", MAX_BYTES + 1, False)],
    [PNG_PART] * (MAX_IMAGES + 1),
]


def examples(cases: list[list[Part]]) -> Any:
    def wrap(fn: Any) -> Any:
        for case in reversed(cases):
            fn = example(parts=case)(fn)
        return fn

    return wrap


def chat_body(parts: list[Part]) -> tuple[str, dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "text", "text": "what is this?"}]
    content += [{"type": "image_url", "image_url": {"url": f"data:{p.mime};base64,{p.b64}"}} for p in parts]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return "/v1/chat/completions", body | {"thinking": {"type": "disabled"}}


def messages_body(parts: list[Part]) -> tuple[str, dict[str, Any]]:
    content: list[dict[str, Any]] = [
        {"type": "image", "source": {"type": "base64", "media_type": p.mime, "data": p.b64}} for p in parts
    ]
    content.append({"type": "text", "text": "what is this?"})
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 4}
    return "/v1/messages", body | {"thinking": {"type": "disabled"}}


def responses_body(parts: list[Part]) -> tuple[str, dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "input_text", "text": "what is this?"}]
    content += [{"type": "input_image", "image_url": f"data:{p.mime};base64,{p.b64}"} for p in parts]
    body = {"model": MODEL, "input": [{"role": "user", "content": content}], "max_output_tokens": 4}
    return "/v1/responses", body | {"reasoning": {"effort": "none"}}


DOORS = {"chat": chat_body, "messages": messages_body, "responses": responses_body}
OBJECT = {"chat": ("object", "chat.completion"), "messages": ("type", "message"), "responses": ("object", "response")}


@pytest.fixture(scope="module")
def image_server() -> Iterator[Server]:
    yield from small_server(
        8192,
        *("--max-images-per-request", str(MAX_IMAGES)),
        *("--max-image-bytes", str(MAX_BYTES), "--max-image-total-bytes", str(MAX_TOTAL)),
    )


def text_still_works(srv: Server, door: str) -> None:
    path, body = DOORS[door]([])
    r = httpx.post(f"{srv.url}{path}", json=body, timeout=30)
    assert r.status_code == 200, r.text
    key, value = OBJECT[door]
    assert r.json()[key] == value, r.text[:300]


@pytest.mark.parametrize("door", DOORS)
def test_bad_images_are_4xx_in_the_door_envelope(image_server: Server, door: str) -> None:
    counts: dict[str, int] = {}
    check = assert_anthropic_envelope if door == "messages" else assert_envelope
    with httpx.Client(base_url=image_server.url, timeout=30) as client:

        @FUZZ
        @given(parts=PARTS)
        @examples(EXAMPLES)
        def run(parts: list[Part]) -> None:
            path, body = DOORS[door](parts)
            try:
                r = client.post(path, json=body)
            except httpx.TimeoutException:
                raise AssertionError(f"no answer in 30 s on {path} for {parts}") from None
            where = f"{path} {parts}"
            assert r.status_code < 500, f"{r.status_code} for {where}: {r.text[:500]}"
            too_many = len(parts) > MAX_IMAGES
            if r.status_code == 200:
                assert not too_many and not any(p.invalid for p in parts), f"200 for {where}: {r.text[:300]}"
                key, value = OBJECT[door]
                assert r.json()[key] == value, r.text[:300]
                counts["200"] = counts.get("200", 0) + 1
                return
            assert 400 <= r.status_code < 500, f"{r.status_code} for {where}: {r.text[:300]}"
            check(r.status_code, r.text, where[:300])
            assert not all(p.valid for p in parts) or too_many, f"valid images refused: {where}: {r.text[:300]}"
            doc = r.json()["error"]
            code = doc.get("code") or doc.get("type")
            counts[f"{r.status_code} {code}"] = counts.get(f"{r.status_code} {code}", 0) + 1

        run()
    print(f"\n{door}: {dict(sorted(counts.items()))}")
    assert_healthy(image_server)
    text_still_works(image_server, door)


# The size limit at its edge, on the chat door: a limit that is not a multiple of 3, so the image's base64 ends in
# padding.
EDGE = 3 * 16384 + 1


@pytest.fixture(scope="module")
def edge_server() -> Iterator[Server]:
    yield from small_server(8192, "--max-image-bytes", str(EDGE))


def post_padded(srv: Server, size: int) -> httpx.Response:
    png = REAL["image/png"]
    path, body = chat_body([Part(f"png padded to {size}", "image/png", b64(png + bytes(size - len(png))))])
    return httpx.post(f"{srv.url}{path}", json=body, timeout=30)


def test_an_image_one_byte_over_the_limit_is_refused(edge_server: Server) -> None:
    r = post_padded(edge_server, EDGE + 1)
    assert r.status_code == 400 and r.json()["error"]["code"] == "image_too_large", r.text[:300]
    assert post_padded(edge_server, EDGE - 1).status_code == 200


def test_an_image_of_exactly_the_limit_is_accepted(edge_server: Server) -> None:
    r = post_padded(edge_server, EDGE)
    assert r.status_code == 200, r.text[:300]
