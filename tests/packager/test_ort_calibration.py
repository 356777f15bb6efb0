"""ORT calibration in chunks (edgekit.compress.ort_quant): ORT's calibrators hold every tensor of
every sample of one collect_data call; edgekit feeds at most CALIB_CHUNK_SAMPLES per call and the
ranges come out the same as one call over everything (MinMax reduces exactly)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.compress.ort_quant import CALIB_CHUNK_SAMPLES, chunk_batches, collect_in_chunks
from tests.factories import sample_inputs, tiny_classifier


def test_chunk_batches_divides_the_batches_within_the_sample_bound() -> None:
    assert chunk_batches(128, 1) == 16 and chunk_batches(64, 4) == 4 and chunk_batches(120, 1) == 15
    assert chunk_batches(7, 1) == 7 and chunk_batches(17, 1) == 1 and chunk_batches(3, 32) == 1
    # a calibrator bounded to one sample per call (NNCF's layer ranking): one batch per call
    assert chunk_batches(128, 1, samples=1) == 1 and chunk_batches(64, 4, samples=1) == 1


def test_calibration_in_chunks_gives_the_one_call_minmax_ranges_holding_a_chunk_at_a_time(tmp_path: Path) -> None:
    from onnxruntime.quantization import CalibrationMethod, create_calibrator

    from edgekit.compress.ort_quant import ArrayCalibrationReader

    model = tiny_classifier(tmp_path / "m.onnx")
    calib = {"input": sample_inputs(48, seed=4)}

    def calibrator(name: str) -> object:
        return create_calibrator(
            model, None, augmented_model_path=str(tmp_path / f"aug-{name}.onnx"),
            calibrate_method=CalibrationMethod.MinMax, providers=["CPUExecutionProvider"],
        )  # fmt: skip

    whole = calibrator("whole")
    whole.collect_data(ArrayCalibrationReader(calib, 1))  # type: ignore[attr-defined]  # an ORT calibrator
    chunked = calibrator("chunked")
    held: list[int] = []
    collect = chunked.collect_data  # type: ignore[attr-defined]  # an ORT calibrator

    def counting(reader: ArrayCalibrationReader) -> None:  # how many samples one call reads
        read = reader.get_next
        count = 0

        def get_next() -> dict[str, np.ndarray] | None:
            nonlocal count
            feed = read()
            count += feed is not None
            return feed

        reader.get_next = get_next  # type: ignore[method-assign]  # counting wrapper
        collect(reader)
        held.append(count)

    chunked.collect_data = counting  # type: ignore[attr-defined]
    collect_in_chunks(chunked, calib, 1)
    assert held == [CALIB_CHUNK_SAMPLES] * 3  # 48 samples, 16 per call (each call reduces and clears)
    a, b = whole.compute_data(), chunked.compute_data()  # type: ignore[attr-defined]
    assert set(a.keys()) == set(b.keys()) and len(a.keys()) > 3
    for name in a.keys():
        np.testing.assert_array_equal(np.asarray(a[name].range_value), np.asarray(b[name].range_value))
