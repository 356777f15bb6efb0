"""TensorRT INT8 calibration cache, the text format TensorRT's calibrators read and write.

The first line names the TensorRT version and calibrator (``TRT-100000-EntropyCalibration2``);
every other line is ``tensor_name: XXXXXXXX``, the big-endian IEEE-754 bits of the float32
scale (``amax / 127``) in hex. TensorRT 10 ignores such a cache for explicit-quantization (Q/DQ)
networks; it is shipped for implicit-quantization builds of the FP32 graph, whose tensor names
it uses.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from pathlib import Path

from edgekit.errors import CalibrationDataError, ModelFormatError

# calibration method (our option name) -> TensorRT calibrator whose algorithm produced the scales.
# TensorRT's legacy calibrator is the percentile (quantile) one.
CALIBRATORS = {"entropy": "EntropyCalibration2", "minmax": "MinMaxCalibration", "percentile": "LegacyCalibration"}
INT8_MAX = 127.0


def trt_version_number(version: str) -> int:
    """``"10.3.0"`` -> ``100300`` (TensorRT >= 10), ``"8.6.1"`` -> ``8601`` (TensorRT 8), as in the header."""
    try:
        parts = [int(p) for p in version.split(".")[:3]]
    except ValueError as exc:
        raise ValueError(f"TensorRT version {version!r} is not like '10.0.0'") from exc
    major, minor, patch = [*parts, 0, 0][:3]
    if major >= 10:
        return major * 10000 + minor * 100 + patch
    return major * 1000 + minor * 100 + patch


def scales_from_ranges(ranges: Mapping[str, tuple[float, float]]) -> dict[str, float]:
    """Symmetric INT8 scale per tensor from its calibrated (low, high) range: ``max(|low|, |high|) / 127``."""
    scales = {}
    for name, (low, high) in ranges.items():
        amax = max(abs(float(low)), abs(float(high)))
        if not math.isfinite(amax):
            raise CalibrationDataError(f"tensor {name!r}: calibrated range ({low}, {high}) is not finite")
        # A tensor that is always zero still needs a usable, positive scale.
        scales[name] = amax / INT8_MAX if amax > 0 else 1.0 / INT8_MAX
    return scales


def format_table(scales: Mapping[str, float], *, method: str, trt_version: str) -> str:
    """The cache text for ``scales`` (tensor name -> float32 scale), tensors in the given order."""
    if method not in CALIBRATORS:
        raise ValueError(f"calibration method {method!r} is not one of {', '.join(CALIBRATORS)}")
    lines = [f"TRT-{trt_version_number(trt_version)}-{CALIBRATORS[method]}"]
    for name, scale in scales.items():
        if "\n" in name or ": " in name:
            raise ModelFormatError(f"tensor name {name!r} cannot be written to a TensorRT calibration cache")
        if not (math.isfinite(scale) and scale > 0):
            raise CalibrationDataError(f"tensor {name!r}: scale {scale} must be finite and > 0")
        bits = struct.unpack(">I", struct.pack(">f", scale))[0]
        lines.append(f"{name}: {bits:08x}")
    return "\n".join(lines) + "\n"


def parse_table(text: str) -> tuple[str, dict[str, float]]:
    """(header, tensor name -> scale) from cache text; the inverse of ``format_table``."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines or not lines[0].startswith("TRT-"):
        raise ModelFormatError("TensorRT calibration cache must start with a 'TRT-<version>-<calibrator>' line")
    scales = {}
    for number, line in enumerate(lines[1:], start=2):
        name, sep, hexbits = line.rpartition(": ")
        if not sep or len(hexbits) != 8:
            raise ModelFormatError(f"calibration cache line {number}: {line!r} is not 'tensor: 8 hex digits'")
        try:
            scales[name] = struct.unpack(">f", bytes.fromhex(hexbits))[0]
        except ValueError as exc:
            raise ModelFormatError(f"calibration cache line {number}: {hexbits!r} is not hex") from exc
    return lines[0], scales


def write_table(path: Path, ranges: Mapping[str, tuple[float, float]], *, method: str, trt_version: str) -> Path:
    """Write the cache for calibrated ``ranges`` to ``path``; return it."""
    Path(path).write_text(format_table(scales_from_ranges(ranges), method=method, trt_version=trt_version))
    return Path(path)
