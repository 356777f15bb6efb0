"""Predicted top-1 agreement of a classifier candidate on inputs it was not measured on.

Agreement on the selection samples saturates when they are easy. Calibration data is often the
training data, on which the model is confident: on a trained MobileNetV3-small (release check) the
5th-percentile top-1 margin was 5.7 logits on the calibration samples and 0.64 on held-out ones,
so INT8 candidates agreed 100 % on the selection samples and 0.86-0.97 on the held-out gate (98 %).

A top-1 flip happens where the candidate closes the FP32 gap between the top-1 class and another
class by more than that gap. What a candidate does is measured on the selection samples: per
sample, the *gap shrink* (the most any other class gained on the FP32 top-1, in score units).
How close the decisions are is a property of the data and the FP32 model alone: the top-1
margins of the FP32 model on the inputs the gate represents (the held-out inputs where the
packager has them: their FP32 outputs only, never a candidate's; else the selection samples').
Predicted agreement = the mean over those margins ``m`` of P(shrink < m), the shrink's
distribution taken from the selection samples (shrink and margin treated as independent).
"""

from __future__ import annotations

import numpy as np


def top1_margins(scores: np.ndarray) -> np.ndarray:
    """Per sample, top-1 score minus the runner-up's (one row of class scores per sample)."""
    s = np.asarray(scores, dtype=np.float64).reshape(len(scores), -1)
    if s.shape[1] < 2:
        raise ValueError(f"top-1 margins need at least 2 classes, got scores of shape {list(np.shape(scores))}")
    two = np.sort(s, axis=1)[:, -2:]
    return two[:, 1] - two[:, 0]


def gap_shrink(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Per sample, the largest amount by which any class gained on the FP32 top-1 class
    (``(r_top - r_j) - (c_top - c_j)``, max over ``j != top``). A sample flips where it exceeds
    the sample's FP32 margin."""
    r = np.asarray(reference, dtype=np.float64).reshape(len(reference), -1)
    c = np.asarray(candidate, dtype=np.float64).reshape(len(candidate), -1)
    if r.shape != c.shape:
        raise ValueError(f"candidate scores {list(c.shape)} != reference scores {list(r.shape)}")
    rows = np.arange(len(r))
    top = r.argmax(axis=1)
    shrink = (r[rows, top][:, None] - r) - (c[rows, top][:, None] - c)
    shrink[rows, top] = -np.inf
    return np.asarray(shrink.max(axis=1), dtype=np.float64)


def predicted_agreement(reference: np.ndarray, candidate: np.ndarray, margins: np.ndarray) -> float:
    """Mean over ``margins`` of the share of selection samples whose gap shrink stays below it."""
    shrink = np.sort(gap_shrink(reference, candidate))
    m = np.asarray(margins, dtype=np.float64).reshape(-1)
    if not len(shrink) or not len(m):
        raise ValueError("predicted agreement needs at least one selection sample and one margin")
    return float(np.mean(np.searchsorted(shrink, m, side="left") / len(shrink)))
