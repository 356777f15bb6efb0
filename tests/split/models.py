"""Models for the split tests, built in code: conv nets whose intermediate tensors are much
smaller than their input (where cutting pays at low bandwidth)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import onnx

SIZE = 96  # input [batch, 3, 96, 96]: 110592 bytes per sample
# tensor -> bytes per sample, for the chain below
TENSOR_BYTES = {"c1": 9216, "r1": 9216, "c2": 4608, "r2": 4608, "c3": 18432, "r3": 18432, "c4": 1152, "r4": 1152}


def shrinking_convnet(path: Path, *, seed: int = 0, skip: bool = False) -> Path:
    """Conv(3->4, k4 s4) Relu Conv(4->8, s2) Relu Conv(8->32) Relu Conv(32->8, s2) Relu GAP Flatten Gemm Softmax.

    ``skip``: ``r2`` is also added to ``r3``'s first 8 channels' projection (an Add reading ``r2``
    after conv3), so two tensors cross the cuts between them."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name: str, shape: tuple[int, ...], scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[4, 4], strides=[4, 4], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1], name="conv3"),
        helper.make_node("Relu", ["c3"], ["r3"], name="relu3"),
        helper.make_node("Conv", ["r3", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv4"),
        helper.make_node("Relu", ["c4"], ["r4"], name="relu4"),
        helper.make_node("GlobalAveragePool", ["r4"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["flat", "w5", "b5"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1, name="softmax"),
    ]
    inits = [
        init("w1", (4, 3, 4, 4)),
        init("b1", (4,), 0.1),
        init("w2", (8, 4, 3, 3)),
        init("b2", (8,), 0.1),
        init("w3", (32, 8, 3, 3)),
        init("b3", (32,), 0.1),
        init("w4", (8, 32, 3, 3)),
        init("b4", (8,), 0.1),
        init("w5", (10, 8), 1.0),
        init("b5", (10,), 0.1),
    ]
    if skip:
        # r3' = r3 + tile(r2, 4 along channels): r2 stays live across conv3 and relu3
        nodes[6] = helper.make_node(
            "Conv", ["r3s", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv4"
        )
        nodes.insert(6, helper.make_node("Concat", ["r2", "r2", "r2", "r2"], ["r2x4"], axis=1, name="tile"))
        nodes.insert(7, helper.make_node("Add", ["r3", "r2x4"], ["r3s"], name="skip"))
    graph = helper.make_graph(
        nodes,
        "shrinking_convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, SIZE, SIZE])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    return _save(graph, path)


def inputs(n: int, *, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 3, SIZE, SIZE)).astype(np.float32)


HEAVY_SIZE = 128  # input [batch, 3, 128, 128]: 196608 bytes per sample


def heavy_middle_convnet(path: Path, *, seed: int = 0, width: int = 48) -> Path:
    """A cheap 4x4/4 stem to 8x32x32 (32 KB, the cut worth sending), three ``width``-channel 3x3
    convs at 32x32 (most of the compute), a 4x4/4 conv down to 8x8x8 (2 KB), then a classifier:
    at high bandwidth the head after the stem wins, at low bandwidth running locally does."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    w = width
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], kernel_shape=[4, 4], strides=[4, 4], name="stem"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
    ]
    inits = [init("w1", (8, 3, 4, 4), 0.3), init("b1", (8,), 0.1)]
    prev, channels = "r1", 8
    for k in (2, 3, 4):
        nodes.append(helper.make_node("Conv", [prev, f"w{k}", f"b{k}"], [f"c{k}"], pads=[1, 1, 1, 1], name=f"conv{k}"))
        nodes.append(helper.make_node("Relu", [f"c{k}"], [f"r{k}"], name=f"relu{k}"))
        inits += [init(f"w{k}", (w, channels, 3, 3), (2.0 / (channels * 9)) ** 0.5), init(f"b{k}", (w,), 0.01)]
        prev, channels = f"r{k}", w
    nodes += [
        helper.make_node("Conv", [prev, "w5", "b5"], ["c5"], kernel_shape=[4, 4], strides=[4, 4], name="down"),
        helper.make_node("Relu", ["c5"], ["r5"], name="relu5"),
        helper.make_node("GlobalAveragePool", ["r5"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["flat", "w6", "b6"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1, name="softmax"),
    ]
    inits += [init("w5", (8, w, 4, 4), 0.05), init("b5", (8,), 0.01), init("w6", (10, 8), 1.0), init("b6", (10,), 0.1)]
    graph = helper.make_graph(
        nodes,
        "heavy_middle_convnet",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3, HEAVY_SIZE, HEAVY_SIZE])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    return _save(graph, path)


def _save(graph: onnx.GraphProto, path: Path) -> Path:
    import onnx
    from onnx import helper

    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path
