"""A detector judged by what its client receives: the detections after the bundle's
post-processing (decode, score filter, class-wise NMS), the candidate's matched to FP32's.

Per sample, each FP32 detection (best score first) is matched to the candidate's unmatched
detection of the same class that overlaps it most, at IoU >= ``MATCH_IOU``; F1 = 2 matched /
(FP32's + the candidate's detections), 1 when neither has any. The gate asks F1 >=
``DETECTION_MIN_F1``; the matched pairs' IoU and score differences are recorded. A channel that
never fires cannot veto a candidate that keeps every detection; class scores crushed to nothing
leave no detections, and fail.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

MATCH_IOU = 0.5
DETECTION_MIN_F1 = 0.95


@dataclass(frozen=True)
class DetectionAgreement:
    f1: float
    reference: int  # FP32's detections, all samples
    candidate: int
    matched: int
    mean_iou: float | None  # of the matched pairs
    max_score_error: float | None  # |score difference|, worst matched pair
    # per sample: (matched, fp32's detections, the candidate's), for the F1's sampling error
    per_sample: tuple[tuple[int, int, int], ...] = ()

    def text(self) -> str:
        extra = ""
        if self.mean_iou is not None and self.max_score_error is not None:
            extra = f", matched mean IoU {self.mean_iou:.3f}, score error <= {self.max_score_error:.3f}"
        return (
            f"detections F1 {self.f1:.3f} vs fp32 ({self.matched} of {self.reference} fp32 detections matched at "
            f"IoU {MATCH_IOU:g}, {self.candidate} found{extra})"
        )


def boxes_post(post: Any) -> bool:
    """Whether ``post`` (a ``device_agents.processing.post.Postprocessor``) ends in ``boxes``."""
    return post is not None and getattr(getattr(post, "final", None), "op", None) == "boxes"


def detection_agreement(
    reference: Mapping[str, np.ndarray], candidate: Mapping[str, np.ndarray], post: Any
) -> DetectionAgreement:
    """Match the detections ``post`` makes of ``candidate`` to those it makes of ``reference``
    (one sample at a time, samples on axis 0 of ``post.tensor``)."""
    name = post.tensor
    ref, cand = np.asarray(reference[name]), np.asarray(candidate[name])
    n_ref = n_cand = matched = 0
    ious: list[float] = []
    score_err: list[float] = []
    counts: list[tuple[int, int, int]] = []
    for i in range(ref.shape[0]):
        r = post.run({name: ref[i : i + 1]}, None)
        c = post.run({name: cand[i : i + 1]}, None)
        n_ref += len(r["scores"])
        n_cand += len(c["scores"])
        before = matched
        free = np.ones(len(c["scores"]), dtype=bool)
        for j in np.argsort(-r["scores"], kind="stable"):
            same = np.flatnonzero(free & (c["classes"] == r["classes"][j]))
            if not same.size:
                continue
            overlap = _iou(r["boxes"][j], c["boxes"][same])
            best = int(np.argmax(overlap))
            if overlap[best] >= MATCH_IOU:
                free[same[best]] = False
                matched += 1
                ious.append(float(overlap[best]))
                score_err.append(abs(float(r["scores"][j]) - float(c["scores"][same[best]])))
        counts.append((matched - before, len(r["scores"]), len(c["scores"])))
    f1 = 1.0 if n_ref + n_cand == 0 else 2 * matched / (n_ref + n_cand)
    return DetectionAgreement(
        f1=f1,
        reference=n_ref,
        candidate=n_cand,
        matched=matched,
        mean_iou=float(np.mean(ious)) if ious else None,
        max_score_error=max(score_err) if score_err else None,
        per_sample=tuple(counts),
    )


def _iou(box: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """IoU of one x1, y1, x2, y2 box with each of ``boxes`` [N, 4]."""
    w = np.maximum(np.minimum(box[2], boxes[:, 2]) - np.maximum(box[0], boxes[:, 0]), 0)
    h = np.maximum(np.minimum(box[3], boxes[:, 3]) - np.maximum(box[1], boxes[:, 1]), 0)
    inter = w * h
    area = max(float(box[2] - box[0]), 0.0) * max(float(box[3] - box[1]), 0.0)
    areas = np.maximum(boxes[:, 2] - boxes[:, 0], 0) * np.maximum(boxes[:, 3] - boxes[:, 1], 0)
    union = area + areas - inter
    return np.asarray(np.divide(inter, union, out=np.zeros_like(inter, dtype=np.float64), where=union > 0))
