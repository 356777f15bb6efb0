"""The calibration subset, its hash and the selection samples; latency spread."""

from __future__ import annotations

import numpy as np

from edgekit.optimize.data import search_data, stratified_indices
from edgekit.validate.calib import arrays_sha256, even_batch
from edgekit.validate.latency import _stats


def test_stratified_subset_covers_every_class_of_a_skewed_set() -> None:
    classes = np.array([0] * 90 + [1] * 8 + [2] * 2)
    picked = stratified_indices(100, 12, classes)
    assert len(picked) == 12 and set(classes[picked]) == {0, 1, 2}
    assert (classes[picked] == 2).sum() == 2  # every sample of the rare class
    assert list(stratified_indices(5, 12, None)) == [0, 1, 2, 3, 4]


def test_search_data_holds_out_selection_samples_and_hashes_the_subset() -> None:
    x = np.arange(200 * 4, dtype=np.float32).reshape(200, 4)
    data = search_data({"x": x}, 64)
    assert data.calib["x"].shape == (64, 4) and data.selection["x"].shape == (136, 4)
    assert not set(map(tuple, data.calib["x"])) & set(map(tuple, data.selection["x"]))
    assert data.calib_sha256 == arrays_sha256({"x": data.calib["x"]}) and data.calib_total == 200
    big = search_data({"x": np.zeros((1000, 2), np.float32)}, 64)  # 936 left over: 512 of them
    assert big.selection["x"].shape == (512, 2) and big.selection_source.startswith("512 calibration samples")
    # 70 given, 64 asked: 6 left over are too few to select on: every sample given is
    small = search_data({"x": x[:70]}, 64)
    assert small.calib["x"].shape == (64, 4) and small.selection["x"].shape == (70, 4)
    assert "too few left over" in small.selection_source
    assert arrays_sha256({"x": x[:64]}) != arrays_sha256({"x": x[1:65]})


def test_latency_stats_p50_p90_and_interquartile_range() -> None:
    s = _stats([i / 1000 for i in range(1, 102)])  # 1..101 ms
    assert (s.p50_ms, s.p90_ms, s.iqr_ms, s.calls) == (51.0, 91.0, 50.0, 101)


def test_even_batch_splits_the_calibration_samples_into_equal_calls() -> None:
    assert [even_batch(n) for n in (64, 43, 48, 10, 1, 0)] == [16, 1, 16, 10, 1, 1]
    assert even_batch(40) == 10 and even_batch(100) == 10
