"""The gate's comparison works through the outputs a few samples at a time: its numbers are the
whole-array formulas', and what it allocates does not grow with the number of samples."""

from __future__ import annotations

import tracemalloc

import numpy as np

from edgekit.validate.metrics import SAMPLE_CHUNK, compare, tolerance_with, worst_channel


def _outputs(n: int, seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal((n, 4, 24, 24)).astype(np.float32)
    cand = (ref + 0.02 * rng.standard_normal(ref.shape)).astype(np.float32)
    cand[:, 3] *= 0.5  # one channel off: the worst channel is channel 3
    return {"mask": ref}, {"mask": cand}


def test_chunked_comparison_gives_the_whole_array_numbers() -> None:
    n = 2 * SAMPLE_CHUNK + 5  # a short last chunk
    ref, cand = _outputs(n)
    got = compare(ref, cand, "dense", tolerance_with(None))
    r = ref["mask"].astype(np.float64).reshape(n, -1)
    c = cand["mask"].astype(np.float64).reshape(n, -1)
    cosines = (r * c).sum(axis=1) / (np.linalg.norm(r, axis=1) * np.linalg.norm(c, axis=1))
    assert got.samples == n
    assert got.cosine is not None and abs(got.cosine - cosines.mean()) < 1e-12
    assert got.mean_abs_error is not None and abs(got.mean_abs_error - np.abs(r - c).mean()) < 1e-12
    assert got.max_abs_error is not None and abs(got.max_abs_error - np.abs(r - c).max()) < 1e-12
    expected_rel = np.abs(r - c).mean() / np.abs(r).mean()
    assert got.relative_error is not None and abs(got.relative_error - expected_rel) < 1e-12
    r4, c4 = ref["mask"].astype(np.float64), cand["mask"].astype(np.float64)
    per_channel = [
        float((r4[:, k] * c4[:, k]).sum() / (np.linalg.norm(r4[:, k]) * np.linalg.norm(c4[:, k]))) for k in range(4)
    ]
    found = worst_channel(ref["mask"], cand["mask"])
    assert found is not None and found[1] == int(np.argmin(per_channel))
    assert abs(found[0] - min(per_channel)) < 1e-12


def _peak_bytes(n: int) -> int:
    ref, cand = _outputs(n)
    tracemalloc.start()
    try:
        compare(ref, cand, "dense", tolerance_with(None))
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_comparison_memory_does_not_grow_with_the_samples() -> None:
    # numpy reports its allocations to tracemalloc: the whole outputs in float64 (with their
    # difference and products) grew ~7x the float32 outputs with the sample count
    small, large = _peak_bytes(2 * SAMPLE_CHUNK), _peak_bytes(16 * SAMPLE_CHUNK)
    one_output = 16 * SAMPLE_CHUNK * 4 * 24 * 24 * 4  # the large run's float32 output, held by the caller
    assert large < small + one_output // 4, (small, large)
