"""The fallback chain: the final gate runs down the passing candidates in the objective's order,
the target's float candidate last; a candidate that passed selection within its sampling error
ranks behind the ones clear of it (``edgekit.optimize.margin``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekit.bundle.manifest import Tolerance
from edgekit.optimize.candidates import CandidatePlan
from edgekit.optimize.data import search_data
from edgekit.optimize.engine import search
from edgekit.optimize.margin import selection_margin, wilson_lower
from edgekit.packaging.result import PackageValidationError
from edgekit.validate.metrics import compare
from tests.factories import package_small_data as package
from tests.factories import tiny_dense
from tests.optimize.test_search import SERVED, _exact, _untimed


def _shifted_eval(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Calibration inputs N(0, 1), and held-out inputs whose first channel is 30x larger: INT8
    ranges calibrated on the first clip the second, float does not care."""
    rng = np.random.default_rng(seed)
    calib = rng.standard_normal((64, 3, 16, 16)).astype(np.float32)
    held = rng.standard_normal((16, 3, 16, 16)).astype(np.float32)
    held[:, 0] *= 30.0
    return calib, held


def test_package_ships_the_next_candidate_when_the_chosen_one_fails_the_final_gate(keypair, tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "dense.onnx")
    calib, held = _shifted_eval()
    result = package(
        model,
        targets=["jetson"],
        precision="auto",
        calib={"image": calib},
        eval={"image": held},
        key=keypair[0],
        out_dir=tmp_path / "o",
    )
    m = result.manifests["jetson"]
    assert result.passed and m.validation.passed and m.precision.weights == "fp16"
    md = result.reports["jetson"]
    report = json.loads(md.with_name(md.name.replace(".md", ".json")).read_text())
    rows = {c["name"]: c for c in report["candidates"]}
    # the int8 candidates met the budget on selection (ranked ahead by the device order), then
    # missed it on the held-out samples, each in turn
    gate_failed = [n for n, c in rows.items() if c["reason"].startswith("failed the final gate: ")]
    assert gate_failed and all("int8" in n for n in gate_failed)
    assert report["chosen"] == "tensorrt fp16" and rows["tensorrt fp16"]["status"] == "chosen"
    assert "failed the final gate on the held-out samples" in report["why"]
    assert any(n.startswith(f"final gate: {gate_failed[-1]} failed") for n in report["notes"])


def test_package_fails_a_target_only_when_its_float_candidate_fails_and_says_so(keypair, tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "dense.onnx")
    calib, held = _shifted_eval()
    with pytest.raises(PackageValidationError) as info:  # a cosine above 1: nothing can pass
        package(
            model, targets=["jetson"], precision="auto", calib={"image": calib}, eval={"image": held}, key=keypair[0],
            out_dir=tmp_path / "o", tolerance={"min_cosine": 1.5},
        )  # fmt: skip
    message = str(info.value)
    # the most accurate on selection is the target's fp32 itself: nothing left to fall back to
    assert "; fallback chain: tensorrt fp32, the target's float candidate, failed the final gate" in message
    assert info.value.result.bundles == {}


