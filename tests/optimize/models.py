"""Tiny models for the optimisation-engine tests, built in code with seeded weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.factories import _save


def outlier_mlp(path: Path, seed: int = 0) -> Path:
    """x [N,16] -> MatMul a (16x32) -> Relu -> MatMul b (32x8) -> Relu -> MatMul c (8x8) -> y.

    Column 0 of ``a`` is scaled by 1000 and row 0 of ``b`` by 1e-3: the tensor between ``a`` and
    ``b`` has one outlier channel that sets its INT8 range, so every other channel rounds to
    nearly nothing and plain INT8 misses the dense gate, while the outlier's own contribution to
    ``y`` stays small. Keeping ``b`` in float (one layer) restores the output.
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    a = rng.standard_normal((16, 32)).astype(np.float32) * 0.3
    a[:, 0] *= 1000.0
    b = rng.standard_normal((32, 8)).astype(np.float32) * 0.3
    b[0, :] *= 1e-3
    c = rng.standard_normal((8, 8)).astype(np.float32) * 0.3
    nodes = [
        helper.make_node("MatMul", ["x", "a"], ["h1"], name="layer_a"),
        helper.make_node("Relu", ["h1"], ["r1"], name="relu_a"),
        helper.make_node("MatMul", ["r1", "b"], ["h2"], name="layer_b"),
        helper.make_node("Relu", ["h2"], ["r2"], name="relu_b"),
        helper.make_node("MatMul", ["r2", "c"], ["h3"], name="layer_c"),
        helper.make_node("Unsqueeze", ["h3", "axes"], ["y"], name="as_map"),  # rank 3: a dense output
    ]
    graph = helper.make_graph(
        nodes,
        "outlier_mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8, 1])],
        [numpy_helper.from_array(v, n) for n, v in (("a", a), ("b", b), ("c", c))]
        + [numpy_helper.from_array(np.array([2], dtype=np.int64), "axes")],
    )
    return _save(graph, path, 13)


def token_classifier(path: Path, seed: int = 0, length: int = 16, classes: int = 4) -> Path:
    """A byte-token classifier with an int32 input: ids [N, L] -> Gather (embedding) -> ReduceMean
    -> Gemm with a 2-D bias [1, C] -> Softmax. ORT's per-channel static quantization raises on
    it (``_adjust_weight_scale_for_int32_bias`` indexes the bias as if it were 1-D)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((256, 32)) * 0.5).astype(np.float32), "emb"),
        numpy_helper.from_array((rng.standard_normal((32, classes)) * 2.0).astype(np.float32), "w"),
        numpy_helper.from_array((rng.standard_normal((1, classes)) * 0.1).astype(np.float32), "bias"),
        numpy_helper.from_array(np.array([1], dtype=np.int64), "axes"),
    ]
    nodes = [
        helper.make_node("Gather", ["emb", "tokens"], ["e"], name="embed"),
        helper.make_node("ReduceMean", ["e", "axes"], ["m"], keepdims=0, name="pool"),
        helper.make_node("Gemm", ["m", "w", "bias"], ["logits"], name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "token_classifier",
        [helper.make_tensor_value_info("tokens", TensorProto.INT32, ["batch", length])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes])],
        inits,
    )
    return _save(graph, path, 18)


def mobilenet_v3_block(path: Path, seed: int = 0, size: int = 32, classes: int = 4) -> Path:
    """A MobileNetV3-style classifier: Conv -> HardSwish -> depthwise Conv -> HardSwish ->
    squeeze-excite (GlobalAveragePool -> 1x1 Conv -> Relu -> 1x1 Conv -> HardSigmoid -> Mul) ->
    1x1 Conv -> HardSwish -> GlobalAveragePool -> Flatten -> Gemm -> Softmax."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def init(name: str, shape: tuple[int, ...], scale: float) -> object:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    c, e, s = 16, 32, 8
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], strides=[2, 2], name="stem"),
        helper.make_node("HardSwish", ["c1"], ["h1"], name="stem_hswish"),
        helper.make_node("Conv", ["h1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], group=c, name="dw"),
        helper.make_node("HardSwish", ["c2"], ["h2"], name="dw_hswish"),
        helper.make_node("GlobalAveragePool", ["h2"], ["sq"], name="se_pool"),
        helper.make_node("Conv", ["sq", "w3", "b3"], ["s1"], name="se_reduce"),
        helper.make_node("Relu", ["s1"], ["s2"], name="se_relu"),
        helper.make_node("Conv", ["s2", "w4", "b4"], ["s3"], name="se_expand"),
        helper.make_node("HardSigmoid", ["s3"], ["gate"], alpha=1.0 / 6, beta=0.5, name="se_hsigmoid"),
        helper.make_node("Mul", ["h2", "gate"], ["se"], name="se_scale"),
        helper.make_node("Conv", ["se", "w5", "b5"], ["c5"], name="project"),
        helper.make_node("HardSwish", ["c5"], ["h5"], name="project_hswish"),
        helper.make_node("GlobalAveragePool", ["h5"], ["p"], name="pool"),
        helper.make_node("Flatten", ["p"], ["f"], name="flatten"),
        helper.make_node("Gemm", ["f", "w6", "b6"], ["logits"], transB=1, name="classifier"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "mobilenet_v3_block",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes])],
        [
            init("w1", (c, 3, 3, 3), 0.4),
            init("b1", (c,), 0.1),
            init("w2", (c, 1, 3, 3), 0.4),
            init("b2", (c,), 0.1),
            init("w3", (s, c, 1, 1), 0.4),
            init("b3", (s,), 0.1),
            init("w4", (c, s, 1, 1), 0.4),
            init("b4", (c,), 0.1),
            init("w5", (e, c, 1, 1), 0.3),
            init("b5", (e,), 0.1),
            init("w6", (classes, e), 3.0),
            init("b6", (classes,), 0.1),
        ],
    )
    return _save(graph, path, 14)


