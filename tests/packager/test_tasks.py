"""The right gate for the output: each output is classified (classify, regress, embed, detect,
segment) from its shape and FP32 values unless ``--task`` says so, regression outputs are judged
by their error and not by top-1, and the validation notes name the gate used."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.bundle.manifest import Signature, TensorSpec, Tolerance
from edgekit.errors import ConfigError
from edgekit.packaging.result import PackageValidationError
from edgekit.validate.metrics import compare, kind_of, output_tasks, parse_tasks
from tests.factories import _save
from tests.factories import package_small_data as package


def _signature(*shapes: tuple[object, ...]) -> Signature:
    outputs = tuple(TensorSpec(f"o{i}", "float32", s) for i, s in enumerate(shapes))  # type: ignore[arg-type]
    return Signature(inputs=(TensorSpec("x", "float32", ("n", 8)),), outputs=outputs)


def test_output_tasks_from_shapes_and_values() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((20, 10))
    probs = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    unit = rng.standard_normal((20, 16))
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)
    values = {
        "o0": probs,  # probabilities: classify
        "o1": 3.5 + rng.standard_normal((20, 3)),  # three unbounded scores: regress
        "o2": unit,  # unit rows: embed
        "o3": rng.standard_normal((20, 1)),  # one value: regress
        "o4": rng.standard_normal((20, 84, 100)),  # per anchor: detect
        "o5": rng.standard_normal((20, 2, 8, 8)),  # maps: segment
        "o6": rng.standard_normal((20, 10)),  # ten unbounded scores: classify
    }
    served = _signature(*(("n", *v.shape[1:]) for v in values.values()))
    tasks, notes = output_tasks(served, values)
    assert tasks == {
        "o0": "classify", "o1": "regress", "o2": "embed", "o3": "regress", "o4": "detect", "o5": "segment",
        "o6": "classify",
    }  # fmt: skip
    assert notes[0] == (
        "gate: output 'o0' judged as classify (top-1 agreement with fp32); its rows are probabilities "
        "(in [0, 1], summing to 1)"
    )
    assert notes[1].startswith("gate: output 'o1' judged as regress (its relative error to fp32); 3 values per sample")
    given, given_notes = output_tasks(served, values, {"o1": "embed"})
    assert given["o1"] == "embed" and given_notes[1].endswith("; given by --task")
    assert kind_of(tasks, served) == "classifier" and kind_of({"o0": "regress"}, served) == "dense"


def test_a_transformers_hidden_states_are_a_vector_per_token_not_anchors() -> None:
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((4, 64, 384))
    token_ids = TensorSpec("input_ids", "int64", ("batch", "sequence"))
    outputs = (TensorSpec("last_hidden_state", "float32", ("batch", "sequence", 384)),)
    served = Signature(
        inputs=(token_ids, TensorSpec("attention_mask", "int64", ("batch", "sequence"))), outputs=outputs
    )
    tasks, notes = output_tasks(served, {"last_hidden_state": hidden})
    assert tasks == {"last_hidden_state": "embed"}
    assert "a vector per token" in notes[0] and "input 'input_ids''s sequence axis" in notes[0]
    fixed = Signature(inputs=(TensorSpec("ids", "int32", (1, 64)),), outputs=(TensorSpec("h", "float32", (1, 64, 8)),))
    assert output_tasks(fixed, {"h": hidden[:1, :, :8]})[0] == {"h": "embed"}
    # a float image in, anchors out: still a detector's output
    image = Signature(
        inputs=(TensorSpec("x", "float32", ("n", 3, 64, 64)),), outputs=(TensorSpec("y", "float32", ("n", 84, 64)),)
    )
    assert output_tasks(image, {"y": rng.standard_normal((2, 84, 64))})[0] == {"y": "detect"}


def test_parse_tasks_one_for_every_output_or_per_output_and_refuses_unknowns() -> None:
    assert parse_tasks("regress", ["a", "b"]) == {"a": "regress", "b": "regress"}
    assert parse_tasks("a=detect,b=embed", ["a", "b"]) == {"a": "detect", "b": "embed"}
    assert parse_tasks(None, ["a"]) == {}
    with pytest.raises(ConfigError, match=r"--task a=guess: choose one of classify, regress, embed, detect, segment"):
        parse_tasks("a=guess", ["a"])
    with pytest.raises(
        ConfigError, match=r"the model has no output 'scroes' \(outputs: scores\); did you mean 'scores'"
    ):
        parse_tasks("scroes=regress", ["scores"])


def test_compare_judges_a_regression_output_by_its_error_not_top1() -> None:
    rng = np.random.default_rng(1)
    ref = 3.5 + 1e-3 * rng.standard_normal((50, 3))
    cand = ref + 1e-3 * rng.standard_normal((50, 3))  # 0.03 % off, and the top-1 of three close scores flips
    as_classifier = compare({"s": ref}, {"s": cand}, "classifier", Tolerance())
    assert not as_classifier.passed and as_classifier.top1_agreement is not None
    assert as_classifier.top1_agreement < 0.9
    judged = compare({"s": ref}, {"s": cand}, "dense", Tolerance(), tasks={"s": "regress"})
    assert judged.passed, judged.failures
    worse = compare({"s": ref}, {"s": ref * 1.5}, "dense", Tolerance(), tasks={"s": "regress"})
    (failure,) = worse.failures
    assert failure.startswith("output 's' (regression) relative error to fp32 0.5, needs <= 0.2")


def _quality_scores(path: Path) -> Path:
    """x [N, 8] -> MatMul -> + bias -> scores [N, 3]: a score far below the others (about -300) and
    two close to each other (3.5, 0.003 apart), as a quality net's outputs. One int8 scale for the
    tensor (steps of about 2) rounds the two close scores to one level: their order is lost, their
    values are not (0.5 % relative error)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    w = (rng.standard_normal((8, 3)) * 1e-3).astype(np.float32)
    w[:, 0] *= 2e4
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w"], ["h"], name="fc"),
            helper.make_node("Add", ["h", "b"], ["scores"], name="bias"),
        ],
        "quality",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 3])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.array([-300, 3.5, 3.5], np.float32), "b")],
    )
    return _save(graph, path, 13)


