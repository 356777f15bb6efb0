"""A manifest's pre-processing steps, applied to one image: encoded bytes or uint8 HWC pixels in,
the model's input tensor (batch of one) out, with the ``Geometry`` that maps its pixels back.

The steps run in list order (``ProcessingStep``): ``channel_order``, ``resize`` / ``letterbox``
/ ``center_crop``, ``scale``, ``normalize``, ``layout``, ``cast``. The image is decoded as RGB,
or as one gray channel when the model input has one channel. The host reads calibration images
through the same class, so what the agent serves is what the host validated.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from device_agents.processing.images import Fit, Mode, decode_image
from device_agents.processing.transforms import Geometry, center_crop, letterbox, stretch
from edgekit.bundle.errors import InferenceInputError, ManifestError
from edgekit.bundle.manifest import ProcessingStep, TensorSpec

_GEOMETRY_OPS = {"resize": "stretch", "letterbox": "letterbox", "center_crop": "center_crop"}
_PRE_OPS = ("channel_order", "resize", "letterbox", "center_crop", "scale", "normalize", "layout", "cast")


class Preprocessor:
    """The pre-processing of one model input (``spec``, the model's served input)."""

    def __init__(self, steps: Sequence[ProcessingStep], spec: TensorSpec) -> None:
        self.spec = spec
        self.steps = tuple(steps)
        for step in self.steps:
            if step.op not in _PRE_OPS:
                raise ManifestError(f"preprocess: {step.op!r} is not a pre-processing op ({', '.join(_PRE_OPS)})")
        layouts = [s.layout for s in self.steps if s.op == "layout"]
        self.layout = layouts[-1] if layouts else "NCHW"
        if len(spec.shape) != 4:
            raise ManifestError(f"preprocess: input {spec.name!r} {list(spec.shape)} is not an image batch (rank 4)")
        channels = spec.shape[1] if self.layout == "NCHW" else spec.shape[3]
        if channels not in (1, 3):
            raise ManifestError(
                f"preprocess: input {spec.name!r} {list(spec.shape)} has no 1- or 3-channel axis for {self.layout}"
            )
        self.mode: Mode = "GRAY" if channels == 1 else "RGB"
        self.channels = int(channels)
        sized = [s for s in self.steps if s.op in _GEOMETRY_OPS]
        if len(sized) != 1 or sized[0].size is None:
            raise ManifestError("preprocess: exactly one of resize, letterbox, center_crop sets the input size")
        fit: Fit = _GEOMETRY_OPS[sized[0].op]  # type: ignore[assignment]  # the table's values are Fit names
        self.size: tuple[int, int] = (int(sized[0].size[0]), int(sized[0].size[1]))
        self.shrink_to: tuple[Fit, tuple[int, int]] = (fit, self.size)
        self.dtype = np.dtype(spec.dtype if spec.dtype != "bool" else "float32")
        for step in self.steps:
            if step.op == "normalize" and len(step.mean) not in (1, self.channels):
                raise ManifestError(f"preprocess: normalize has {len(step.mean)} values for {self.channels} channel(s)")

    def from_bytes(self, data: bytes) -> tuple[np.ndarray, Geometry]:
        """An encoded image (JPEG, PNG, ...) to the model input ``[1, ...]`` and its geometry."""
        pixels, original = decode_image(data, self.mode, self.shrink_to)
        geometry = Geometry(original)
        if pixels.shape[:2] != original:  # a scaled JPEG decode
            geometry = geometry.then(pixels.shape[0] / original[0], pixels.shape[1] / original[1])
        return self._run(pixels, geometry)

    def from_pixels(self, pixels: np.ndarray) -> tuple[np.ndarray, Geometry]:
        """uint8 pixels ``[H, W, C]`` (or ``[1, H, W, C]``; C as the model input's, RGB order) to
        the model input ``[1, ...]`` and its geometry."""
        if pixels.ndim == 4 and pixels.shape[0] == 1:
            pixels = pixels[0]
        if pixels.ndim == 2 and self.channels == 1:
            pixels = pixels[:, :, None]
        if pixels.dtype != np.uint8 or pixels.ndim != 3 or pixels.shape[2] != self.channels:
            raise InferenceInputError(
                f"input {self.spec.name!r}: expected an encoded image (BYTES) or uint8 pixels [H, W, {self.channels}], "
                f"got {pixels.dtype} {list(pixels.shape)}"
            )
        if min(pixels.shape[:2]) < 1:
            raise InferenceInputError(f"input {self.spec.name!r}: an image of {list(pixels.shape)} has no pixels")
        return self._run(pixels, Geometry((int(pixels.shape[0]), int(pixels.shape[1]))))

    def _run(self, image: np.ndarray, geometry: Geometry) -> tuple[np.ndarray, Geometry]:
        x: np.ndarray = image
        batched = False  # after ``layout``: [1, C, H, W] or [1, H, W, C]
        for step in self.steps:
            op = step.op
            if op == "channel_order":
                if step.order == "BGR" and self.channels == 3:
                    x = x[..., ::-1] if not batched or self.layout == "NHWC" else x[:, ::-1]
            elif op == "letterbox":
                x, geometry = letterbox(x, self.size, step.pad_value or 0.0, geometry)
            elif op == "resize":
                x, geometry = stretch(x, self.size, geometry, step.interpolation or "bilinear")
            elif op == "center_crop":
                x, geometry = center_crop(x, self.size, geometry, step.interpolation or "bilinear")
            elif op == "scale":
                x = x * np.float32(step.value)
            elif op == "normalize":
                shape = (-1, 1, 1) if batched and self.layout == "NCHW" else (-1,)
                x = (x - np.asarray(step.mean, np.float32).reshape(shape)) / np.asarray(step.std, np.float32).reshape(
                    shape
                )
            elif op == "layout":
                x = x[None].transpose(0, 3, 1, 2) if step.layout == "NCHW" else x[None]
                batched = True
            elif op == "cast":
                x = _cast(x, np.dtype(step.dtype))
        if not batched:
            x = x[None].transpose(0, 3, 1, 2) if self.layout == "NCHW" else x[None]
        return np.ascontiguousarray(_cast(x, self.dtype)), geometry


def _cast(x: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    if x.dtype == dtype:
        return x
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        rounded: np.ndarray = np.clip(np.rint(x), info.min, info.max)
        return rounded.astype(dtype)
    return x.astype(dtype)