def confident(model: Path, inputs: np.ndarray, n: int, margin: float = 0.15) -> np.ndarray:
    """The first ``n`` of ``inputs`` on which the FP32 model's top-1 leads the second by ``margin``."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    probs = session.run(None, {name: inputs})[0]
    top2 = np.sort(probs, axis=1)[:, -2:]
    keep = inputs[(top2[:, 1] - top2[:, 0]) > margin]
    if len(keep) < n:
        raise ValueError(f"only {len(keep)} of {len(inputs)} samples lead by {margin}")
    return keep[:n]


def mixed_scale_head(path: Path, seed: int = 0) -> Path:
    """x [N,4,8,8] -> a box branch (Conv, values in the hundreds) and a score branch (Conv ->
    Sigmoid, 0-1) -> Concat on channels -> Reshape -> y [N, 5, 64], like a YOLOv8 head before
    Ultralytics normalizes the boxes: one per-tensor INT8 scale for ``y`` rounds every score to 0
    while the global cosine stays near 1."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    boxes = (rng.standard_normal((2, 4, 3, 3)) * 300.0).astype(np.float32)
    scores = (rng.standard_normal((3, 4, 3, 3)) * 0.5).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "wb"], ["b"], name="box_conv", pads=[1, 1, 1, 1]),
        helper.make_node("Conv", ["x", "ws"], ["s0"], name="score_conv", pads=[1, 1, 1, 1]),
        helper.make_node("Sigmoid", ["s0"], ["s"], name="score_sigmoid"),
        helper.make_node("Concat", ["b", "s"], ["bs"], name="head_concat", axis=1),
        helper.make_node("Reshape", ["bs", "shape"], ["y"], name="as_anchors"),
    ]
    graph = helper.make_graph(
        nodes,
        "mixed_scale_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5, 64])],
        [
            numpy_helper.from_array(boxes, "wb"),
            numpy_helper.from_array(scores, "ws"),
            numpy_helper.from_array(np.array([-1, 5, 64], dtype=np.int64), "shape"),
        ],
    )
    return _save(graph, path, 13)


