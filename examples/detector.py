"""A YOLO-style detector whose output is a known function of its input, built as ONNX in code.

``colour_detector`` looks at an RGB image ``images`` [1, 3, S, S] (values 0..1) in cells of
``cell`` x ``cell`` pixels. Each cell is one candidate: its box is centred on the cell and
``box`` pixels wide and high, and its score for class c is the mean of channel c over the cell,
so a red patch is class 0, green 1, blue 2. The head is laid out as a YOLOv8 export is:
``output0`` [1, 4 + 3, N] (cx, cy, w, h in input pixels, then one score per class), or
[1, N, 4 + 3] with ``channels_last``. A test can compute the same outputs from the pixels with
numpy, and so check decoding, NMS and the mapping back to the original image independently.

``backbone`` adds that many 3x3 conv layers of ``width`` channels in front (seeded random
weights), whose features nudge the box sizes by at most 1e-3 pixels: a model with a real
detector's compute (for timing) whose detections stay the known function. ``sharpness`` raises
each score to that power, so that only strongly coloured cells pass a score threshold.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


def colour_detector(
    path: Path,
    *,
    size: int = 64,
    cell: int = 8,
    box: float = 24.0,
    channels_last: bool = False,
    backbone: int = 0,
    width: int = 32,
    sharpness: float = 1.0,
    seed: int = 0,
) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    if size % cell:
        raise ValueError(f"size {size} is not a multiple of cell {cell}")
    grid = size // cell
    n = grid * grid
    ys, xs = np.mgrid[0:grid, 0:grid].astype(np.float32)
    anchors = np.stack(
        [(xs.ravel() + 0.5) * cell, (ys.ravel() + 0.5) * cell, np.full(n, box, np.float32), np.full(n, box, np.float32)]
    )[None]  # [1, 4, N]
    inits = [
        numpy_helper.from_array(anchors.astype(np.float32), "anchors"),
        numpy_helper.from_array(np.array([1, 3, n], np.int64), "score_shape"),
    ]
    nodes = [
        helper.make_node("AveragePool", ["images"], ["pooled"], kernel_shape=[cell, cell], strides=[cell, cell]),
        helper.make_node("Reshape", ["pooled", "score_shape"], ["means" if sharpness != 1 else "scores"]),
    ]
    if sharpness != 1:  # only strongly coloured cells score high: a photo gives tens of candidates, not all
        inits.append(numpy_helper.from_array(np.array(sharpness, np.float32), "sharpness"))
        nodes.append(helper.make_node("Pow", ["means", "sharpness"], ["scores"]))
    boxes = "anchors"
    if backbone:
        rng = np.random.default_rng(seed)
        x, c_in = "images", 3
        for i in range(backbone):
            w = (rng.standard_normal((width, c_in, 3, 3)) * np.sqrt(2 / (9 * c_in))).astype(np.float32)
            inits.append(numpy_helper.from_array(w, f"w{i}"))
            stride = 2 if i < 3 else 1  # down to 1/8, like a detector's P3 level
            nodes += [
                helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], pads=[1, 1, 1, 1], strides=[stride, stride]),
                helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
            ]
            x, c_in = f"r{i}", width
        inits += [
            numpy_helper.from_array(np.full((1, 1, 1), 1e-3, np.float32), "tiny"),
            numpy_helper.from_array(np.array([0, 0, 1, 1], np.float32).reshape(1, 4, 1), "wh_only"),
        ]
        nodes += [
            helper.make_node("ReduceMean", [x], ["feat"], axes=[1, 2, 3], keepdims=1),  # [1, 1, 1, 1]
            helper.make_node("Tanh", ["feat"], ["feat_t"]),
            helper.make_node("Squeeze", ["feat_t"], ["feat_s"]),
            helper.make_node("Mul", ["feat_s", "tiny"], ["nudge"]),
            helper.make_node("Mul", ["nudge", "wh_only"], ["nudge_wh"]),
            helper.make_node("Add", ["anchors", "nudge_wh"], ["boxes"]),
        ]
        boxes = "boxes"
    out_shape = [1, n, 7] if channels_last else [1, 7, n]
    if channels_last:
        nodes += [
            helper.make_node("Concat", [boxes, "scores"], ["head"], axis=1),
            helper.make_node("Transpose", ["head"], ["output0"], perm=[0, 2, 1]),
        ]
    else:
        nodes.append(helper.make_node("Concat", [boxes, "scores"], ["output0"], axis=1))
    graph = helper.make_graph(
        nodes,
        "colour_detector",
        [helper.make_tensor_value_info("images", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, out_shape)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], producer_name="edgekit-examples")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = Path(path)
    onnx.save(model, str(path))
    return path


def reference_outputs(images: np.ndarray, cell: int = 8, box: float = 24.0, channels_last: bool = False) -> np.ndarray:
    """What ``colour_detector`` computes (without a backbone), in numpy: [1, 7, N] or [1, N, 7]."""
    _, c, h, _ = images.shape
    g = h // cell
    pooled = images.reshape(1, c, g, cell, g, cell).mean(axis=(3, 5)).reshape(1, c, g * g)
    ys, xs = np.mgrid[0:g, 0:g]
    anchors = np.stack([(xs.ravel() + 0.5) * cell, (ys.ravel() + 0.5) * cell, np.full(g * g, box), np.full(g * g, box)])
    out = np.concatenate([anchors[None], pooled], axis=1)
    return out.transpose(0, 2, 1) if channels_last else out
