"""Image input over real HTTP on every door, with real PNG and JPEG bytes made here: the image reaches the rank
intact (the sim answers `sim:images` with what it received), its tokens count in usage and limits, and every bad
image is a 400 that names the problem and the field. URL images: tests/test_image_urls.py."""

from __future__ import annotations

import base64
import hashlib
import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from conftest import MODEL, Server, start_server, wait_for
from deepseek_recipe import BytesImageSource, ImageQuota, ImageResolver, OpenCvImagePreprocessor, ReqwestImageFetcher
from PIL import Image

NO_THINK = {"thinking": {"type": "disabled"}}
ECHO = re.compile(r"images=(\d+) (.*?) ?extra_tokens=(\d+)")


def picture(width: int, height: int, fmt: str = "PNG") -> bytes:
    """A real image with some structure (a gradient and a grid), so the codecs have something to encode."""
    img = Image.new("RGB", (width, height))
    img.putdata(
        [
            ((x * 255) // max(1, width - 1), (y * 255) // max(1, height - 1), 128 if (x // 16 + y // 16) % 2 else 32)
            for y in range(height)
            for x in range(width)
        ]
    )
    out = io.BytesIO()
    img.save(out, fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def expected(*images: tuple[bytes, str]) -> list[str]:
    """What deepseek-recipe's preprocessing makes of these images: `WxH/bytes/sha256 prefix` each, as the sim says."""
    resolver = ImageResolver(ReqwestImageFetcher.with_max_bytes(1 << 26), OpenCvImagePreprocessor())
    mm = resolver.resolve([BytesImageSource(d, detail) for d, detail in images], ImageQuota())  # type: ignore[arg-type]
    return [f"{i.width}x{i.height}/{len(i.data)}/{hashlib.sha256(i.data).hexdigest()[:16]}" for i in mm.images]


def echo(text: str) -> tuple[int, list[str], int]:
    m = ECHO.search(text)
    assert m, f"the sim did not describe the images: {text!r}"
    return int(m.group(1)), m.group(2).split(), int(m.group(3))


@pytest.fixture(scope="module")
def srv() -> Iterator[Server]:
    s = start_server(
        "--served-model-name",
        MODEL,
        "--max-model-len",
        "8192",
        "--max-images-per-request",
        "4",
        "--max-image-bytes",
        str(3 << 20),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def png() -> bytes:
    return picture(320, 200)


@pytest.fixture(scope="module")
def jpeg() -> bytes:
    return picture(640, 480, "JPEG")


def chat_parts(*urls: tuple[str, str]) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "text", "text": "sim:images what is in these?"}]
    parts += [{"type": "image_url", "image_url": {"url": u, "detail": d}} for u, d in urls]
    return parts


def test_openai_sdk_data_urls_reach_the_rank_intact(srv: Server, png: bytes, jpeg: bytes) -> None:
    client = srv.client()
    parts = chat_parts((data_url(png), "high"), (data_url(jpeg, "image/jpeg"), "low"))
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts}], max_tokens=200, extra_body=NO_THINK
    )
    n, seen, extra = echo(r.choices[0].message.content or "")
    assert (n, seen) == (2, expected((png, "high"), (jpeg, "low")))
    # Usage counts the image tokens: the same prompt without images, plus the tokens the images take.
    bare = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": parts[:1]}], max_tokens=1, extra_body=NO_THINK
    )
    assert r.usage is not None and bare.usage is not None
    placeholders = r.usage.prompt_tokens - bare.usage.prompt_tokens - extra
    assert 2 <= placeholders <= 8, (r.usage, bare.usage, extra)  # a placeholder and a separator or two per image
    assert extra > 100  # each image is hundreds of tokens to the model


def test_streamed_chat_with_an_image_counts_it_in_usage(srv: Server, png: bytes) -> None:
    stream = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": chat_parts((data_url(png), "auto"))}],
        max_tokens=200,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=NO_THINK,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    n, seen, extra = echo(text)
    assert (n, seen) == (1, expected((png, "auto")))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens > extra


def test_count_and_tokenize_include_the_image_tokens(srv: Server, png: bytes) -> None:
    msgs = [{"role": "user", "content": chat_parts((data_url(png), "high"))}]
    r = srv.client().chat.completions.create(model=MODEL, messages=msgs, max_tokens=1, extra_body=NO_THINK)  # type: ignore[arg-type]
    assert r.usage is not None
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        tok = h.post("/tokenize", json={"model": MODEL, "messages": msgs, **NO_THINK}).json()
        assert tok["count"] == r.usage.prompt_tokens
        block = {
            "type": "image",
            "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()},
        }
        body = {
            "model": MODEL,
            "max_tokens": 5,
            **NO_THINK,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": "x"}]}],
        }
        counted = h.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
        sent = h.post("/v1/messages", json=body, headers={"x-request-id": "img-usage"}).json()
        assert counted == sent["usage"]["input_tokens"] > 200
    # The request log (and the prompt-token metrics) count what usage counts.
    line = f"request_id=img-usage rank=0 prompt_tokens={counted} "
    wait_for("the request's log line", lambda: line in srv.log(), 5)


