"""Graphs from Keras/TF exporters write ``auto_pad`` SAME_UPPER / SAME_LOWER, which onnx2torch (the
apple path's ONNX -> PyTorch step) does not implement; with static shapes the freeze step writes
the explicit pads they stand for (``compress.freeze.explicit_pads``)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgekit.compress.freeze import freeze_graph
from tests.factories import _save


def _same_padded(path: Path) -> Path:
    """x [N, 3, 15, 15] -> Conv 3x3 stride 2 SAME_UPPER -> Relu -> Conv 2x2 SAME_UPPER (odd total
    padding: one more at the end) -> MaxPool 2x2 stride 1 SAME_LOWER (one more at the start)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Conv", ["x", "w1"], ["c1"], strides=[2, 2], auto_pad="SAME_UPPER", name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2"], ["c2"], auto_pad="SAME_UPPER", name="conv2"),
        helper.make_node("MaxPool", ["c2"], ["y"], kernel_shape=[2, 2], auto_pad="SAME_LOWER", name="pool"),
    ]
    graph = helper.make_graph(
        nodes,
        "same_padded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, 15, 15])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [
            numpy_helper.from_array(rng.standard_normal((8, 3, 3, 3)).astype(np.float32), "w1"),
            numpy_helper.from_array(rng.standard_normal((4, 8, 2, 2)).astype(np.float32), "w2"),
        ],
    )
    return _save(graph, path, 13)


def test_freeze_writes_the_explicit_pads_auto_pad_stands_for(tmp_path: Path) -> None:
    import onnx

    model = _same_padded(tmp_path / "same.onnx")
    x = np.random.default_rng(1).standard_normal((1, 3, 15, 15)).astype(np.float32)
    frozen = freeze_graph(model, tmp_path / "frozen.onnx", {"x": (1, 3, 15, 15)}, check={"x": x}, pads=True)
    assert frozen.explicit_pads == 3 and frozen.min_cosine is not None and frozen.min_cosine > 0.99999
    pads = {
        n.name: list(next(a.ints for a in n.attribute if a.name == "pads"))
        for n in onnx.load(str(frozen.path)).graph.node
        if n.op_type in ("Conv", "MaxPool")
    }
    assert not any(a.name == "auto_pad" for n in onnx.load(str(frozen.path)).graph.node for a in n.attribute)
    # 15 -> 8 at stride 2, kernel 3: 2 in all, 1 each side; 8 -> 8, kernel 2: 1, at the end (UPPER) or start (LOWER)
    assert pads == {"conv1": [1, 1, 1, 1], "conv2": [0, 0, 1, 1], "pool": [1, 1, 0, 0]}
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(str(frozen.path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert any(s.kind == "rewrite_ops" and s.settings == {"auto_pad": "3"} for s in frozen.provenance())


def test_onnx2torch_converts_the_frozen_graph_it_refused_with_auto_pad(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from edgekit.compress.onnx_to_torch import onnx_to_torch

    model = _same_padded(tmp_path / "same.onnx")
    x = np.random.default_rng(2).standard_normal((1, 3, 15, 15)).astype(np.float32)
    plain = freeze_graph(model, tmp_path / "plain.onnx", {"x": (1, 3, 15, 15)})
    with pytest.raises(NotImplementedError, match="SAME_UPPER"):  # what the apple path ended with
        onnx_to_torch(plain.path)
    frozen = freeze_graph(model, tmp_path / "frozen.onnx", {"x": (1, 3, 15, 15)}, pads=True)
    module = onnx_to_torch(frozen.path)
    with torch.no_grad():
        got = module(torch.from_numpy(x)).numpy()
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
