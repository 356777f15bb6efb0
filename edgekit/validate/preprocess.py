"""Image pre-processing as data: ``--preprocess size=224x224,fit=letterbox,mean=0.485/0.456/0.406,...``.

``Preprocess`` turns image files into one model input's samples (calibration and evaluation data
from a folder of real images). It is typed data, not code, so that the same description can travel
in a manifest's pre-processing, which a device applies as data and never runs as code.

Order: decode -> channels (RGB / BGR / GRAY) -> resize to ``size`` (``stretch``, ``letterbox``
keeping the aspect ratio with ``pad`` around it, or ``center-crop``) -> divide by ``scale`` ->
subtract ``mean``, divide by ``std`` (per channel) -> ``layout`` (NCHW or NHWC).

This module is the host's side only (parsing the flag, reading image folders); the pixels are
computed by the device's own pre-processing (``device_agents.processing``), from the same
manifest steps ``to_steps`` writes.
"""

from __future__ import annotations

import dataclasses
import difflib
import glob
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgekit.bundle.manifest import ProcessingStep, TensorSpec
from edgekit.errors import CalibrationDataError, ConfigError, MissingSDKError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm")
Fit = Literal["stretch", "letterbox", "center-crop"]
Channels = Literal["RGB", "BGR", "GRAY"]
Layout = Literal["NCHW", "NHWC"]
_FITS: tuple[Fit, ...] = ("stretch", "letterbox", "center-crop")
_CHANNELS: tuple[Channels, ...] = ("RGB", "BGR", "GRAY")
_LAYOUTS: tuple[Layout, ...] = ("NCHW", "NHWC")