def test_anthropic_sdk_base64_image(srv: Server, jpeg: bytes) -> None:
    client = anthropic.Anthropic(base_url=srv.url, api_key="x")
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/jpeg", "data": base64.b64encode(jpeg).decode()},
    }
    msg = client.messages.create(
        model=MODEL,
        max_tokens=200,
        thinking={"type": "disabled"},
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "sim:images describe"}]}],  # type: ignore[list-item]
    )
    text = "".join(b.text for b in msg.content if b.type == "text")
    n, seen, _ = echo(text)
    assert (n, seen) == (1, expected((jpeg, "high")))


def test_responses_input_image(srv: Server, png: bytes) -> None:
    r = srv.client().responses.create(
        model=MODEL,
        max_output_tokens=200,
        reasoning={"effort": "none"},
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "sim:images look"},
                    {"type": "input_image", "image_url": data_url(png), "detail": "low"},
                ],
            }
        ],  # type: ignore[list-item]
    )
    n, seen, _ = echo(r.output_text)
    assert (n, seen) == (1, expected((png, "low")))


def refused(srv: Server, parts: list[dict[str, Any]], path: str = "/v1/chat/completions") -> dict[str, Any]:
    with httpx.Client(base_url=srv.url, timeout=30) as h:
        r = h.post(path, json={"model": MODEL, "messages": [{"role": "user", "content": parts}], "max_tokens": 5})
    assert r.status_code == 400, r.text
    return r.json()["error"]


@pytest.mark.parametrize(
    ("name", "make", "code"),
    [
        ("corrupt", lambda png: data_url(png[: len(png) // 2]), "invalid_image"),
        ("not an image", lambda png: data_url(b"hello, world" * 10), "unsupported_image_type"),
        ("empty", lambda png: "data:image/png;base64,", "invalid_image"),
        ("bad base64", lambda png: "data:image/png;base64,@@@@", "invalid_image_url"),
        ("huge declared dimensions", lambda png: data_url(picture(20000, 8)), "image_too_large"),
    ],
)
def test_a_bad_image_is_a_400_naming_it(srv: Server, png: bytes, name: str, make: Any, code: str) -> None:
    err = refused(
        srv, chat_parts(("data:image/png;base64," + base64.b64encode(png).decode(), "auto"), (make(png), "auto"))
    )
    assert err["code"] == code, (name, err)
    assert err["param"] == "messages[0]", err
    assert any(w in err["message"].lower() for w in ("image", "base64")), err


def test_too_many_and_too_large_images_are_400s(srv: Server, png: bytes) -> None:
    err = refused(srv, chat_parts(*[(data_url(png), "low")] * 5))
    assert err["code"] == "too_many_images" and "4" in err["message"], err
    big = data_url(picture(1200, 1200, "BMP"), "image/bmp")  # ~4.3 MB, over --max-image-bytes 3 MiB
    err = refused(srv, chat_parts((big, "auto")))
    assert err["code"] == "image_too_large", err


def test_images_count_against_max_model_len(png: bytes) -> None:
    s = start_server("--served-model-name", MODEL, "--max-model-len", "300")
    try:
        err = refused(s, chat_parts((data_url(picture(1024, 1024)), "high")))
        assert err["code"] == "context_length_exceeded", err
    finally:
        s.stop()


def test_images_can_be_switched_off(png: bytes) -> None:
    s = start_server("--served-model-name", MODEL, "--max-images-per-request", "0")
    try:
        err = refused(s, chat_parts((data_url(png), "auto")))
        assert err["code"] == "images_disabled", err
        with httpx.Client(base_url=s.url, timeout=30) as h:  # text still works
            r = h.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
            )
            assert r.status_code == 200
    finally:
        s.stop()


def test_the_image_file_is_gone_once_the_rank_took_it(srv: Server, png: bytes) -> None:
    srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": chat_parts((data_url(png), "low"))}],
        max_tokens=3,  # type: ignore[misc]
        extra_body=NO_THINK,
    )
    media = list(Path("/dev/shm").glob(f"deepinfer-{srv.proc.pid}-*-media"))
    assert len(media) == 1, media
    wait_for("the rank to unlink the image file", lambda: not list(media[0].iterdir()), 5)


def test_n_choices_count_their_images_together(srv: Server, png: bytes) -> None:
    """Each of n choices fetches its own copy of the images: n x images is held to --max-images-per-request (4)."""
    body = {
        "model": MODEL,
        "max_tokens": 4,
        "messages": [{"role": "user", "content": chat_parts((data_url(png), "low"))}],
    }
    two = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "n": 2}, timeout=60)
    assert two.status_code == 200 and len(two.json()["choices"]) == 2, two.text
    five = httpx.post(f"{srv.url}/v1/chat/completions", json={**body, "n": 5}, timeout=60)
    assert five.status_code == 400, five.text
    err = five.json()["error"]
    assert err["param"] == "n" and "5 images" in err["message"], err
