"""The dense gate's per-channel check: a YOLO-style head that concatenates boxes in pixels with
class scores in 0-1 keeps a high global cosine when one int8 scale zeroes every score; the worst
channel's cosine catches it (edgekit.validate.metrics.compare)."""

from __future__ import annotations

import numpy as np
import pytest

from edgekit.bundle.manifest import Tolerance
from edgekit.validate.metrics import channel_axis, compare, worst_channel


def _yolov8_like(rng: np.random.Generator, anchors: int = 2100) -> np.ndarray:
    """[4, 84, anchors]: 4 box channels in pixels (0-320), 80 class probabilities (0-1)."""
    boxes = rng.uniform(0, 320, size=(4, 4, anchors))
    scores = rng.uniform(0, 1, size=(4, 80, anchors)) ** 4
    return np.concatenate([boxes, scores], axis=1).astype(np.float32)


def _per_tensor_int8(x: np.ndarray) -> np.ndarray:
    scale = float(np.abs(x).max()) / 127
    return (np.round(x / scale).clip(-128, 127) * scale).astype(np.float32)


def test_compare_fails_crushed_small_channels_when_global_cosine_passes() -> None:
    ref = _yolov8_like(np.random.default_rng(0))
    cand = _per_tensor_int8(ref)
    assert float(np.abs(cand[:, 4:]).max()) < 3.0  # scores became 0 or one 2.5-pixel step
    without = compare({"y": ref}, {"y": cand}, "dense", Tolerance(min_channel_cosine=None))
    assert without.passed and without.cosine is not None and without.cosine > 0.99  # the old hole
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert not got.passed
    assert got.channel_cosine is not None and got.channel_cosine < 0.9
    (failure,) = got.failures
    assert failure.startswith("output 'y' channel ")
    assert int(failure.split()[3]) >= 4  # a score channel, not a box channel
    assert "one quantization scale crushed the small ones" in failure and "--precision auto" in failure


def test_compare_passes_channels_when_each_keeps_its_own_scale() -> None:
    ref = _yolov8_like(np.random.default_rng(1))
    scale = np.abs(ref).max(axis=(0, 2), keepdims=True) / 127  # one scale per channel
    cand = (np.round(ref / scale) * scale).astype(np.float32)
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert got.passed, got.failures
    assert got.channel_cosine is not None and got.channel_cosine > 0.99


def test_channel_axis_is_the_last_for_a_yolov5_layout() -> None:
    assert channel_axis((1, 6300, 85)) == 2
    assert channel_axis((1, 84, 2100)) == 1
    assert channel_axis((1, 32, 40, 40)) == 1
    assert channel_axis((1, 1000)) is None
    ref = np.moveaxis(_yolov8_like(np.random.default_rng(2)), 1, 2)  # [4, anchors, 84]
    cand = ref.copy()
    cand[..., 50] = 0.0  # one class channel lost
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert got.cosine is not None and got.cosine > 0.99
    assert worst_channel(ref, cand) == (0.0, 50)
    assert any("channel 50 cosine 0.00" in f for f in got.failures)


def test_compare_skips_dead_channels() -> None:
    ref = _yolov8_like(np.random.default_rng(3))
    ref[:, 10] = 0.0  # never active in the reference
    ref[:, 11] = 1e-13  # numerically dead next to 0-320 pixels
    cand = ref.copy()
    cand[:, 10] = 0.5
    cand[:, 11] = -1e-13
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert got.passed, got.failures
    assert got.channel_cosine == pytest.approx(1.0)


def test_compare_accepts_a_constant_nonzero_channel() -> None:
    ref = _yolov8_like(np.random.default_rng(4))
    ref[:, 7] = 0.25
    cand = ref.copy()
    cand[:, 7] = 0.25 + np.random.default_rng(5).normal(0, 0.01, size=cand[:, 7].shape)
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert got.passed, got.failures


def test_compare_records_no_channel_cosine_below_rank_3() -> None:
    ref = np.random.default_rng(6).normal(size=(8, 16)).astype(np.float32)
    got = compare({"e": ref[:, :1]}, {"e": ref[:, :1]}, "dense", Tolerance())
    assert got.channel_cosine is None and got.passed


def test_compare_never_firing_channel_cannot_veto_when_every_live_channel_is_kept() -> None:
    rng = np.random.default_rng(7)
    ref = _yolov8_like(rng)
    ref[:, 20] = rng.uniform(0, 1e-3, size=ref[:, 20].shape)  # a class that never fires: ~1e-3 next to pixels
    cand = ref.copy()
    cand[:, 20] = rng.uniform(0, 1e-3, size=cand[:, 20].shape)  # rounding noise: uncorrelated, cosine ~0.75
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert got.passed, got.failures
    assert got.channel_cosine is not None and got.channel_cosine > 0.99


def test_compare_crushed_live_channel_still_fails_next_to_a_never_firing_one() -> None:
    rng = np.random.default_rng(8)
    ref = _yolov8_like(rng)
    ref[:, 20] = rng.uniform(0, 1e-3, size=ref[:, 20].shape)  # never fires
    ref[:, 30] = 0.0
    ref[:2, 30, :5] = 0.9  # a class that fires on a few anchors: 0.9 next to 320 pixels is live
    cand = ref.copy()
    cand[:, 30] = 0.0  # crushed to 0
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert not got.passed and got.channel_cosine == pytest.approx(0.0)
    assert any("channel 30 cosine 0.00" in f for f in got.failures)
