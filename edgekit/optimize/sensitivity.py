"""Layer sensitivity of a QDQ-quantized ONNX model: each quantized layer's measured contribution
to the error against FP32, on calibration samples.

One pass per model: both the FP32 and the QDQ model are run with every quantized layer's input and
output exposed as graph outputs. A layer's score is the relative error of its (requantized)
output minus the largest relative error of the dequantized inputs it reads: the error the layer
itself adds (its weight and output-activation quantization), not what it inherited. Mixed precision keeps
the highest-scoring layers in float first.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.validate.calib import iter_batches

COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Attention", "LSTM", "GRU")


def quantized_layers(qdq: Any) -> list[tuple[str, list[tuple[str, str]], tuple[str, str]]]:
    """Every compute node that reads a DequantizeLinear activation, in graph order, as
    (node name, inputs, output). Inputs are (tensor the node sees in the QDQ model, the FP32
    tensor of the same value): the DequantizeLinear output and the name its QuantizeLinear read.
    The output is (what the next layer sees, the FP32 name): the DequantizeLinear after the
    node's QuantizeLinear where there is one, since ORT folds a following Relu into that
    QuantizeLinear and the node's own output then differs from FP32's tensor of that name."""
    producer = {o: n for n in qdq.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in qdq.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    initializers = {i.name for i in qdq.graph.initializer}
    layers = []
    for node in qdq.graph.node:
        if node.op_type not in COMPUTE_OPS or not node.name:
            continue
        inputs = []
        quantized = False
        for name in node.input:
            dq = producer.get(name)
            if dq is None or dq.op_type != "DequantizeLinear":
                continue
            quantized = True
            q = producer.get(dq.input[0])
            if q is not None and q.op_type == "QuantizeLinear" and q.input[0] not in initializers:
                inputs.append((name, q.input[0]))
        if not quantized:
            continue
        out = node.output[0]
        seen = out
        for q in consumers.get(out, []):
            if q.op_type == "QuantizeLinear":
                dq = next((c for c in consumers.get(q.output[0], []) if c.op_type == "DequantizeLinear"), None)
                if dq is not None:
                    seen = dq.output[0]
                    break
        layers.append((node.name, inputs, (seen, out)))
    return layers


def rank_qdq_layers(
    fp32_path: Path, qdq_path: Path, samples: Mapping[str, np.ndarray], work_dir: Path, batch: int = 1, limit: int = 32
) -> list[tuple[tuple[str, ...], float]]:
    """(layer group, score) for each quantized layer of ``qdq_path``, most sensitive first.

    A layer's group is the layer and the quantized compute layers that produce its inputs
    (through Relu, pooling, reshapes): keeping a layer in float means its inputs stay float too,
    and ORT quantizes a tensor whenever its producer *or* a consumer is quantized."""
    import onnx

    qdq = onnx.load(str(qdq_path))
    fp32 = onnx.load(str(fp32_path))
    fp32_tensors = {o for n in fp32.graph.node for o in n.output} | {i.name for i in fp32.graph.input}
    layers = [
        (n, [p for p in ins if p[1] in fp32_tensors], out)
        for n, ins, out in quantized_layers(qdq)
        if out[1] in fp32_tensors
    ]
    if not layers:
        return []
    pairs = sorted({p for _, ins, out in layers for p in (*ins, out)})
    a = _run_exposed(fp32, sorted({f for _, f in pairs}), samples, work_dir / "sens-fp32.onnx", batch, limit)
    b = _run_exposed(qdq, sorted({q for q, _ in pairs}), samples, work_dir / "sens-qdq.onnx", batch, limit)
    err = {p: _rel_err(b[p[0]], a[p[1]]) for p in pairs if p[0] in b and p[1] in a}
    quantized = {n for n, _, _ in layers}
    producers = {o: n for n in fp32.graph.node for o in n.output}
    scored = []
    for name, ins, out in layers:
        if out not in err:
            continue
        inherited = max((err[i] for i in ins if i in err), default=0.0)
        group = (name, *_input_layers([f for _, f in ins], producers, quantized))
        scored.append((tuple(dict.fromkeys(group)), max(0.0, err[out] - inherited)))
    return sorted(scored, key=lambda s: -s[1])


def _input_layers(tensors: list[str], producers: Mapping[str, Any], quantized: set[str], depth: int = 6) -> list[str]:
    """The nearest compute layers in ``quantized`` upstream of ``tensors``, through other ops."""
    found: list[str] = []
    for t in tensors:
        node = producers.get(t)
        for _ in range(depth):
            if node is None:
                break
            if node.name in quantized:
                found.append(node.name)
                break
            if node.op_type in COMPUTE_OPS or not node.input:
                break
            node = producers.get(node.input[0])
    return found


def _run_exposed(
    model: Any, tensors: list[str], samples: Mapping[str, np.ndarray], path: Path, batch: int, limit: int
) -> dict[str, np.ndarray]:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    present = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    for t in tensors:
        if t not in present:
            model.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
    onnx.save(model, str(path))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every tensor
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs() if o.name in set(tensors)]
    parts: dict[str, list[np.ndarray]] = {n: [] for n in names}
    seen = 0
    for feed in iter_batches(samples, batch):
        for name, value in zip(names, session.run(names, feed), strict=True):
            parts[name].append(np.asarray(value, dtype=np.float64).reshape(-1))
        seen += batch
        if seen >= limit:
            break
    # graph inputs are not exposed: both models read the same values there (error 0)
    return {n: np.concatenate(v) for n, v in parts.items() if v}


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    if got.shape != ref.shape:
        return 0.0
    return float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-12))
