"""The validation building blocks: metrics and the gate, calibration data checks and hold-out,
interleaved timing, and ONNX Runtime's op placement report."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from edgekit.bundle.manifest import Signature, TensorSpec, Tolerance
from edgekit.errors import CalibrationDataError, ConfigError
from edgekit.validate.calib import check_arrays, iter_batches, load_arrays, split_holdout
from edgekit.validate.latency import p50_side_by_side
from edgekit.validate.metrics import compare, output_kind, parse_tolerance_args, run_all, tolerance_with
from edgekit.validate.placement import ort_op_placement
from tests.factories import sample_inputs


def _sig(*outputs: tuple) -> Signature:
    return Signature(
        inputs=(TensorSpec("x", "float32", ("batch", 3)),),
        outputs=tuple(TensorSpec(f"y{i}", "float32", shape) for i, shape in enumerate(outputs)),
    )


# -- metrics --------------------------------------------------------------------------------


def test_metrics_output_kind_from_the_first_output() -> None:
    assert output_kind(_sig(("batch", 10))) == "classifier"
    assert output_kind(_sig(("batch", "classes"))) == "classifier"
    assert output_kind(_sig(("batch", 1))) == "dense"
    assert output_kind(_sig(("batch", 4, 8, 8), ("batch", 10))) == "dense"


def test_metrics_classifier_agreement_and_accuracy_drop() -> None:
    ref = np.eye(4, dtype=np.float32)[[0, 1, 2, 3]]
    cand = np.eye(4, dtype=np.float32)[[0, 1, 2, 0]]
    labels = np.array([0, 1, 2, 3])
    c = compare({"p": ref}, {"p": cand}, "classifier", Tolerance(), labels)
    assert (c.top1_agreement, c.top1_accuracy, c.fp32_top1_accuracy) == (0.75, 0.75, 1.0)
    assert c.failures == (
        "top-1 agreement with fp32 0.75, needs >= 0.98 (off by 0.23)",
        "top-1 accuracy dropped 0.250 (from 1.000 to 0.750), over the allowed 0.010 by 0.240",
    )
    assert not c.passed
    relaxed = compare(
        {"p": ref}, {"p": cand}, "classifier", Tolerance(min_top1_agreement=0.7, max_top1_drop=None), labels
    )
    assert relaxed.passed and relaxed.summary() == (
        "top-1 agreement 0.750, accuracy 0.750 (fp32 1.000; drop +0.250, 95 % -0.281 to +0.699)"
    )


def test_metrics_dense_cosine_and_relative_error() -> None:
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((5, 4, 6)).astype(np.float32)
    c = compare({"m": ref}, {"m": ref * 2}, "dense", Tolerance())
    assert c.cosine == pytest.approx(1.0)
    assert c.relative_error == pytest.approx(1.0)  # mean|2r - r| / mean|r|
    assert c.failures == ("relative error to fp32 1, needs <= 0.2 (off by 0.8)",)
    flipped = compare({"m": ref}, {"m": -ref}, "dense", Tolerance(max_relative_error=None))
    assert flipped.cosine == pytest.approx(-1.0) and flipped.failures[0].startswith(
        "mean cosine to fp32 -1, needs >= 0.96"
    )


def test_metrics_dense_zero_rows_and_worst_output_count() -> None:
    zeros = np.zeros((2, 3), np.float32)
    good = np.ones((2, 3), np.float32)
    c = compare({"a": zeros, "b": good}, {"a": zeros, "b": good * [1, 1, -1]}, "dense", Tolerance())
    assert c.cosine == pytest.approx(1 / 3)  # the worse of the two outputs; all-zero rows agree fully
    assert c.max_abs_error == 2.0


def test_metrics_run_all_batches_and_concatenates() -> None:
    seen = []

    def fn(feed):
        seen.append(feed["x"].shape[0])
        return {"y": feed["x"] * 2}

    out = run_all(fn, {"x": np.arange(10.0).reshape(5, 2)}, batch=2)
    assert seen == [2, 2, 1]
    np.testing.assert_array_equal(out["y"], np.arange(10.0).reshape(5, 2) * 2)


def test_metrics_tolerance_overrides() -> None:
    t = tolerance_with(parse_tolerance_args(["min_cosine=0.9", "max_relative_error=none", "min_top1_agreement=1"]))
    assert (t.min_cosine, t.max_relative_error, t.min_top1_agreement, t.max_top1_drop) == (0.9, None, 1.0, 0.01)
    assert tolerance_with({"max_top1_drop": 0.02}).max_top1_drop == 0.02
    with pytest.raises(ConfigError, match=re.escape("tolerance.min_cosine: expected a number >= 0 or 'none', got -1")):
        tolerance_with({"min_cosine": -1})
    with pytest.raises(ConfigError, match=re.escape("tolerance.max_drop: unknown key (known: max_relative_error, ")):
        tolerance_with({"max_drop": 0.1})


# -- calibration data -----------------------------------------------------------------------


def test_calib_holdout_is_every_fifth_sample() -> None:
    x = np.arange(12.0)[:, None]
    labels = np.arange(12)
    calib, ev, ev_labels = split_holdout({"x": x}, labels)
    assert ev["x"][:, 0].tolist() == [4.0, 9.0] and ev_labels.tolist() == [4, 9]
    assert calib["x"].shape == (10, 1)
    _, small, _ = split_holdout({"x": x[:3]})
    assert small["x"][:, 0].tolist() == [2.0]


def test_calib_sample_counts_must_agree() -> None:
    sig = Signature(
        inputs=(TensorSpec("a", "float32", ("n", 2)), TensorSpec("b", "int64", ("n",))),
        outputs=(TensorSpec("y", "float32", ("n", 2)),),
    )
    with pytest.raises(CalibrationDataError, match=re.escape("inputs have different sample counts (a: 3, b: 2)")):
        check_arrays({"a": np.zeros((3, 2), np.float32), "b": np.zeros(2, np.int64)}, sig)
    out = check_arrays({"a": np.zeros((3, 2)), "b": np.zeros(3, np.int32)}, sig)
    assert (out["a"].dtype, out["b"].dtype) == (np.float32, np.int64)  # same-kind conversions only


def test_calib_npz_with_pickled_objects_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj.npz"
    np.savez(path, input=np.array([{"a": 1}], dtype=object))
    with pytest.raises(CalibrationDataError, match=r"is not a readable .npz file"):
        load_arrays(path)


def test_calib_npy_file_refused_saying_to_name_the_input(tmp_path: Path) -> None:
    path = tmp_path / "x.npy"
    np.save(path, np.zeros((4, 3), np.float32))
    with pytest.raises(CalibrationDataError, match=r"single array without an input name.*np\.savez"):
        load_arrays(path)


def test_metrics_run_all_pads_a_short_last_batch_for_a_static_batch() -> None:
    def fn(feed: dict) -> dict:
        if feed["x"].shape[0] != 2:
            raise ValueError("static batch of 2")
        return {"y": feed["x"] * 2}

    out = run_all(fn, {"x": np.arange(5.0)}, batch=2, pad=True)
    np.testing.assert_array_equal(out["y"], np.arange(5.0) * 2)


def test_calib_iter_batches_covers_every_sample() -> None:
    feeds = list(iter_batches({"x": np.arange(7)}, 3))
    assert [f["x"].tolist() for f in feeds] == [[0, 1, 2], [3, 4, 5], [6]]


# -- latency and placement ------------------------------------------------------------------


def test_latency_side_by_side_interleaves_blocks_in_shuffled_orders_that_vary_the_neighbours() -> None:
    def orders() -> list[str]:
        calls: list[str] = []
        fns = {n: (lambda n=n: calls.append(n)) for n in "abcd"}
        p50 = p50_side_by_side(fns, repeats=12, warmup=1, block=2, budget_s=60.0)
        assert set(p50) == {"a", "b", "c", "d"} and all(v >= 0 for v in p50.values())
        assert calls[:4] == list("abcd")  # warmup
        rounds = ["".join(calls[4 + i * 8 : 4 + (i + 1) * 8 : 2]) for i in range(12)]
        for r, got in enumerate(rounds):  # every function once per round, its calls in one block
            assert sorted(got) == list("abcd")
            assert calls[4 + r * 8 : 4 + (r + 1) * 8] == [c for c in got for _ in (0, 1)]
        return rounds

    rounds = orders()
    assert rounds == orders()  # a fixed seed: the same orders every run
    # what ran right before "a" changes from round to round (a rotation would keep it)
    before = {r[r.index("a") - 1] for r in rounds if r.index("a") > 0}
    assert len(before) >= 2 and len({r[0] for r in rounds}) >= 3


def test_latency_stops_at_budget_after_min_repeats() -> None:
    calls: list[str] = []
    p50_side_by_side({"a": lambda: calls.append("a")}, repeats=1000, warmup=0, budget_s=0.0, min_repeats=4, block=3)
    assert len(calls) == 4 * 3


def test_placement_comes_from_the_onnxruntime_profile(tiny_model: Path) -> None:
    placement = ort_op_placement(tiny_model, {"input": sample_inputs(1)})
    assert placement.tool.startswith("onnxruntime ") and placement.fallback == 0
    ops = {e.op for e in placement.entries}
    assert {"Gemm", "Softmax"} <= ops and all(e.device == "CPUExecutionProvider" for e in placement.entries)
    none_accelerated = ort_op_placement(
        tiny_model, {"input": sample_inputs(1)}, accelerated_on=("CUDAExecutionProvider",)
    )
    assert none_accelerated.accelerated == 0 and none_accelerated.fallback == len(none_accelerated.entries)


def test_latency_stats_give_p50_p90_and_iqr_of_the_calls() -> None:
    from edgekit.validate.latency import _stats

    stats = _stats([i / 1000.0 for i in range(1, 11)])  # 1..10 ms
    assert (stats.p50_ms, stats.p90_ms, stats.iqr_ms, stats.calls) == pytest.approx((5.5, 9.1, 4.5, 10))
