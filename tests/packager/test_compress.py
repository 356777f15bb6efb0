"""Model preparation (opset upgrade, shapes, served signature) and the ORT quantization helpers."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.compress.onnx_prep import parse_input_shape, prepare_model, resolve_static_shapes
from edgekit.compress.ort_quant import ArrayCalibrationReader, gemm_to_matmul
from edgekit.errors import ConfigError
from tests.factories import sample_inputs, tiny_classifier


def _run(model_or_path, feed):
    data = model_or_path.SerializeToString() if isinstance(model_or_path, onnx.ModelProto) else str(model_or_path)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)


def test_prepare_upgrades_opset_11_and_keeps_the_served_signature(tmp_path: Path) -> None:
    src = tiny_classifier(tmp_path / "o11.onnx", opset=11, dynamic_size=True)
    prepared = prepare_model(src, tmp_path / "work")
    assert prepared.source.opset == 11 and prepared.opset == 13
    assert prepared.steps[0] == "opset 11->13"
    assert prepared.served.inputs[0].shape == ("batch", 3, "height", "width")
    assert prepared.served.inputs[0].layout == "NCHW"
    assert prepared.served.outputs[0].shape == ("batch", 10)
    x = sample_inputs(2, size=12)
    np.testing.assert_allclose(_run(prepared.path, {"input": x})[0], _run(src, {"input": x})[0], rtol=1e-5, atol=1e-6)


def test_prepare_names_unnamed_dynamic_dims(tmp_path: Path) -> None:
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, "features"])],
    )
    path = tmp_path / "m.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    prepared = prepare_model(path, tmp_path / "w")
    assert prepared.served.inputs[0].shape == ("x_dim0", 4)
    assert prepared.served.outputs[0].shape == ("y_dim0", "features")
    assert prepared.served.inputs[0].layout is None


def test_static_shapes_from_calibration_or_given(tmp_path: Path) -> None:
    prepared = prepare_model(tiny_classifier(tmp_path / "m.onnx", dynamic_size=True), tmp_path / "w")
    calib = {"input": sample_inputs(3, size=20)}
    assert resolve_static_shapes(prepared.served, calib, None) == {"input": (1, 3, 20, 20)}
    assert resolve_static_shapes(prepared.served, calib, {"input": (2, 3, 32, 32)}) == {"input": (2, 3, 32, 32)}
    with pytest.raises(
        ConfigError,
        match=re.escape("--input-shape input=1x4x32x32 does not fit the model's input input [batch, 3, height, width]"),
    ):
        resolve_static_shapes(prepared.served, calib, {"input": (1, 4, 32, 32)})


def test_parse_input_shape() -> None:
    assert parse_input_shape("images:0=1x3x224x224") == ("images:0", (1, 3, 224, 224))
    for bad in ("input", "input=", "=1x3", "input=1x0x2", "input=axb"):
        with pytest.raises(ConfigError, match="expected NAME=DIMxDIMx"):
            parse_input_shape(bad)


def _gemm_model(trans_b: int, alpha: float, beta: float, bias_const: bool) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 4) if trans_b else (4, 5)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w")]
    inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n", 4])]
    if bias_const:
        inits.append(numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "c"))
    else:
        inputs.append(helper.make_tensor_value_info("c", TensorProto.FLOAT, [5]))
    node = helper.make_node("Gemm", ["a", "w", "c"], ["y"], name="fc", transB=trans_b, alpha=alpha, beta=beta)
    graph = helper.make_graph(
        [node], "g", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 5])], inits
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize(("trans_b", "alpha", "beta"), [(1, 1.0, 1.0), (0, 0.5, 2.0)])
def test_gemm_to_matmul_is_numerically_the_same(trans_b: int, alpha: float, beta: float) -> None:
    model = _gemm_model(trans_b, alpha, beta, bias_const=True)
    rewritten, count = gemm_to_matmul(model)
    assert count == 1 and [n.op_type for n in rewritten.graph.node] == ["MatMul", "Add"]
    assert "w" not in {i.name for i in rewritten.graph.initializer}  # the old weight is dropped, not shipped twice
    a = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(_run(rewritten, {"a": a})[0], _run(model, {"a": a})[0], rtol=1e-5, atol=1e-5)


def test_gemm_with_a_scaled_computed_bias_is_left_alone() -> None:
    rewritten, count = gemm_to_matmul(_gemm_model(1, 1.0, 0.5, bias_const=False))
    assert count == 0 and [n.op_type for n in rewritten.graph.node] == ["Gemm"]


def test_calibration_reader_follows_the_get_next_protocol() -> None:
    reader = ArrayCalibrationReader({"x": np.arange(5.0)}, batch=2)
    assert len(reader) == 3
    got = [reader.get_next()["x"].tolist() for _ in range(3)]
    assert got == [[0.0, 1.0], [2.0, 3.0], [4.0]] and reader.get_next() is None
    reader.rewind()
    assert reader.get_next()["x"].tolist() == [0.0, 1.0]


def test_prepare_skips_symbolic_shapes_when_onnx_shape_inference_covers_every_tensor(tmp_path: Path) -> None:
    prepared = prepare_model(tiny_classifier(tmp_path / "m.onnx"), tmp_path / "w")
    assert prepared.steps == ("onnx shape inference", "ort basic optimisation")


def test_unshaped_tensors_found_for_ops_shape_inference_cannot_follow() -> None:
    from edgekit.compress.onnx_prep import _unshaped_tensors

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mystery", ["r"], ["y"], domain="com.example")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])],
    )
    opsets = [helper.make_opsetid("", 13), helper.make_opsetid("com.example", 1)]
    model = onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=opsets))
    assert _unshaped_tensors(model) == []  # r inferred; y is a declared graph output
    del model.graph.value_info[:]
    assert _unshaped_tensors(model) == ["r"]


def test_dynamic_int8_quantizes_the_attention_the_transformer_optimizer_fused(tmp_path: Path) -> None:
    # BERT's self-attention (query/key/value linears split into heads): ORT's optimizer fuses it
    # into Attention, and the dynamic quantizer must turn that into QAttention, or the QKV weights
    # (3 of the 8 weight matrices a block holds) stay float
    from bench.transformer import build_encoder
    from edgekit.compress.ort_quant import fuse_transformer, quantize_weights_int8

    model = build_encoder(tmp_path / "enc.onnx", seq=16, dim=64, hidden=128, blocks=2, heads=4)
    fused = fuse_transformer(model, tmp_path / "fused.onnx")
    assert fused["Attention"] == 2 and fused["SkipLayerNormalization"] == 4
    quantize_weights_int8(tmp_path / "fused.onnx", tmp_path / "q.onnx")
    ops = [n.op_type for n in onnx.load(str(tmp_path / "q.onnx")).graph.node]
    assert ops.count("QAttention") == 2 and "Attention" not in ops
    x = {"x": np.random.default_rng(0).standard_normal((1, 16, 64)).astype(np.float32)}
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, x)[0].ravel()
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, x)[0].ravel()
    assert float(got @ want / np.linalg.norm(got) / np.linalg.norm(want)) > 0.99