def test_package_judges_regression_scores_by_their_error_and_says_so(keypair, tmp_path: Path) -> None:
    model = _quality_scores(tmp_path / "quality.onnx")
    x = np.random.default_rng(3).standard_normal((60, 8)).astype(np.float32)
    result = package(
        model, targets=["cpu"], precision="int8", calib={"x": x}, key=keypair[0], name="q", out_dir=tmp_path
    )
    v = result.manifests["cpu"].validation
    assert v.passed and v.kind == "dense" and v.top1_agreement is None
    assert v.relative_error is not None and v.relative_error < 0.05
    assert any(
        n.startswith("gate: output 'scores' judged as regress (its relative error to fp32); 3 values per sample")
        for n in v.notes
    )
    # the same model judged as a classifier (what the shape alone said): int8 loses the close scores' order
    with pytest.raises(PackageValidationError, match=r"top-1 agreement with fp32 0\.\d+, needs >= 0\.98"):
        package(
            model,
            targets=["cpu"],
            precision="int8",
            calib={"x": x},
            key=keypair[0],
            name="c",
            out_dir=tmp_path,
            task="classify",
        )


def test_a_vector_per_token_is_judged_per_hidden_unit_not_per_token_position() -> None:
    rng = np.random.default_rng(2)
    ref = rng.standard_normal((64, 32, 64)).astype(np.float32)  # [N, T, H], H > T
    cand = ref.copy()
    cand[:, -1, :] = rng.standard_normal((64, 64))  # the last (padding) position differs everywhere
    per_token = compare({"h": ref}, {"h": cand}, "dense", Tolerance(), tasks={"h": "embed"})
    assert per_token.passed, per_token.failures  # every hidden unit keeps 31 of its 32 positions
    assert per_token.channel_axes == (("h", 2),)  # what the selection margin's bootstrap takes too
    from edgekit.optimize.margin import selection_margin

    assert "worst live channel" not in selection_margin({"h": ref}, {"h": cand}, per_token)
    as_anchors = compare({"h": ref}, {"h": cand}, "dense", Tolerance(), tasks={"h": "detect"})
    assert any("channel 31 cosine" in f for f in as_anchors.failures)  # position 31 taken for a channel
