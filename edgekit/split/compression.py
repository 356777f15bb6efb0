"""Compressed forms of a cut tensor: the bytes a head's output takes on the link.

``fp16`` and ``int8`` (per-tensor affine: ``x ~ q * scale + low``, ``q`` in 0..255) change the
values, so their accuracy cost is measured by running the tail on the decoded tensor; every mode
is then deflated with ``zlib`` (the stdlib; zstd is not among the locked libraries here).
"""

from __future__ import annotations

import zlib
from typing import Literal

import numpy as np

Mode = Literal["none", "fp16", "int8"]
MODES: tuple[Mode, ...] = ("none", "fp16", "int8")
CODEC = "zlib"
ZLIB_LEVEL = 6


def encode(x: np.ndarray, mode: Mode) -> bytes:
    """``x`` in ``mode``, deflated (an int8 tensor starts with its low and scale as two float32)."""
    if mode == "none":
        raw = np.ascontiguousarray(x).tobytes()
    elif mode == "fp16":
        raw = x.astype(np.float16).tobytes()
    else:
        low, high = float(x.min()), float(x.max())
        scale = (high - low) / 255.0 or 1.0
        q = np.clip(np.rint((x - low) / scale), 0, 255).astype(np.uint8)
        raw = np.array([low, scale], dtype=np.float32).tobytes() + q.tobytes()
    return zlib.compress(raw, ZLIB_LEVEL)


def decode(data: bytes, mode: Mode, shape: tuple[int, ...], dtype: np.dtype[np.generic]) -> np.ndarray:
    raw = zlib.decompress(data)
    if mode == "none":
        return np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    if mode == "fp16":
        return np.frombuffer(raw, dtype=np.float16).reshape(shape).astype(dtype)
    low, scale = np.frombuffer(raw[:8], dtype=np.float32)
    q = np.frombuffer(raw[8:], dtype=np.uint8).reshape(shape)
    out: np.ndarray = (q.astype(np.float32) * scale + low).astype(dtype)
    return out
