"""Encoded images (JPEG, PNG, ...) to uint8 HWC pixels.

JPEG goes through ``simplejpeg`` (libjpeg-turbo) and everything else through Pillow; both are
the ``agent-images`` extra and are imported on first use, so an agent without them still serves
raw tensors. Where the caller says how large the image must at least be (``at_least``), a JPEG is
decoded at a DCT scale of 1/2, 1/4 or 1/8 when that still covers it (libjpeg-turbo's own
scaled decode: far less work for a camera frame going to a 320x320 model); the caller gets the
original size beside the pixels so that geometry can be mapped back.

Without ``simplejpeg`` a JPEG falls back to Pillow with the same scaled-decode rule (Pillow's
``draft``); without either library a request holding an encoded image is refused with a 400
naming the extra.
"""

from __future__ import annotations

import io
import math
from typing import Any, Literal

import numpy as np

from edgekit.bundle.errors import InferenceInputError

EXTRA = "agent-images"
Mode = Literal["RGB", "GRAY"]
Fit = Literal["stretch", "letterbox", "center_crop"]
# each decoded image is capped (a small JPEG can claim a huge size: a decompression bomb)
MAX_PIXELS = 64_000_000
_JPEG_MAGIC = b"\xff\xd8"


class ImageInputError(InferenceInputError):
    """A request's image cannot be decoded (not an image, corrupt, too large): a 400."""


class ImageDecoderMissingError(ImageInputError):
    """No image decoder is installed: a 400 that names the extra to install."""

    def __init__(self, what: str) -> None:
        super().__init__(
            f"{what}: decoding images needs the image extra on the agent: pip install 'edgekit[{EXTRA}]' "
            "(or send the pre-processed input tensor)"
        )


def decode_image(
    data: bytes, mode: Mode = "RGB", shrink_to: tuple[Fit, tuple[int, int]] | None = None
) -> tuple[np.ndarray, tuple[int, int]]:
    """``data`` decoded to uint8 ``[H, W, 3]`` (RGB) or ``[H, W, 1]`` (GRAY), and the image's
    original (height, width). ``shrink_to``: the resize that follows, (fit, (height, width)); a
    JPEG may then be decoded smaller (1/2 .. 1/8 scale), never below what that resize needs."""
    if not data:
        raise ImageInputError("image: the encoded image is empty")
    if data[:2] == _JPEG_MAGIC:
        jpeg = _simplejpeg()
        if jpeg is not None:
            return _decode_simplejpeg(jpeg, data, mode, shrink_to)
    return _decode_pillow(data, mode, shrink_to)


def needed_size(original: tuple[int, int], fit: Fit, size: tuple[int, int]) -> tuple[int, int]:
    """The smallest (height, width) an image of ``original`` size may be decoded at and still feed
    a ``fit`` resize to ``size`` without upsampling what the full image would not."""
    (h, w), (out_h, out_w) = original, size
    if fit == "stretch":
        return min(h, out_h), min(w, out_w)
    ratio = (min if fit == "letterbox" else max)(out_h / h, out_w / w)
    return min(h, math.ceil(h * ratio)), min(w, math.ceil(w * ratio))


def _decode_simplejpeg(
    jpeg: Any, data: bytes, mode: Mode, shrink_to: tuple[Fit, tuple[int, int]] | None
) -> tuple[np.ndarray, tuple[int, int]]:
    try:
        height, width, _, _ = jpeg.decode_jpeg_header(data)
    except ValueError as exc:
        raise ImageInputError(f"image: not a readable JPEG ({exc})") from exc
    _check_size(height, width)
    min_h, min_w = needed_size((height, width), *shrink_to) if shrink_to is not None else (0, 0)
    try:
        pixels = jpeg.decode_jpeg(
            data, colorspace="GRAY" if mode == "GRAY" else "RGB", min_height=min_h, min_width=min_w
        )
    except ValueError as exc:
        raise ImageInputError(f"image: not a readable JPEG ({exc})") from exc
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return pixels, (height, width)


def _decode_pillow(
    data: bytes, mode: Mode, shrink_to: tuple[Fit, tuple[int, int]] | None
) -> tuple[np.ndarray, tuple[int, int]]:
    Image = _pillow()
    try:
        with Image.open(io.BytesIO(data)) as img:
            width, height = img.size
            _check_size(height, width)
            if shrink_to is not None and img.format == "JPEG":
                min_h, min_w = needed_size((height, width), *shrink_to)
                img.draft("L" if mode == "GRAY" else "RGB", (min_w, min_h))
            pixels = np.asarray(img.convert("L" if mode == "GRAY" else "RGB"))
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageInputError(f"image: not a readable image ({exc})") from exc
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    return pixels, (height, width)


def _check_size(height: int, width: int) -> None:
    if height < 1 or width < 1 or height * width > MAX_PIXELS:
        raise ImageInputError(f"image: {width}x{height} pixels is outside 1 .. {MAX_PIXELS} pixels")


def _simplejpeg() -> Any:
    try:
        import simplejpeg
    except ImportError:
        return None
    return simplejpeg


def _pillow() -> Any:
    try:
        from PIL import Image
    except ImportError:
        raise ImageDecoderMissingError("image") from None
    return Image
