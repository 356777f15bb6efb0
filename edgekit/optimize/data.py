"""The engine's data: a bounded, stratified calibration subset (recorded by hash) and the
selection samples candidates are chosen on, which the final gate never sees.

Stratified: for a classifier, samples are taken round-robin over the FP32 model's predicted
classes, so a small subset still covers every class the data holds; for dense outputs, evenly
spaced over the set. Selection: the calibration samples left out of the subset when there are
enough of them, else the subset itself (the final gate runs on the held-out evaluation data
either way). At least a third of the samples are held out for selection when that third is
``MIN_SELECTION`` or more, even if the calibration subset then holds fewer than asked: on 16
selection samples one flipped top-1 is 6 points, and a candidate chosen there missed a 98 %
held-out gate on a MobileNetV3 (release check, 144 samples given, 128 calibrating).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgekit.validate.calib import sample_count

DEFAULT_CALIB_SAMPLES = 128
MIN_SELECTION = 16  # fewer left-over samples than this: select on the calibration subset
MIN_CALIB = 32  # the calibration subset never shrinks below this to make room for selection


@dataclass(frozen=True)
class SearchData:
    calib: dict[str, np.ndarray]  # the calibration subset
    selection: dict[str, np.ndarray]  # what candidates are chosen on
    selection_source: str  # "calibration samples not used for calibration" / "the calibration subset"
    calib_sha256: str
    calib_total: int  # samples given, before the subset was taken


def stratified_indices(n: int, limit: int, classes: np.ndarray | None) -> np.ndarray:
    """At most ``limit`` of ``n`` sample indices, sorted: round-robin over ``classes`` (one label
    per sample) where given, else evenly spaced."""
    if n <= limit:
        return np.arange(n)
    if classes is None:
        return np.unique(np.linspace(0, n - 1, limit).round().astype(np.int64))
    groups = [np.flatnonzero(classes == c) for c in np.unique(classes)]
    picked: list[int] = []
    depth = 0
    while len(picked) < limit:
        for g in groups:
            if depth < len(g) and len(picked) < limit:
                picked.append(int(g[depth]))
        depth += 1
    return np.sort(np.asarray(picked, dtype=np.int64))


def arrays_sha256(arrays: Mapping[str, np.ndarray]) -> str:
    """sha256 over input names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{list(a.shape)};".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def search_data(calib: Mapping[str, np.ndarray], limit: int, fp32_classes: np.ndarray | None = None) -> SearchData:
    """The calibration subset of at most ``limit`` samples and the selection samples."""
    n = sample_count(calib)
    held = n // 3
    if held >= MIN_SELECTION and n - held >= MIN_CALIB:
        limit = min(limit, n - held)
    chosen = stratified_indices(n, limit, fp32_classes)
    subset = {k: v[chosen] for k, v in calib.items()}
    rest = np.setdiff1d(np.arange(n), chosen)
    if len(rest) >= MIN_SELECTION:
        selection = {k: v[rest] for k, v in calib.items()}
        source = f"{len(rest)} calibration samples not used for calibration"
    else:
        selection = subset
        source = f"the {len(chosen)} calibration samples (too few left over to hold out)"
    return SearchData(
        calib=subset, selection=selection, selection_source=source, calib_sha256=arrays_sha256(subset), calib_total=n
    )
