"""Image geometry and pixel ops on HWC arrays, numpy only.

``resize`` (bilinear with half-pixel centres, as Pillow and OpenCV place samples; a shrink by 2x
or more first averages whole blocks of pixels, so a camera frame is not aliased), ``letterbox``
(fit inside, keep the aspect ratio, pad), ``center_crop`` (fill, keep the aspect ratio, crop the
middle). Each returns the ``Geometry`` it applied, so that points found in the model's input (a
detector's boxes) map back to the original image.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Interpolation = Literal["nearest", "bilinear", "area"]


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where the original image's pixels went: ``model = original * scale + offset`` per axis;
    ``original``: its (height, width)."""

    original: tuple[int, int]
    scale_y: float = 1.0
    scale_x: float = 1.0
    offset_y: float = 0.0
    offset_x: float = 0.0

    def then(self, scale_y: float, scale_x: float, offset_y: float = 0.0, offset_x: float = 0.0) -> Geometry:
        """This geometry followed by another scale and offset."""
        return Geometry(
            self.original,
            self.scale_y * scale_y,
            self.scale_x * scale_x,
            self.offset_y * scale_y + offset_y,
            self.offset_x * scale_x + offset_x,
        )

    def to_original(self, boxes: np.ndarray) -> np.ndarray:
        """``[N, 4]`` x1, y1, x2, y2 in the model's input pixels -> the original image's, clipped to it."""
        out = np.empty_like(boxes, dtype=np.float32)
        out[:, 0::2] = (boxes[:, 0::2] - self.offset_x) / self.scale_x
        out[:, 1::2] = (boxes[:, 1::2] - self.offset_y) / self.scale_y
        h, w = self.original
        np.clip(out[:, 0::2], 0, w, out=out[:, 0::2])
        np.clip(out[:, 1::2], 0, h, out=out[:, 1::2])
        return out


def resize(image: np.ndarray, size: tuple[int, int], interpolation: Interpolation = "bilinear") -> np.ndarray:
    """``image`` ``[H, W, C]`` resized to ``size`` (height, width) as float32 (uint8 in, uint8 out
    for ``nearest``). ``area`` and ``bilinear`` are the same here: a shrink of 2x or more averages
    blocks first."""
    h, w = size
    in_h, in_w = image.shape[:2]
    if (in_h, in_w) == (h, w):
        return image.astype(np.float32) if image.dtype == np.uint8 else image
    if interpolation == "nearest":
        ys = np.minimum(((np.arange(h) + 0.5) * in_h / h).astype(np.intp), in_h - 1)
        xs = np.minimum(((np.arange(w) + 0.5) * in_w / w).astype(np.intp), in_w - 1)
        picked: np.ndarray = image[ys][:, xs]
        return picked
    fy, fx = max(1, in_h // h), max(1, in_w // w)
    src = image
    if fy > 1 or fx > 1:  # block average first: no aliasing on a big shrink
        bh, bw = in_h // fy, in_w // fx
        blocks = image[: bh * fy, : bw * fx].reshape(bh, fy, bw, fx, image.shape[2])
        src = blocks.mean(axis=(1, 3), dtype=np.float32)
    y0, y1, wy = _taps(in_h, h, fy, src.shape[0])
    x0, x1, wx = _taps(in_w, w, fx, src.shape[1])
    src = src.astype(np.float32, copy=False)
    rows = src[y0] * (1 - wy)[:, None, None] + src[y1] * wy[:, None, None]
    out: np.ndarray = rows[:, x0] * (1 - wx)[None, :, None] + rows[:, x1] * wx[None, :, None]
    return out


def _taps(n_in: int, n_out: int, block: int, n_src: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For each output position: the two source indices and the second one's weight. Source
    pixel ``j`` of a block-averaged axis is the mean of original pixels ``j*block .. j*block+block-1``."""
    centre = (np.arange(n_out, dtype=np.float64) + 0.5) * (n_in / n_out) - 0.5  # in original pixels
    pos = np.clip((centre - (block - 1) / 2) / block, 0, n_src - 1)
    lo = np.floor(pos).astype(np.intp)
    hi = np.minimum(lo + 1, n_src - 1)
    return lo, hi, (pos - lo).astype(np.float32)


def letterbox(
    image: np.ndarray, size: tuple[int, int], pad_value: float, geometry: Geometry
) -> tuple[np.ndarray, Geometry]:
    """Fit ``image`` inside ``size`` keeping its aspect ratio, centred, ``pad_value`` around it."""
    h, w = size
    in_h, in_w = image.shape[:2]
    ratio = min(h / in_h, w / in_w)
    new_h, new_w = max(1, min(h, round(in_h * ratio))), max(1, min(w, round(in_w * ratio)))
    top, left = (h - new_h) // 2, (w - new_w) // 2
    out = np.full((h, w, image.shape[2]), pad_value, dtype=np.float32)
    out[top : top + new_h, left : left + new_w] = resize(image, (new_h, new_w))
    return out, geometry.then(new_h / in_h, new_w / in_w, top, left)


def center_crop(
    image: np.ndarray, size: tuple[int, int], geometry: Geometry, interpolation: Interpolation = "bilinear"
) -> tuple[np.ndarray, Geometry]:
    """Scale ``image`` to cover ``size`` keeping its aspect ratio, then cut out the middle."""
    h, w = size
    in_h, in_w = image.shape[:2]
    ratio = max(h / in_h, w / in_w)
    new_h, new_w = max(h, math.ceil(in_h * ratio - 1e-9)), max(w, math.ceil(in_w * ratio - 1e-9))
    scaled = resize(image, (new_h, new_w), interpolation)
    top, left = (new_h - h) // 2, (new_w - w) // 2
    return scaled[top : top + h, left : left + w], geometry.then(new_h / in_h, new_w / in_w, -top, -left)


def stretch(
    image: np.ndarray, size: tuple[int, int], geometry: Geometry, interpolation: Interpolation = "bilinear"
) -> tuple[np.ndarray, Geometry]:
    """Resize to ``size`` whatever the aspect ratio."""
    in_h, in_w = image.shape[:2]
    return resize(image, size, interpolation), geometry.then(size[0] / in_h, size[1] / in_w)
