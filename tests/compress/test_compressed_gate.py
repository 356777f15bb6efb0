"""The gate of a compressed classifier (``edgekit.validate.metrics.compressed_gate``): with held-out
labels it is judged by its top-1 accuracy against the original's, its agreement with the original
reported but not gated; without labels, by agreement. Checked on ``measure`` (the gate of
``edgekit compress``), on ``edgekit package --reference`` and on the paired interval of the drop.

The models are linear classifiers built in code over four features ``(a, b, c, d)``: the original
scores ``(a, b)``; the "compressed" ones add ``c`` (and the bad one ``c + d``) to the first score.
The data (numpy-made) put ``c`` only on samples the original is unsure of (``a - b = 0.05``), where
the compressed model disagrees with it on 10 of 200 samples (agreement 0.95) and is right on 6 of
them, wrong on 4: 0.96 accurate against the original's 0.95. ``d`` flips 6 samples the original
is sure of and right on: the bad model is 0.93 accurate, a drop of 0.02."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from edgekit.bundle.manifest import Tolerance  # noqa: E402
from edgekit.validate.metrics import (  # noqa: E402
    compare,
    compressed_gate,
    paired_difference_interval,
    paired_drop_interval,
)

ORIGINAL = [[1, 0], [0, 1], [0, 0], [0, 0]]
AS_ACCURATE = [[1, 0], [0, 1], [1, 0], [0, 0]]  # disagrees where the original is unsure, right more often
WORSE = [[1, 0], [0, 1], [1, 0], [1, 0]]  # also flips 6 samples the original is sure of


def _linear(path: Path, weights: list[list[int]]) -> Path:
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.asarray(weights, dtype=np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"]), helper.make_node("Softmax", ["logits"], ["probs"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 2])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="edgekit-tests")
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _data() -> tuple[np.ndarray, np.ndarray]:
    """200 samples (a, b, c, d) and their labels (see the module docstring)."""
    rng = np.random.default_rng(0)
    rows: list[tuple[float, float, float, float, int]] = []
    for label in (0, 1):  # 180 the original is sure of and right on
        for i in range(90):
            a, b = (2.0, 0.0) if label == 0 else (0.0, 2.0)
            d = -3.0 if label == 0 and i < 6 else 0.0
            rows.append((a, b, 0.0, d, label))
    unsure = [(0, 0.0)] * 6 + [(0, -0.2)] * 4 + [(1, 0.0)] * 4 + [(1, -0.2)] * 6  # (label, c)
    rows += [(0.05, 0.0, c, 0.0, label) for label, c in unsure]  # the original says 0 at confidence 0.51
    table = np.asarray(rows, dtype=np.float64)
    x = table[:, :4].astype(np.float32)
    x[:, :2] += rng.normal(0, 0.002, (len(x), 2)).astype(np.float32)
    order = rng.permutation(len(x))
    return x[order], table[order, 4].astype(np.int64)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("linear")
    return {
        name: _linear(folder / f"{name}.onnx", w)
        for name, w in (("original", ORIGINAL), ("as_accurate", AS_ACCURATE), ("worse", WORSE))
    }


def test_measure_judges_a_compressed_classifier_by_accuracy_with_labels_and_by_agreement_without(
    models: dict[str, Path],
) -> None:
    from edgekit.compress.steps import measure

    x, labels = _data()
    data = {"x": x}
    kept, _, _ = measure(models["original"], models["as_accurate"], data, labels)
    assert (kept.top1_agreement, kept.top1_accuracy, kept.fp32_top1_accuracy) == (0.95, 0.96, 0.95)
    assert kept.passed, kept.failures
    assert kept.tolerance.min_top1_agreement is None  # reported, not gated
    assert kept.discordant == (4, 6)  # only the original right on 4, only the compressed one on 6
    assert "drop -0.010, 95 %" in kept.summary()

    unlabelled, _, _ = measure(models["original"], models["as_accurate"], data, None)
    assert unlabelled.failures == ("top-1 agreement with fp32 0.95, needs >= 0.98 (off by 0.03)",)

    worse, _, _ = measure(models["original"], models["worse"], data, labels)
    assert worse.top1_accuracy == 0.93
    assert worse.failures == ("top-1 accuracy dropped 0.020 (from 0.950 to 0.930), over the allowed 0.010 by 0.010",)
    # the user's own agreement floor is respected
    asked, _, _ = measure(models["original"], models["as_accurate"], data, labels, Tolerance(), agreement_given=True)
    assert not asked.passed and asked.tolerance.min_top1_agreement == 0.98


def test_package_reference_gates_a_compressed_classifier_by_accuracy_with_labels(
    tmp_path: Path, models: dict[str, Path], keypair: tuple[Path, Path]
) -> None:
    from edgekit.packaging.result import PackageValidationError
    from tests.factories import package_small_data as package

    x, labels = _data()
    np.savez(tmp_path / "eval.npz", x=x)
    np.save(tmp_path / "labels.npy", labels)
    said: list[str] = []

    def run(model: str, out: str, **kwargs: object) -> object:
        return package(
            models[model], reference=models["original"], targets=["cpu"], precision="fp32",
            calib=tmp_path / "eval.npz", eval=tmp_path / "eval.npz", key=keypair[0], out_dir=tmp_path / out,
            progress=said.append, **kwargs,
        )  # fmt: skip

    result = run("as_accurate", "a", labels=tmp_path / "labels.npy")
    validation = result.manifests["cpu"].validation  # type: ignore[attr-defined]
    assert validation.passed and validation.top1_agreement == 0.95 and validation.top1_accuracy == 0.96
    assert validation.tolerance.min_top1_agreement is None
    line = (
        "compressed classifier with labels: judged by top-1 accuracy against the original's (drop <= 0.010); "
        "agreement with the original reported, not gated"
    )
    assert line in said and line in validation.notes
    assert any(n.startswith("top-1 accuracy 0.960 vs the original's 0.950") for n in validation.notes)

    with pytest.raises(PackageValidationError, match=re.escape("top-1 agreement with fp32 0.95, needs >= 0.98")):
        run("as_accurate", "b")  # no labels: agreement gates
    with pytest.raises(PackageValidationError, match=re.escape("top-1 accuracy dropped 0.020")):
        run("worse", "c", labels=tmp_path / "labels.npy")
    with pytest.raises(PackageValidationError, match=re.escape("top-1 agreement with fp32 0.95, needs >= 0.98")):
        run("as_accurate", "d", labels=tmp_path / "labels.npy", tolerance={"min_top1_agreement": 0.98})
    # --max-drop 0.03 lets the worse one through, by accuracy
    assert run("worse", "e", labels=tmp_path / "labels.npy", max_drop=0.03).passed  # type: ignore[attr-defined]


def test_compressed_gate_keeps_agreement_without_labels_and_for_dense_outputs() -> None:
    t = Tolerance()
    assert compressed_gate(t, "classifier", True, False)[0].min_top1_agreement is None
    unlabelled, line = compressed_gate(t, "classifier", False, False)
    assert unlabelled == t and line.startswith("compressed classifier without labels: judged by top-1 agreement")
    assert compressed_gate(Tolerance(max_top1_drop=None), "classifier", True, False)[0] == Tolerance(max_top1_drop=None)
    assert compressed_gate(t, "dense", True, False) == (t, "")


def test_paired_interval_matches_the_published_newcombe_interval() -> None:
    # Fagerland, Lydersen & Laake, Statistical Analysis of Contingency Tables (2017), ch. 8: the
    # paired table [[59, 6], [16, 80]], difference -0.0621, Newcombe square-and-add -0.1186 to -0.0046
    low, high = paired_difference_interval(59, 6, 16, 80)
    assert (round(low, 4), round(high, 4)) == (-0.1186, -0.0046)
    # no discordant sample: an interval around 0 that narrows with more samples, never a point
    small, large = paired_difference_interval(40, 0, 0, 10), paired_difference_interval(400, 0, 0, 100)
    assert small[0] < large[0] < 0 < large[1] < small[1] and small[0] == pytest.approx(-small[1])


def test_paired_drop_interval_counts_the_discordant_samples_and_compare_reports_it() -> None:
    ref_right = np.array([True] * 90 + [True] * 4 + [False] * 6)
    cand_right = np.array([True] * 90 + [False] * 4 + [True] * 6)
    assert paired_drop_interval(ref_right, cand_right) == paired_difference_interval(90, 4, 6, 0)
    labels = np.zeros(100, dtype=np.int64)
    ref = np.eye(2, dtype=np.float32)[np.where(ref_right, 0, 1)]
    cand = np.eye(2, dtype=np.float32)[np.where(cand_right, 0, 1)]
    c = compare({"p": ref}, {"p": cand}, "classifier", Tolerance(), labels)
    assert c.discordant == (4, 6) and c.top1_drop_interval == paired_difference_interval(90, 4, 6, 0)
    assert c.top1_drop_interval[0] < -0.02 < 0 < c.top1_drop_interval[1]  # a 2-sample gain is within the noise