def tiny_score_head(path: Path, seed: int = 0) -> Path:
    """x [N,4,8,8] -> a box branch (Conv, values in the hundreds, Reshape to [N,2,128]) and a score
    branch (two Convs with bias -10, like two pyramid levels, each Reshaped to [N,3,64], joined on
    the anchors, then Sigmoid: scores about 5e-5) -> Concat on channels -> y [N, 5, 128]: YOLOv8n's
    head topology (its untrained class scores peak at 0.015). The Concat writes the output, and
    TFLite's int8 LOGISTIC (fixed output scale 1/256) rounds every score to 0."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    boxes = (rng.standard_normal((4, 4, 3, 3)) * 300.0).astype(np.float32)
    levels = [(rng.standard_normal((3, 4, 3, 3)) * 0.05).astype(np.float32) for _ in range(2)]
    nodes = [
        helper.make_node("Conv", ["x", "wb"], ["b0"], name="box_conv", pads=[1, 1, 1, 1]),
        helper.make_node("Reshape", ["b0", "box_shape"], ["b"], name="box_anchors"),
    ]
    for i in range(2):
        nodes += [
            helper.make_node("Conv", ["x", f"ws{i}", "bs"], [f"s{i}"], name=f"score_conv{i}", pads=[1, 1, 1, 1]),
            helper.make_node("Reshape", [f"s{i}", "score_shape"], [f"r{i}"], name=f"score_anchors{i}"),
        ]
    nodes += [
        helper.make_node("Concat", ["r0", "r1"], ["logits"], name="score_levels", axis=2),
        helper.make_node("Sigmoid", ["logits"], ["s"], name="score_sigmoid"),
        helper.make_node("Concat", ["b", "s"], ["y"], name="head_concat", axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny_score_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 5, 128])],
        [
            numpy_helper.from_array(boxes, "wb"),
            *(numpy_helper.from_array(w, f"ws{i}") for i, w in enumerate(levels)),
            numpy_helper.from_array(np.full(3, -10.0, dtype=np.float32), "bs"),
            numpy_helper.from_array(np.array([-1, 2, 128], dtype=np.int64), "box_shape"),
            numpy_helper.from_array(np.array([-1, 3, 64], dtype=np.int64), "score_shape"),
        ],
    )
    return _save(graph, path, 13)


def served_coral(conversion: object, quantized: bytes, x: np.ndarray, out_shape: tuple[int, ...]) -> np.ndarray:
    """``x`` [N,4,8,8] run one sample at a time through the runner the agent serves a coral bundle
    with (float NCHW in, float ``y`` of ``out_shape`` out), on ``quantized`` from ``conversion``."""
    from edgekit.bundle.manifest import Signature, TensorSpec
    from edgekit.targets.coral import _artifact_signature, _mapping, served_runner

    tm = conversion.model(quantized, "int8")  # type: ignore[attr-defined]  # a FloatConversion
    signature = Signature(
        inputs=(TensorSpec("x", "float32", (1, 4, 8, 8), layout="NCHW"),),
        outputs=(TensorSpec("y", "float32", out_shape),),
    )
    run = served_runner(quantized, _artifact_signature(tm, signature), _mapping(tm), signature)
    return np.concatenate([run({"x": x[i : i + 1]})["y"] for i in range(len(x))])


def misleading_detector(path: Path, seed: int = 0) -> Path:
    """A one-class YOLO-style detector, x [N,8,12,16] -> output0 [N,5,192] (cx, cy, w, h in 0-1
    and the score per grid cell), where the layer with the largest INT8 error of its own is not the
    one that breaks the detections.

    - ``conv_h``: one output channel's weights scaled by 1000, so INT8 rounds its other channels to
      nothing (its worst channel is crushed: the largest local error of the graph); its output
      reaches the boxes scaled by 1e-5, far below what moves a box.
    - ``conv_s``: the class logit, a large weight on input channel 0 (always 0 in the data) next to
      small ones on the others: the per-channel INT8 weight scale rounds the small weights to 0,
      every score falls to sigmoid(bias) just under the 0.25 threshold and every detection is lost,
      while its relative error is a fraction of ``conv_h``'s.
    - the boxes are fixed grid cells (no two overlap) plus a small ``conv_box`` term.

    Feed it ``detector_inputs``: channel 0 is 0, the others +-1, so every FP32 logit lies at least
    0.05 from the threshold's.
    """
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    wh = (rng.standard_normal((4, 8, 1, 1)) * 0.5).astype(np.float32)
    wh[0] *= 1000.0
    wb = (rng.standard_normal((4, 8, 1, 1)) * 0.001).astype(np.float32)
    ws = np.full((1, 8, 1, 1), 0.15, np.float32)
    ws[0, 0] = 100.0  # on the dead input channel: sets the weight scale, rounds the 0.15s to 0
    bs = np.array([-1.1], np.float32)
    rows, cols = np.meshgrid((np.arange(12) + 0.5) / 12, (np.arange(16) + 0.5) / 16, indexing="ij")
    grid = np.stack([cols, rows, np.full_like(rows, 0.04), np.full_like(rows, 0.05)])[None].astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["x", "wh"], ["h"], name="conv_h"),
        helper.make_node("Mul", ["h", "tiny"], ["hs"], name="scale_h"),
        helper.make_node("Conv", ["x", "wb"], ["bx"], name="conv_box"),
        helper.make_node("Add", ["bx", "grid"], ["b1"], name="add_grid"),
        helper.make_node("Add", ["b1", "hs"], ["boxes"], name="add_h"),
        helper.make_node("Conv", ["x", "ws", "bs"], ["logit"], name="conv_s"),
        # Sub is not an op ORT quantizes: with conv_s excluded nothing requantizes the logit, and
        # its weights stay float (ORT quantizes a float weight between a DQ and a Q when it loads)
        helper.make_node("Sub", ["logit", "offset"], ["shifted"], name="offset_s"),
        helper.make_node("Sigmoid", ["shifted"], ["score"], name="sigmoid"),
        helper.make_node("Concat", ["boxes", "score"], ["cat"], name="concat", axis=1),
        helper.make_node("Reshape", ["cat", "shape"], ["output0"], name="as_anchors"),
    ]
    weights = {
        "wh": wh,
        "wb": wb,
        "ws": ws,
        "bs": bs,
        "grid": grid,
        "tiny": np.array(1e-5, np.float32),
        "offset": np.array(0.1, np.float32),
    }
    graph = helper.make_graph(
        nodes,
        "misleading_detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8, 12, 16])],
        [helper.make_tensor_value_info("output0", TensorProto.FLOAT, ["batch", 5, 192])],
        [numpy_helper.from_array(v, n) for n, v in weights.items()]
        + [numpy_helper.from_array(np.array([-1, 5, 192], dtype=np.int64), "shape")],
    )
    return _save(graph, path, 13)


def detector_inputs(n: int, seed: int = 0) -> np.ndarray:
    """Inputs for ``misleading_detector``: channel 0 is 0, channels 1-7 are +-1."""
    x = np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), size=(n, 8, 12, 16))
    x[:, 0] = 0.0
    return x
