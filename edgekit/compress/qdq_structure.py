"""Structure checks for an explicit-quantization (Q/DQ) ONNX model meant for TensorRT.

TensorRT's ONNX parser takes QuantizeLinear/DequantizeLinear only with a zero zero-point
(symmetric) and INT8 data; per-channel weight scales must lie along the output-channel axis
(0 for Conv/Gemm-with-transB weights, 1 for ConvTranspose). Biases stay float: TensorRT folds them
itself. ``check_tensorrt_qdq`` checks exactly that on the saved model and reports what it found.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from edgekit.errors import ModelFormatError

# Weighted ops and the input index of their weight / bias.
WEIGHTED_OPS = {"Conv": (1, 2), "ConvTranspose": (1, 2), "Gemm": (1, 2), "MatMul": (1, None)}


class QdqStructureError(ModelFormatError):
    """A Q/DQ model is not in the form TensorRT's explicit quantization takes."""


@dataclass(frozen=True)
class QdqSummary:
    quantize_nodes: int
    dequantize_nodes: int
    quantized_ops: tuple[str, ...]  # names of weighted nodes whose activation and weight come through DQ
    per_channel_weights: int
    float_ops: tuple[str, ...]  # weighted nodes left in float (not quantized)


def check_tensorrt_qdq(model: Any) -> QdqSummary:
    """Check an ``onnx.ModelProto``; raise ``QdqStructureError`` naming the first bad node."""
    from onnx import TensorProto, numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    producer = {out: node for node in model.graph.node for out in node.output}
    q_count = dq_count = per_channel = 0
    for node in model.graph.node:
        if node.op_type not in ("QuantizeLinear", "DequantizeLinear"):
            continue
        if node.op_type == "QuantizeLinear":
            q_count += 1
        else:
            dq_count += 1
        scale = _const(node.input[1], inits, numpy_helper)
        if scale is None:
            raise QdqStructureError(f"{node.op_type} {node.name!r}: scale {node.input[1]!r} must be an initializer")
        if not np.all(np.isfinite(scale)) or np.any(scale <= 0):
            raise QdqStructureError(f"{node.op_type} {node.name!r}: scales must be finite and > 0")
        if len(node.input) < 3 or not node.input[2]:
            raise QdqStructureError(f"{node.op_type} {node.name!r}: no zero point; TensorRT needs an INT8 one")
        zp_init = inits.get(node.input[2])
        if zp_init is None:
            raise QdqStructureError(f"{node.op_type} {node.name!r}: zero point must be an initializer")
        if zp_init.data_type == TensorProto.INT32:
            raise QdqStructureError(
                f"{node.op_type} {node.name!r}: an int32 (quantized) bias; TensorRT needs float biases"
            )
        if zp_init.data_type != TensorProto.INT8:
            dtype = TensorProto.DataType.Name(zp_init.data_type)
            raise QdqStructureError(
                f"{node.op_type} {node.name!r}: zero point is {dtype}; TensorRT takes INT8 (use int8 activations)"
            )
        if np.any(numpy_helper.to_array(zp_init) != 0):
            raise QdqStructureError(
                f"{node.op_type} {node.name!r}: zero point is not 0; TensorRT needs symmetric quantization"
            )
        if scale.size > 1:
            per_channel += 1
    quantized, float_ops = [], []
    for node in model.graph.node:
        if node.op_type not in WEIGHTED_OPS:
            continue
        w_index, b_index = WEIGHTED_OPS[node.op_type]
        act_dq = producer.get(node.input[0])
        w_dq = producer.get(node.input[w_index])
        if act_dq is None or act_dq.op_type != "DequantizeLinear":
            if w_dq is not None and w_dq.op_type == "DequantizeLinear":
                raise QdqStructureError(f"{node.op_type} {node.name!r}: weight is quantized but its input is not")
            float_ops.append(node.name)
            continue
        if w_dq is None or w_dq.op_type != "DequantizeLinear":
            # a layer left without Q/DQ (mixed precision) whose producer's output is quantized for
            # another consumer: TensorRT dequantizes and runs it in float
            float_ops.append(node.name)
            continue
        _check_weight_axis(node, w_dq, inits, numpy_helper)
        if b_index is not None and len(node.input) > b_index and node.input[b_index]:
            bias_src = producer.get(node.input[b_index])
            if bias_src is not None and bias_src.op_type == "DequantizeLinear":
                raise QdqStructureError(f"{node.op_type} {node.name!r}: bias is quantized; TensorRT needs a float bias")
        quantized.append(node.name)
    if not quantized:
        raise QdqStructureError("no Conv/Gemm/MatMul takes quantized inputs: the model is not INT8")
    return QdqSummary(q_count, dq_count, tuple(quantized), per_channel, tuple(float_ops))


def _const(name: str, inits: dict[str, Any], numpy_helper: Any) -> np.ndarray | None:
    return numpy_helper.to_array(inits[name]) if name in inits else None


def _check_weight_axis(node: Any, dq: Any, inits: dict[str, Any], numpy_helper: Any) -> None:
    scale = _const(dq.input[1], inits, numpy_helper)
    data = inits.get(dq.input[0])
    if scale is None or scale.size <= 1 or data is None:
        return  # per-tensor weight scale: no axis to check
    axis = next((a.i for a in dq.attribute if a.name == "axis"), 1)
    want = 1 if node.op_type == "ConvTranspose" else 0
    if node.op_type == "Gemm":
        trans_b = next((a.i for a in node.attribute if a.name == "transB"), 0)
        want = 0 if trans_b else 1
    elif node.op_type == "MatMul":
        want = len(data.dims) - 1
    axis = axis % len(data.dims)
    if axis != want or data.dims[axis] != scale.size:
        raise QdqStructureError(
            f"{node.op_type} {node.name!r}: per-channel weight scales run along axis {axis} "
            f"({scale.size} scales for shape {list(data.dims)}); TensorRT needs the output-channel axis {want}"
        )
