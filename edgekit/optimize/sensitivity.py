"""Layer sensitivity of a QDQ-quantized ONNX model: each quantized layer's measured contribution
to the error against FP32, on calibration samples.

One pass over the samples: the FP32 and the QDQ model run side by side with every quantized
layer's input and output exposed as graph outputs, and each tensor's error is accumulated batch by
batch (``validate.metrics.ChannelStats``: nothing is kept but per-channel sums). A layer's score is
the error of its (requantized) output minus the largest error of the dequantized inputs it reads:
the error the layer itself adds (its weight and output-activation quantization), not what it
inherited. The error is the relative error, or, where the model has a dense output with channels
(what the gate judges per channel), the worst channel's error where that is larger: a Concat that
joins boxes in pixels with 0-1 scores under one int8 scale crushes the scores while its global
error stays small. Mixed precision keeps the highest-scoring layers in float first.

Rankable units: compute layers, and Concat nodes (the join of differently-scaled branches). A
Concat whose output reaches the graph outputs through non-compute ops only (a head's tail: the
Reshape/Transpose after it) is grouped with those ops: ORT quantizes a Reshape whose input is
quantized, so excluding the Concat alone would requantize the joined tensor one op later.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.validate.calib import iter_batches
from edgekit.validate.metrics import ChannelStats, channel_axis

COMPUTE_OPS = ("Conv", "ConvTranspose", "MatMul", "Gemm", "Attention", "LSTM", "GRU")
JOIN_OPS = ("Concat",)  # rankable too: one output scale for branches of different value scales
TAIL_DEPTH = 8  # ops followed from a Concat towards the outputs


def quantized_layers(qdq: Any) -> list[tuple[str, list[tuple[str, str]], tuple[str, str]]]:
    """Every compute (or Concat) node that reads a DequantizeLinear activation, in graph order, as
    (node name, inputs, output). Inputs are (tensor the node sees in the QDQ model, the FP32
    tensor of the same value): the DequantizeLinear output and the name its QuantizeLinear read.
    The output is (what the next layer sees, the FP32 name): the DequantizeLinear after the
    node's QuantizeLinear where there is one, since ORT folds a following Relu into that
    QuantizeLinear and the node's own output then differs from FP32's tensor of that name.
    Where that DequantizeLinear writes a graph output, the FP32 name is the output's."""
    producer = {o: n for n in qdq.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in qdq.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    initializers = {i.name for i in qdq.graph.initializer}
    graph_outputs = {o.name for o in qdq.graph.output}
    layers = []
    for node in qdq.graph.node:
        if node.op_type not in (*COMPUTE_OPS, *JOIN_OPS) or not node.name:
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
        # a graph output keeps its name on the last DequantizeLinear (ORT renames the node's own
        # output to NAME_QuantizeLinear_Input): FP32's tensor of that value has the output's name
        layers.append((node.name, inputs, (seen, seen if seen in graph_outputs else out)))
    return layers


def rank_qdq_layers(
    fp32_path: Path, qdq_path: Path, samples: Mapping[str, np.ndarray], work_dir: Path, batch: int = 1, limit: int = 32
) -> list[tuple[tuple[str, ...], float]]:
    """(layer group, score) for each quantized layer of ``qdq_path``, most sensitive first.

    A layer's group is the layer and the quantized compute layers that produce its inputs
    (through Relu, pooling, reshapes): keeping a layer in float means its inputs stay float too,
    and ORT quantizes a tensor whenever its producer *or* a consumer is quantized. A Concat's group
    is the Concat and its tail to the outputs (module doc): its inputs keep their own scales."""
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
    channels = any(_rank(o) >= 3 for o in fp32.graph.output)  # the gate judges these per channel
    stats = _compare_exposed(fp32, qdq, pairs, samples, work_dir, batch, limit)
    err = {p: (s.error() if channels else s.relative_error()) for p, s in stats.items()}
    quantized = {n for n, _, _ in layers}
    producers = {o: n for n in fp32.graph.node for o in n.output}
    consumers: dict[str, list[Any]] = {}
    for n in fp32.graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    by_name = {n.name: n for n in fp32.graph.node}
    scored = []
    for name, ins, out in layers:
        if out not in err:
            continue
        inherited = max((err[i] for i in ins if i in err), default=0.0)
        if name in by_name and by_name[name].op_type in JOIN_OPS:
            group = (name, *_tail(by_name[name], consumers))
        else:
            group = (name, *_input_layers([f for _, f in ins], producers, quantized))
        scored.append((tuple(dict.fromkeys(group)), max(0.0, err[out] - inherited)))
    return sorted(scored, key=lambda s: -s[1])


def _tail(node: Any, consumers: Mapping[str, list[Any]]) -> list[str]:
    """The ops after ``node`` up to the graph outputs when they are all non-compute ops (a head's
    tail), else none: a Concat that feeds further layers is excluded alone."""
    found: list[str] = []
    frontier = list(node.output)
    while frontier:
        for c in consumers.get(frontier.pop(), []):
            if c.op_type in COMPUTE_OPS or len(found) >= TAIL_DEPTH:
                return []
            if c.name not in found:
                found.append(c.name)
                frontier.extend(c.output)
    return found


def _rank(value_info: Any) -> int:
    t = value_info.type.tensor_type
    return len(t.shape.dim) if t.HasField("shape") else 0


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


def _compare_exposed(
    fp32: Any,
    qdq: Any,
    pairs: list[tuple[str, str]],
    samples: Mapping[str, np.ndarray],
    work_dir: Path,
    batch: int,
    limit: int,
) -> dict[tuple[str, str], ChannelStats]:
    """Run both models batch by batch with the paired tensors exposed; per pair (QDQ tensor, FP32
    tensor) the accumulated ``ChannelStats`` on the gate's channel axis. Graph inputs are not
    exposed: both models read the same values there (no pair for them)."""
    fp32_session = _exposed_session(fp32, sorted({f for _, f in pairs}), work_dir / "sens-fp32.onnx")
    qdq_session = _exposed_session(qdq, sorted({q for q, _ in pairs}), work_dir / "sens-qdq.onnx")
    a_names = [o.name for o in fp32_session.get_outputs()]
    b_names = [o.name for o in qdq_session.get_outputs()]
    wanted = [p for p in pairs if p[0] in set(b_names) and p[1] in set(a_names)]
    stats = {p: ChannelStats() for p in wanted}
    mismatched: set[tuple[str, str]] = set()
    seen = 0
    for feed in iter_batches(samples, batch):
        a = dict(zip(a_names, fp32_session.run(a_names, feed), strict=True))
        b = dict(zip(b_names, qdq_session.run(b_names, feed), strict=True))
        for p in wanted:
            got, ref = np.asarray(b[p[0]]), np.asarray(a[p[1]])
            if got.shape != ref.shape:
                mismatched.add(p)  # not the same value after all: scored 0, as before
                continue
            stats[p].add(ref, got, channel_axis(tuple(ref.shape)))
        del a, b
        seen += batch
        if seen >= limit:
            break
    for p in mismatched:
        stats[p] = ChannelStats()
    return stats


def _exposed_session(model: Any, tensors: list[str], path: Path) -> Any:
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = onnx.ModelProto.FromString(model.SerializeToString())
    present = {o.name for o in model.graph.output} | {i.name for i in model.graph.input}
    for t in tensors:
        if t not in present:
            model.graph.output.append(helper.make_tensor_value_info(t, TensorProto.FLOAT, None))
    onnx.save(model, str(path))
    del model
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # keep every tensor
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