@dataclass(frozen=True)
class Preprocess:
    """How image files become model input samples; ``None`` fields are taken from the model input."""

    size: tuple[int, int] | None = None  # (height, width); default: the model input's fixed H and W
    fit: Fit = "stretch"
    channels: Channels | None = None  # default: GRAY for 1 channel, RGB for 3
    layout: Layout = "NCHW"
    scale: float = 255.0  # pixel values are divided by this first
    mean: tuple[float, ...] = (0.0,)  # one value, or one per channel
    std: tuple[float, ...] = (1.0,)
    pad: int = 0  # letterbox padding value (0-255)

    def __post_init__(self) -> None:
        if self.size is not None and (len(self.size) != 2 or min(self.size) < 1):
            raise ConfigError(f"--preprocess size: expected HxW such as 224x224, got {self.size}")
        if self.scale <= 0 or any(s <= 0 for s in self.std):
            raise ConfigError("--preprocess scale and std must be > 0")
        if not 0 <= self.pad <= 255:
            raise ConfigError(f"--preprocess pad: expected 0-255, got {self.pad}")

    @classmethod
    def parse(cls, text: str) -> Preprocess:
        """``"size=224x224,fit=letterbox,mean=0.485/0.456/0.406,std=0.229/0.224/0.225,channels=BGR"``."""
        known = [f.name for f in dataclasses.fields(cls)]
        values: dict[str, Any] = {}
        for item in (i.strip() for i in text.split(",") if i.strip()):
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or not raw:
                raise ConfigError(f"--preprocess {item!r}: expected KEY=VALUE such as size=224x224")
            if key not in known:
                near = difflib.get_close_matches(key, known, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"--preprocess {key}: unknown key (known: {', '.join(known)}){hint}")
            values[key] = _parse_value(key, raw)
        return cls(**values)

    def to_data(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def describe(self) -> str:
        """The ``--preprocess`` text that gives this object back."""
        parts = []
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "size":
                v = f"{v[0]}x{v[1]}"
            elif isinstance(v, tuple):
                v = "/".join(f"{x:g}" for x in v)
            elif isinstance(v, float):
                v = f"{v:g}"
            parts.append(f"{f.name}={v}")
        return ",".join(parts)

    def to_steps(self, spec: TensorSpec) -> tuple[ProcessingStep, ...]:
        """The manifest's pre-processing ops for ``spec``: from a decoded HWC image (RGB, or one
        channel for GRAY) to the served input, in the order ``apply`` runs them."""
        channels, size = self._target(spec)
        mode = self.channels or ("GRAY" if channels == 1 else "RGB")
        steps: list[ProcessingStep] = []
        if mode == "BGR":
            steps.append(ProcessingStep(op="channel_order", tensor=spec.name, order="BGR"))
        if self.fit == "letterbox":
            steps.append(ProcessingStep(op="letterbox", tensor=spec.name, size=size, pad_value=float(self.pad)))
        elif self.fit == "stretch":
            steps.append(ProcessingStep(op="resize", tensor=spec.name, size=size, interpolation="bilinear"))
        else:
            steps.append(ProcessingStep(op="center_crop", tensor=spec.name, size=size, interpolation="bilinear"))
        steps.append(ProcessingStep(op="scale", tensor=spec.name, value=1.0 / self.scale))
        if any(m != 0 for m in self.mean) or any(s != 1 for s in self.std):
            n = max(len(self.mean), len(self.std))
            mean = self.mean * n if len(self.mean) == 1 else self.mean
            std = self.std * n if len(self.std) == 1 else self.std
            steps.append(ProcessingStep(op="normalize", tensor=spec.name, mean=mean, std=std))
        steps.append(ProcessingStep(op="layout", tensor=spec.name, layout=self.layout))
        steps.append(ProcessingStep(op="cast", tensor=spec.name, dtype=spec.dtype))
        return tuple(steps)

    def apply(self, paths: Sequence[Path], spec: TensorSpec) -> np.ndarray:
        """Samples for ``spec`` (rank 4, NCHW or NHWC as ``layout``) from ``paths``, stacked on axis 0.

        Each image goes through the device's own pre-processing (``device_agents.processing``)
        with the steps ``to_steps`` records in the manifest: the agent serving an image request
        computes exactly what was calibrated and validated here."""
        from device_agents.processing.images import ImageDecoderMissingError, ImageInputError
        from device_agents.processing.pre import Preprocessor

        channels, (h, w) = self._target(spec)
        mode = self.channels or ("GRAY" if channels == 1 else "RGB")
        if (mode == "GRAY") != (channels == 1):
            raise ConfigError(
                f"--preprocess channels={mode} gives {1 if mode == 'GRAY' else 3} channels, but input {spec.name!r} "
                f"takes {channels}"
            )
        for label, values in (("mean", self.mean), ("std", self.std)):
            if len(values) not in (1, channels):
                raise ConfigError(
                    f"--preprocess {label}: {len(values)} values for {channels} channels; give 1 or {channels}"
                )
        pre = Preprocessor(self.to_steps(spec), _fixed(spec, self.layout, channels, (h, w)))
        out: np.ndarray | None = None
        for i, path in enumerate(paths):
            try:
                sample, _ = pre.from_bytes(Path(path).read_bytes())
            except ImageDecoderMissingError:
                raise MissingSDKError("Pillow", "host", "reading calibration images") from None
            except (ImageInputError, OSError) as exc:
                raise CalibrationDataError(f"image {path} cannot be read ({exc}); remove it or fix it") from exc
            if out is None:
                out = np.empty((len(paths), *sample.shape[1:]), dtype=sample.dtype)
            out[i] = sample[0]
        if out is None:
            raise CalibrationDataError("no images to read")
        return out

    def _target(self, spec: TensorSpec) -> tuple[int, tuple[int, int]]:
        if len(spec.shape) != 4:
            raise ConfigError(
                f"images feed rank-4 inputs; input {spec.name!r} has shape {list(spec.shape)}: give an .npz instead"
            )
        c_axis, hw_axes = (1, (2, 3)) if self.layout == "NCHW" else (3, (1, 2))
        c = spec.shape[c_axis]
        if not isinstance(c, int) or c not in (1, 3):
            raise ConfigError(
                f"input {spec.name!r} {list(spec.shape)} has no 1- or 3-channel axis {c_axis} for layout "
                f"{self.layout}; pass --preprocess layout={'NHWC' if self.layout == 'NCHW' else 'NCHW'} if that is it"
            )
        dims = [spec.shape[a] for a in hw_axes]
        if self.size is not None:
            for axis, want, got in zip(hw_axes, self.size, dims, strict=True):
                if isinstance(got, int) and got != want:
                    raise ConfigError(
                        f"--preprocess size={self.size[0]}x{self.size[1]}: input {spec.name!r} fixes axis {axis} "
                        f"to {got}"
                    )
            return c, self.size
        if not all(isinstance(d, int) for d in dims):
            raise ConfigError(
                f"input {spec.name!r} {list(spec.shape)} has a dynamic height or width: give --preprocess size=HxW"
            )
        return c, (int(dims[0]), int(dims[1]))


def describe_steps(steps: Sequence[ProcessingStep]) -> str:
    """Pre-processing steps as one line (``resize size=16x16 interpolation=bilinear -> scale
    value=0.00392157 -> ...``): what ``inspect``, the package note and the candidate report print."""
    from edgekit.bundle.codec import to_data

    def value(k: str, v: Any) -> str:
        if isinstance(v, list):
            return ("x" if k == "size" else "/").join(f"{x:g}" if isinstance(x, float) else str(x) for x in v)
        return f"{v:g}" if isinstance(v, float) else str(v)

    def one(step: ProcessingStep) -> str:
        shown = {k: v for k, v in to_data(step).items() if k not in ("op", "tensor") and v not in ([], None)}
        return " ".join([step.op, *(f"{k}={value(k, v)}" for k, v in shown.items())])

    return " -> ".join(one(s) for s in steps)


def image_files(source: str | Path) -> list[Path] | None:
    """The image files of a folder (recursively) or a glob pattern, sorted; ``None`` if ``source``
    is neither (a file path)."""
    text = str(source)
    if any(c in text for c in "*?["):
        found = [Path(p) for p in glob.glob(text, recursive=True)]
    elif Path(text).is_dir():
        found = [p for p in Path(text).rglob("*")]
    else:
        return None
    return sorted(p for p in found if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)


def _parse_value(key: str, raw: str) -> Any:
    try:
        if key == "size":
            h, _, w = raw.lower().partition("x")
            return (int(h), int(w or h))
        if key in ("mean", "std"):
            return tuple(float(x) for x in raw.split("/"))
        if key == "scale":
            return float(raw)
        if key == "pad":
            return int(raw)
    except ValueError:
        example = {"size": "224x224", "mean": "0.485/0.456/0.406", "std": "0.229/0.224/0.225"}.get(key, "255")
        raise ConfigError(f"--preprocess {key}={raw}: expected a value such as {key}={example}") from None
    choices: tuple[str, ...] = {"fit": _FITS, "channels": _CHANNELS, "layout": _LAYOUTS}[key]
    for c in choices:
        if raw.lower() == c.lower():
            return c
    near = difflib.get_close_matches(raw, choices, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ConfigError(f"--preprocess {key}={raw}: choose from {', '.join(choices)}{hint}")


def _fixed(spec: TensorSpec, layout: Layout, channels: int, size: tuple[int, int]) -> TensorSpec:
    """``spec`` with its batch of one and its image axes fixed (dynamic H / W take ``size``)."""
    shape = (1, channels, *size) if layout == "NCHW" else (1, *size, channels)
    return dataclasses.replace(spec, shape=shape)
