"""The host's ONNX Runtime runner opens its session through the device runtime's own set-up."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.validate.ort_runner import ort_open
from tests.factories import sample_inputs, tiny_dense


def test_ort_open_runs_the_device_runtimes_session_at_the_asked_threads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import device_agents.runtimes.onnxruntime as device_ort

    model = tiny_dense(tmp_path / "dense.onnx")
    opened = []
    real = device_ort.open_session

    def recording(path: Path, options: device_ort.OnnxRuntimeOptions) -> object:
        session = real(path, options)
        opened.append((path, options, session.get_session_options().intra_op_num_threads))
        return session

    monkeypatch.setattr(device_ort, "open_session", recording)
    x = sample_inputs(2)
    outputs = ort_open(model)(1)({"image": x})
    assert [(p, o.threads, o.providers, n) for p, o, n in opened] == [(model, 1, (), 1)]
    direct = real(model, device_ort.OnnxRuntimeOptions()).run(None, {"image": x})
    np.testing.assert_allclose(outputs["mask"], direct[0], rtol=1e-5, atol=1e-6)


def test_a_float_layer_between_quantized_ones_runs_in_float(tmp_path: Path) -> None:
    """Mixed precision keeps a Conv in float between DequantizeLinear and QuantizeLinear; ONNX
    Runtime's WeightBiasQuantization would quantize its weights per tensor at load, rounding
    channels of small weights to zero. The device runtime's session runs it as built."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    scale = np.array([1e-3] * 4 + [1.0] * 4, np.float32)[:, None, None, None]  # four channels of small weights
    weight = (rng.standard_normal((8, 8, 1, 1)) * scale).astype(np.float32)
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"]),
        helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"]),
        helper.make_node("Conv", ["xd", "w"], ["y"]),  # float weights: the layer kept in float
        helper.make_node("QuantizeLinear", ["y", "s_out", "z"], ["yq"]),
        helper.make_node("DequantizeLinear", ["yq", "s_out", "z"], ["out"]),
    ]
    graph = helper.make_graph(
        nodes,
        "float_between_qdq",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, 4, 4])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, 8, 4, 4])],
        [
            numpy_helper.from_array(weight, "w"),
            numpy_helper.from_array(np.float32(0.02), "s"),
            numpy_helper.from_array(np.float32(1e-4), "s_out"),
            numpy_helper.from_array(np.uint8(128), "z"),
        ],
    )
    path = tmp_path / "mixed.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    x = rng.uniform(-1, 1, (1, 8, 4, 4)).astype(np.float32)
    plain = ort.SessionOptions()
    plain.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # each node as written
    (expected,) = ort.InferenceSession(str(path), plain, providers=["CPUExecutionProvider"]).run(None, {"x": x})
    got = ort_open(path)(1)({"x": x})["out"]
    np.testing.assert_allclose(got[0, :4], expected[0, :4], atol=1e-6)  # ORT's default: off by ~4e-3
