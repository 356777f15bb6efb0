"""The engine's data: a bounded, stratified calibration subset (recorded by hash) and the
selection samples candidates are chosen on, which the final gate never sees.

Stratified: for a classifier, samples are taken round-robin over the FP32 model's predicted
classes, so a small subset still covers every class the data holds; for dense outputs, evenly
spaced over the set. Selection: the calibration samples left out of the subset when there are
at least ``MIN_SELECTION`` of them, else every calibration sample given, the subset included (the
final gate runs on the held-out evaluation data either way). Selecting on a few left-over
samples is worse than selecting on more that the calibration also saw: with 144 given and 128
calibrating, 16 selection samples (one flipped top-1 = 6 points) chose a MobileNetV3 INT8 that
missed a 98 % held-out gate (release check); shrinking the calibration subset to hold out more
cost PP-OCR's classifier a point of agreement instead.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from edgekit.validate.calib import arrays_sha256, sample_count

MIN_SELECTION = 64  # fewer left-over samples than this: select on every calibration sample
MAX_SELECTION = 512  # more left over: a stratified 512 of them (every candidate runs them all)


@dataclass(frozen=True)
class SearchData:
    calib: dict[str, np.ndarray]  # the calibration subset
    selection: dict[str, np.ndarray]  # what candidates are chosen on
    selection_source: str  # "calibration samples not used for calibration" / "the calibration subset"
    calib_sha256: str
    calib_total: int  # samples given, before the subset was taken
    # classifiers: FP32 top-1 margins of the inputs the gate represents (``optimize.flip_risk``):
    # the held-out inputs' where the packager has them, else None (the selection samples' own)
    margins: np.ndarray | None = None
    margins_source: str = ""


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


def search_data(calib: Mapping[str, np.ndarray], limit: int, fp32_classes: np.ndarray | None = None) -> SearchData:
    """The calibration subset of at most ``limit`` samples and the selection samples."""
    n = sample_count(calib)
    chosen = stratified_indices(n, limit, fp32_classes)
    subset = {k: v[chosen] for k, v in calib.items()}
    rest = np.setdiff1d(np.arange(n), chosen)
    if len(rest) >= MIN_SELECTION:
        pick = rest[stratified_indices(len(rest), MAX_SELECTION, None if fp32_classes is None else fp32_classes[rest])]
        selection = {k: v[pick] for k, v in calib.items()}
        source = f"{len(pick)} calibration samples not used for calibration"
    else:
        selection = dict(calib)
        source = (
            f"the {n} calibration samples (none left over to hold out)"
            if not len(rest)
            else f"all {n} calibration samples, the {len(chosen)} calibrating included "
            f"(too few left over to hold out: {len(rest)} < {MIN_SELECTION})"
        )
    return SearchData(
        calib=subset, selection=selection, selection_source=source, calib_sha256=arrays_sha256(subset), calib_total=n
    )
