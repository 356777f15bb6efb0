"""Classifier selection predicts the gate's flips: a candidate that agrees on every easy selection
sample but shifts scores by more than the held-out inputs' FP32 margins fails selection (it
passed before, and then missed the 98 % held-out gate: MobileNetV3 INT8 on coral, jetson, cpu)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edgekit.bundle.manifest import Precision, Signature, TensorSpec, Tolerance
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, RunFn
from edgekit.optimize.choose import accuracy_key
from edgekit.optimize.data import search_data
from edgekit.optimize.engine import search
from edgekit.optimize.flip_risk import gap_shrink, predicted_agreement, top1_margins
from edgekit.optimize.search_state import SearchResult

CLASSES = 4
W = np.random.default_rng(3).standard_normal((8, CLASSES)).astype(np.float32) * 4.0
SERVED = Signature(
    inputs=(TensorSpec("x", "float32", ("n", 8)),), outputs=(TensorSpec("y", "float32", ("n", CLASSES)),)
)


def _fp32(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": feed["x"] @ W}


def _noisy(scale: float) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Scores plus a fixed pseudo-random perturbation per sample (deterministic, like int8 error)."""

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        x = feed["x"]
        noise = np.sin(x @ np.arange(1, 1 + 8 * CLASSES, dtype=np.float32).reshape(8, CLASSES) * 7.0)
        return {"y": x @ W + scale * noise}

    return run


def _candidate(name: str, precision: str, fn: RunFn, baseline: bool = False) -> Candidate:
    def build(space: BuildSpace) -> Built:
        (space.work_dir / "a.bin").write_bytes(b"x" * (100 if precision == "int8" else 400))
        return Built({"a.bin": "artifact"}, "python", Precision("fp32", "fp32", name), open=lambda threads: fn)

    return Candidate(name, precision, "python", build, {"recipe": name}, family=name, baseline=baseline)


def _confident(n: int, seed: int, lead: float) -> np.ndarray:
    """Inputs whose FP32 top-1 leads the runner-up by more than ``lead`` (easy samples)."""
    x = np.random.default_rng(seed).standard_normal((n * 20, 8)).astype(np.float32)
    keep = x[top1_margins(x @ W) > lead]
    return keep[:n]


def _close(n: int, seed: int, below: float) -> np.ndarray:
    x = np.random.default_rng(seed).standard_normal((n * 40, 8)).astype(np.float32)
    return x[top1_margins(x @ W) < below][:n]


def test_flip_risk_gap_shrink_and_prediction_on_known_scores() -> None:
    ref = np.array([[5.0, 1.0, 0.0], [0.0, 2.0, 1.5]])
    got = np.array([[4.0, 2.5, 0.0], [0.0, 2.0, 1.5]])
    np.testing.assert_allclose(top1_margins(ref), [4.0, 0.5])
    np.testing.assert_allclose(gap_shrink(ref, got), [2.5, 0.0])  # class 1 gained 2.5 on class 0
    # margins 0.1 (only the unshifted sample stays), 1.0 and 3.0 (both stay)
    assert predicted_agreement(ref, got, np.array([0.1, 1.0, 3.0])) == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    with pytest.raises(ValueError, match="at least 2 classes"):
        top1_margins(np.zeros((3, 1)))


def _search(tmp_path: Path, plan: CandidatePlan, margins: np.ndarray | None) -> SearchResult:
    calib = _confident(160, 1, lead=6.0)  # like training data: every decision far from the boundary
    data = search_data({"x": calib}, 64, (calib @ W).argmax(1))
    if margins is not None:
        data = dataclasses.replace(data, margins=margins, margins_source="the held-out inputs")
    return search(
        plan, target="test", work_dir=tmp_path / "c", data=data, served=SERVED, reference=_fp32,
        reference_open=lambda threads: _fp32, kind="classifier", tolerance=Tolerance(), precision="auto",
        latency_budget_s=0.5, progress=lambda _m: None,
    )  # fmt: skip


def test_search_fails_a_classifier_candidate_that_agrees_on_easy_samples_but_would_flip_close_ones(
    tmp_path: Path,
) -> None:
    held = _close(64, 2, below=3.0)
    held_margins = top1_margins(_fp32({"x": held})["y"])
    noisy = _noisy(1.5)
    # what the gate then sees: the noisy candidate flips held-out samples, the FP32 one does not
    held_agreement = np.mean(noisy({"x": held})["y"].argmax(1) == _fp32({"x": held})["y"].argmax(1))
    assert held_agreement < 0.98
    plan = CandidatePlan(first=(_candidate("fp32", "fp32", _fp32, baseline=True), _candidate("int8", "int8", noisy)))
    result = _search(tmp_path, plan, held_margins)
    by_name = {o.name: o for o in result.outcomes}
    int8 = by_name["int8"]
    assert int8.comparison is not None and int8.comparison.top1_agreement == 1.0  # saturated on easy samples
    assert int8.status == "failed" and int8.reason.startswith("predicted top-1 agreement")
    assert "the held-out inputs" in int8.reason
    assert int8.comparison.predicted_top1_agreement is not None and int8.comparison.predicted_top1_agreement < 0.98
    assert accuracy_key(int8)[0] == int8.comparison.predicted_top1_agreement
    assert result.chosen.name == "fp32"
    fp32 = by_name["fp32"]
    assert fp32.comparison is not None and fp32.comparison.predicted_top1_agreement == 1.0


def test_search_predicts_on_the_selection_samples_own_margins_without_held_out_ones(tmp_path: Path) -> None:
    plan = CandidatePlan(
        first=(_candidate("fp32", "fp32", _fp32, baseline=True), _candidate("int8", "int8", _noisy(1.5)))
    )
    result = _search(tmp_path, plan, None)
    int8 = next(o for o in result.outcomes if o.name == "int8")
    # easy selection samples, judged on their own (large) margins: the prediction passes the candidate
    assert int8.comparison is not None and int8.comparison.predicted_top1_agreement == pytest.approx(1.0)
    assert int8.status in ("passed", "chosen")
