"""Op sensitivity of a full-integer TFLite model: each quantized op's measured contribution to the
error against the float TFLite model it was quantized from, on calibration samples.

The same measure as ``edgekit.optimize.sensitivity`` for Q/DQ ONNX: both models run with every
tensor kept (the quantizer keeps the float model's tensor names), an op's score is the relative
error of its dequantized output minus the largest relative error of the activations it reads —
the error the op itself adds, not what it inherited. Its group is the op and the ops producing
its inputs up to the nearest compute op (through reshapes, pooling, ...): an op kept in float
still reads an int8 tensor unless its producers are kept in float too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edgekit.compress.tflite_quant import op_outputs, tensor_values

COMPUTE_OPS = frozenset(
    {"CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV", "FULLY_CONNECTED", "BATCH_MATMUL", "ADD", "MUL", "SUB"}
)
NOT_QUANTIZED = frozenset({"QUANTIZE", "DEQUANTIZE"})
SAMPLES = 8


def rank_ops(
    float_model: bytes, quantized: bytes, feeds: Sequence[Mapping[str, np.ndarray]], samples: int = SAMPLES
) -> list[tuple[tuple[str, ...], float]]:
    """(op output names to keep in float together, score), most sensitive first. ``feeds``: float
    inputs in the artifact's layout and names."""
    ops = [op for op in op_outputs(quantized) if op[0] not in NOT_QUANTIZED]
    ref = tensor_values(float_model, feeds, samples)
    got = tensor_values(quantized, feeds, samples)
    err = {n: _rel_err(got[n], ref[n]) for n in got if n in ref and got[n].shape == ref[n].shape}
    producer = {out: (kind, ins) for kind, out, ins in ops}
    scored = []
    for _kind, out, ins in ops:
        if out not in err:
            continue
        inherited = max((err.get(i, 0.0) for i in ins), default=0.0)
        group = (out, *_upstream(ins, producer))
        scored.append((tuple(dict.fromkeys(group)), max(0.0, err[out] - inherited)))
    return sorted(scored, key=lambda s: -s[1])


def _upstream(tensors: Sequence[str], producer: Mapping[str, tuple[str, tuple[str, ...]]], depth: int = 6) -> list[str]:
    """The ops producing ``tensors``, followed up through non-compute ops to the nearest compute op."""
    found: list[str] = []
    for t in tensors:
        name = t
        for _ in range(depth):
            if name not in producer:
                break  # a graph input
            kind, ins = producer[name]
            found.append(name)
            if kind in COMPUTE_OPS or not ins:
                break
            name = ins[0]
    return found


def _rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(got - ref) / max(float(np.linalg.norm(ref)), 1e-12))
