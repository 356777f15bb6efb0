"""A GELU written with Erf (BERT-class encoders): TFLite has no Erf builtin, so the float
conversion failed and coral shipped nothing, its float fallback included. Erf is rewritten in the
tanh form of GELU before onnx2tf (``compress.freeze.erf_as_tanh``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import edgekit
from edgekit.bundle.manifest import Manifest
from edgekit.compress.freeze import erf_as_tanh
from tests.factories import _save
from tests.targets.conftest import no_network


def _gelu_mlp(path: Path) -> Path:
    """x [N, 16] -> MatMul -> GELU (x * 0.5 * (1 + Erf(x / sqrt 2))) -> MatMul -> y [N, 8, 1]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "a"], ["h"], name="fc1"),
        helper.make_node("Div", ["h", "sqrt2"], ["z"], name="gelu_scale"),
        helper.make_node("Erf", ["z"], ["e"], name="gelu_erf"),
        helper.make_node("Add", ["e", "one"], ["e1"], name="gelu_add"),
        helper.make_node("Mul", ["h", "e1"], ["he"], name="gelu_mul"),
        helper.make_node("Mul", ["he", "half"], ["g"], name="gelu_half"),
        helper.make_node("MatMul", ["g", "b"], ["o"], name="fc2"),
        helper.make_node("Unsqueeze", ["o", "axes"], ["y"], name="as_map"),
    ]
    graph = helper.make_graph(
        nodes,
        "gelu_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 1])],
        [
            numpy_helper.from_array((rng.standard_normal((16, 32)) * 0.5).astype(np.float32), "a"),
            numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.3).astype(np.float32), "b"),
            numpy_helper.from_array(np.array(np.sqrt(2.0), np.float32), "sqrt2"),
            numpy_helper.from_array(np.array(1.0, np.float32), "one"),
            numpy_helper.from_array(np.array(0.5, np.float32), "half"),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "axes"),
        ],
    )
    return _save(graph, path, 13)


def test_erf_as_tanh_leaves_no_erf_and_stays_within_its_stated_error(tmp_path: Path) -> None:
    import onnx

    path = _gelu_mlp(tmp_path / "gelu.onnx")
    model = onnx.load(str(path))
    assert erf_as_tanh(model) == 1
    assert not any(n.op_type == "Erf" for n in model.graph.node)
    onnx.checker.check_model(model)
    rewritten = tmp_path / "tanh.onnx"
    onnx.save(model, str(rewritten))
    x = np.random.default_rng(1).standard_normal((64, 16)).astype(np.float32) * 3
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(rewritten), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    # |erf error| <= 3.6e-4, times 0.5 |h| per hidden unit, through fc2's weights
    assert np.abs(got - want).max() < 0.05 and np.abs(got - want).max() > 0  # changed, and only a little
    assert erf_as_tanh(model) == 0  # nothing left to rewrite


@pytest.mark.slow
def test_coral_auto_ships_a_gelu_model_that_tflite_has_no_erf_kernel_for(
    keypair: tuple[Path, Path], open_bundle: Callable[[Path], tuple[Path, Manifest]], tmp_path: Path
) -> None:
    model = _gelu_mlp(tmp_path / "gelu.onnx")
    x = np.random.default_rng(2).standard_normal((96, 16)).astype(np.float32)
    with no_network():
        result = edgekit.package(
            model, targets=["coral"], precision="auto", calib={"x": x}, key=keypair[0], out_dir=tmp_path,
            options={"coral": {"edgetpu": False}},
        )  # fmt: skip
    _, manifest = open_bundle(result.bundles["coral"])
    assert manifest.validation.passed
    rewrite = [s for s in manifest.provenance if s.kind == "rewrite_ops"]
    assert len(rewrite) == 1 and rewrite[0].settings == {"Erf": "1"}
