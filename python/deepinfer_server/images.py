"""Image input: a converted request's image sources -> preprocessed images for the engine, and their token count.

deepseek-recipe finds the images (each `<｜image｜>` placeholder in the prompt has an `ImageSource`) and preprocesses
them (OpenCV decode, resize to the V4.1 token budget, WebP). It never fetches here: the Rust front end fetched every
http(s)/file URL already, behind its address guard (`rust/media`), and hands the bytes over keyed by URL. The
library's own fetcher is built to refuse every destination, so a URL the front end did not fetch is a 400, never a
connection.

The preprocessed images go to the ranks in one file per request under the server's media directory (tmpfs), not
through the token rings: the SUBMIT record names the file and each image's size (`write_blob`); the rank reads it
once and unlinks it (engine/base.py `load_images`).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from deepseek_recipe import (
    BytesImageSource,
    CalcResizeError,
    ImageError,
    ImageQuota,
    ImageResolver,
    ImageSource,
    Message,
    OpenCvImagePreprocessor,
    ReqwestImageFetcher,
)

from deepinfer_server.refusals import Refusal

# deepseek-recipe's ImageError kinds -> (code, what the client is told). Its own message is one generic sentence
# for all decode failures; the client should learn which problem it has.
_KINDS: dict[str, tuple[str, str]] = {
    "Decode": ("invalid_image", "could not be decoded: the data is corrupt or truncated"),
    "EmptyImage": ("invalid_image", "holds no complete image (empty or truncated data)"),
    "Resize": ("invalid_image", "could not be resized"),
    "Encode": ("invalid_image", "could not be re-encoded for the model"),
    "EncodeFailed": ("invalid_image", "could not be re-encoded for the model"),
    "TokenBudget": ("invalid_image", "does not fit the model's image token budget"),
    "UnsupportedMediaType": ("unsupported_image_type", "is not a supported image type (webp, png, jpeg, gif)"),
    "ImageDimensionsTooLarge": ("image_too_large", "has pixel dimensions larger than the model accepts"),
    "ImageTooLarge": ("image_too_large", "is larger than the size limit"),
    "TotalSizeTooLarge": ("image_too_large", "takes the request's images past their total size limit"),
    "TooManyImages": ("too_many_images", "is one image too many for one request"),
    "InvalidDataUrl": ("invalid_image_url", "is not a valid data URL"),
    "InvalidUrl": ("invalid_image_url", "is not a valid image URL"),
    "UrlTooLong": ("invalid_image_url", "has a URL that is too long"),
    "Unsupported": ("invalid_image_url", "is not a supported image source"),
    "DestinationRejected": ("image_url_refused", "names a URL this server does not fetch"),
    "Fetch": ("image_url_refused", "names a URL this server does not fetch"),
    "FetchStatus": ("image_url_refused", "names a URL this server does not fetch"),
    "Client": ("image_url_refused", "names a URL this server does not fetch"),
}
_INDEX = re.compile(r"\.(\d+)")


def _refuse(host: str, address: str) -> bool:
    return False


@dataclass(frozen=True)
class ResolvedImages:
    """A request's images, preprocessed, in placeholder order."""

    data: list[bytes]
    sizes: list[tuple[int, int]]  # (width, height) after preprocessing: what DeepInfer's image_sizes takes
    extra_tokens: int  # prompt tokens beyond one per placeholder (deepseek-recipe's image_token_adjustment)


class Images:
    """Preprocessing with the request limits. Thread-safe (deepseek-recipe's resolver releases the GIL)."""

    def __init__(self, max_images: int, max_image_bytes: int, max_total_bytes: int, media_dir: str | None) -> None:
        self.max_images = max_images
        self.max_image_bytes = max_image_bytes
        self.max_total_bytes = max_total_bytes
        self.media_dir = Path(media_dir) if media_dir else None
        self._names = itertools.count()  # file names are the server's own, never a client's id
        fetcher = ReqwestImageFetcher.with_max_bytes(max(1, max_image_bytes)).with_destination_filter(_refuse)
        self.resolver = ImageResolver(fetcher, OpenCvImagePreprocessor())

    def resolve(self, sources: list[ImageSource], fetched: dict[str, bytes]) -> ResolvedImages | Refusal:
        """Preprocess `sources` (URL ones from `fetched`). Returns the images, or their refusal."""
        if len(sources) > self.max_images:
            return Refusal(
                400,
                error(
                    "too_many_images",
                    f"The request has {len(sources)} images; this server takes at most {self.max_images} per request.",
                    param(sources[self.max_images]),
                ),
            )
        local: list[ImageSource] = []
        total = 0
        for src in sources:
            data = fetched.get(src.url) if src.kind == "url" and src.url is not None else src.data
            if data is not None:
                if len(data) > self.max_image_bytes:
                    return Refusal(
                        400,
                        error(
                            "image_too_large",
                            f"An image is {len(data)} bytes; the limit is {self.max_image_bytes} bytes per image.",
                            param(src),
                        ),
                    )
                total += len(data)
                src = BytesImageSource(data, src.detail, path=src.path)
            local.append(src)
        if total > self.max_total_bytes:
            return Refusal(
                400,
                error(
                    "image_too_large",
                    f"The request's images add up to {total} bytes; the limit is {self.max_total_bytes} bytes.",
                    param(sources[0]),
                ),
            )
        try:
            mm = self.resolver.resolve(local, ImageQuota())
            extra = mm.image_token_adjustment()
        except ImageError as e:
            return Refusal(400, image_error(e, sources))
        except CalcResizeError as e:
            return Refusal(400, error("invalid_image", f"An image's token count could not be computed: {e}", None))
        return ResolvedImages([i.data for i in mm.images], [(i.width, i.height) for i in mm.images], extra)

    def write_blob(self, images: ResolvedImages) -> str:
        """The images in one file for the rank (which unlinks it); returns its path. The name is a counter and a
        random part: nothing a client sends names a file."""
        if self.media_dir is None:
            raise RuntimeError("no media directory: images cannot reach the ranks")
        path = self.media_dir / f"{next(self._names)}-{secrets.token_hex(6)}"
        # "x": never over another request's file; 0o600: the directory is the server's, and so are its files.
        with open(path, "xb", opener=lambda p, flags: os.open(p, flags, 0o600)) as f:
            for data in images.data:
                f.write(data)
        return str(path)


def sources_of(messages: Sequence[Message]) -> list[ImageSource]:
    """A conversation's image sources in placeholder order (deepseek-recipe renders messages in order)."""
    return [s for m in messages for s in m.image_sources]


def param(src: ImageSource) -> str | None:
    """deepseek-recipe's location of an image (`.messages[0]`, `messages.2.content.0.tool_result`) as a field."""
    path = _INDEX.sub(r"[\1]", src.path.lstrip("."))
    return path or None


def image_error(e: ImageError, sources: list[ImageSource]) -> str:
    """deepseek-recipe's ImageError as a 400 envelope: its location (`input[0].image[1]`), what is wrong, a code."""
    code, what = _KINDS.get(e.kind, ("invalid_image", "could not be processed"))
    where = str(e).partition(": ")[0].lstrip(".") if ": " in str(e) else ""
    located = next((s for s in sources if s.path and where.startswith(s.path.lstrip("."))), None)
    field = _INDEX.sub(r"[\1]", where)
    message = f"The image at {field} {what}." if where else f"An image {what}."
    return error(code, message, param(located) if located is not None else None)


def error(code: str, message: str, param: str | None) -> str:
    return json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}},
        ensure_ascii=False,
    )