def _wobbly(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """2x, turned away from it on the samples whose first value is negative: cosine 0.93 there,
    1.0 elsewhere (mean about 0.965: over a 0.96 gate by less than its sampling error)."""
    x = feed["x"].astype(np.float64)
    ref = 2.0 * x
    side = np.roll(x, 1, axis=1)
    side -= (np.sum(side * x, axis=1, keepdims=True) / np.sum(x * x, axis=1, keepdims=True)) * x  # orthogonal to x
    side *= np.linalg.norm(ref, axis=1, keepdims=True) / np.linalg.norm(side, axis=1, keepdims=True)
    c = np.where(x[:, :1] < 0, 0.93, 1.0)
    return {"y": (c * ref + np.sqrt(1 - c * c) * side).astype(np.float32)[..., None]}


GATE = Tolerance(min_cosine=0.96, max_relative_error=None, min_channel_cosine=None)


def test_search_ranks_a_candidate_within_its_sampling_error_behind_one_clear_of_it(tmp_path: Path) -> None:
    plan = CandidatePlan(first=(_untimed("int8 close", "int8", _wobbly, 0), _untimed("int8 clear", "int8", _exact, 1)))
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    result = search(
        plan, target="test", work_dir=tmp_path / "c", data=data, served=SERVED, reference=_exact,
        reference_open=lambda threads: _exact, kind="dense", tolerance=GATE, precision="int8",
        latency_budget_s=1.0, progress=lambda _m: None,
    )  # fmt: skip
    by_name = {o.name: o for o in result.outcomes}
    close = by_name["int8 close"]
    assert close.comparison is not None and close.comparison.passed  # it does pass selection
    assert close.marginal.startswith("within the sampling error of the gate on 40 selection samples: ")
    assert "95 % lower bound" in close.marginal and by_name["int8 clear"].marginal == ""
    # the device order alone ships "int8 close" (rank 0); clear of the sampling error wins
    assert result.chosen.name == "int8 clear" and result.chain == ("int8 close",)
    assert "int8 close (expected fastest on the device within the budget) ranks behind it" in result.why


def test_selection_margin_wilson_bound_for_top1_and_none_for_a_clear_pass() -> None:
    assert wilson_lower(128, 128) == pytest.approx(0.9709, abs=1e-4)  # 128 / (128 + 1.96^2)
    assert wilson_lower(45, 50) == pytest.approx(0.7864, abs=1e-3)
    assert wilson_lower(0, 0) == 0.0
    rng = np.random.default_rng(0)
    ref = rng.standard_normal((60, 5)).astype(np.float32)
    top = ref.argmax(1)
    cand = ref.copy()
    cand[:1, :] = -cand[:1, :]  # one flipped decision of 60: 0.983 agreement
    got = compare({"p": ref}, {"p": cand}, "classifier", Tolerance(min_top1_agreement=0.9))
    assert got.passed and got.top1_agreement == pytest.approx(59 / 60) and (cand.argmax(1) != top).sum() == 1
    assert selection_margin({"p": ref}, {"p": cand}, got) == ""  # Wilson lower bound 0.911 > 0.9: clear
    strict = compare({"p": ref}, {"p": cand}, "classifier", Tolerance(min_top1_agreement=0.95))
    assert selection_margin({"p": ref}, {"p": cand}, strict).startswith("top-1 agreement 0.9833 on 60 samples")
    exact = compare({"p": ref}, {"p": ref}, "classifier", Tolerance(min_top1_agreement=0.99))
    assert selection_margin({"p": ref}, {"p": ref}, exact) == ""  # no disagreement: nothing to rank it behind
    dense = compare({"y": ref[..., None]}, {"y": ref[..., None]}, "dense", Tolerance())
    assert selection_margin({"y": ref[..., None]}, {"y": ref[..., None]}, dense) == ""


def test_selection_margin_bounds_the_detections_f1_by_its_sampling_error() -> None:
    import dataclasses

    ref = np.zeros((32, 4, 8), np.float32)
    base = compare({"y": ref}, {"y": ref}, "dense", Tolerance())
    assert base.passed

    def judged(counts: list[tuple[int, int, int]]) -> str:
        n = len(counts)
        cmp = dataclasses.replace(base, samples=n, detection_counts=(("y", tuple(counts)),))
        return selection_margin({"y": np.zeros((n, 4, 8), np.float32)}, {"y": np.zeros((n, 4, 8), np.float32)}, cmp)

    # two detections per sample, one of 32 moved off its match: F1 0.969 passes 0.95, by less than its
    # sampling error on 16 samples
    few = [(2, 2, 2)] * 15 + [(1, 2, 2)]
    why = judged(few)
    assert "detections F1 on 32 fp32 detections (31 matched): 95 % bootstrap lower bound" in why and "< 0.95" in why
    # the same rate on 640 samples is clear of it; every detection kept is clear on 16
    assert judged(few * 40) == ""
    assert judged([(2, 2, 2)] * 16) == ""
