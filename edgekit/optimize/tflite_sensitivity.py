"""Op sensitivity of a full-integer TFLite model: each quantized op's measured contribution to the
error against the float TFLite model it was quantized from, on calibration samples.

The same measure as ``edgekit.optimize.sensitivity`` for Q/DQ ONNX: both models run sample by
sample with every tensor kept (the quantizer keeps the float model's tensor names) and each
tensor's error is accumulated (``validate.metrics.ChannelStats``: per-channel sums, no tensor is
kept); an op's score is the error of its dequantized output minus the largest error of the
activations it reads — the error the op itself adds, not what it inherited. The error is the
relative error or, where the model has an output with channels (what the gate judges per channel),
the worst channel's error where that is larger: a CONCATENATION joining boxes in pixels with 0-1
scores under one int8 scale crushes the scores while its global error stays small. Channels are
the gate's axis (``validate.metrics.channel_axis``) and, for a 4-D tensor, also the last axis
(TFLite's NHWC; onnx2tf transposes back to NCHW where the graph needs it): the worse of the two.

Groups: an op with the ops producing its inputs up to the nearest compute op (through reshapes,
pooling, ...): an op kept in float still reads an int8 tensor unless its producers are kept in
float too. A CONCATENATION is grouped instead with the ops after it when they are all non-compute
ops up to the model's outputs (a head's tail): its inputs keep their own int8 scales, and the tail
kept in float (with float outputs, ``tflite_quant.quantize_calibrated``) never puts one scale back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from edgekit.compress.tflite_quant import iter_tensor_values, op_outputs, output_names
from edgekit.validate.metrics import ChannelStats, channel_axis

COMPUTE_OPS = frozenset(
    {"CONV_2D", "DEPTHWISE_CONV_2D", "TRANSPOSE_CONV", "FULLY_CONNECTED", "BATCH_MATMUL", "ADD", "MUL", "SUB"}
)
JOIN_OPS = frozenset({"CONCATENATION", "PACK"})
NOT_QUANTIZED = frozenset({"QUANTIZE", "DEQUANTIZE"})
SAMPLES = 8
TAIL_DEPTH = 8  # ops followed from a CONCATENATION towards the outputs


def rank_ops(
    float_model: bytes, quantized: bytes, feeds: Sequence[Mapping[str, np.ndarray]], samples: int = SAMPLES
) -> list[tuple[tuple[str, ...], float]]:
    """(op output names to keep in float together, score), most sensitive first. ``feeds``: float
    inputs in the artifact's layout and names."""
    all_ops = op_outputs(quantized)
    ops = [op for op in all_ops if op[0] not in NOT_QUANTIZED]
    stats = _compare(float_model, quantized, feeds, samples)
    outputs = set(output_names(quantized))
    channels = any(s.per_channel for n, both in stats.items() if n in outputs for s in both)
    err = {n: max(s.error() if channels else s.relative_error() for s in both) for n, both in stats.items()}
    producer = {out: (kind, ins) for kind, out, ins in ops}
    consumers: dict[str, list[tuple[str, str]]] = {}
    for kind, out, ins in all_ops:
        for i in ins:
            consumers.setdefault(i, []).append((kind, out))
    scored = []
    for kind, out, ins in ops:
        if out not in err:
            continue
        inherited = max((err.get(i, 0.0) for i in ins), default=0.0)
        if kind in JOIN_OPS:
            group = (out, *_tail(out, consumers))
        else:
            group = (out, *_upstream(ins, producer))
        scored.append((tuple(dict.fromkeys(group)), max(0.0, err[out] - inherited)))
    return sorted(scored, key=lambda s: -s[1])


def _compare(
    float_model: bytes, quantized: bytes, feeds: Sequence[Mapping[str, np.ndarray]], samples: int
) -> dict[str, list[ChannelStats]]:
    """Per tensor both models compute with the same shape, its accumulated ``ChannelStats`` per
    channel axis that may hold the channels."""
    stats: dict[str, list[ChannelStats]] = {}
    mismatched: set[str] = set()
    runs = zip(
        iter_tensor_values(float_model, feeds, samples), iter_tensor_values(quantized, feeds, samples), strict=True
    )
    for ref, got in runs:
        for name, g in got.items():
            r = ref.get(name)
            if r is None or name in mismatched:
                continue
            if r.shape != g.shape:
                mismatched.add(name)
                stats.pop(name, None)
                continue
            axes = (1, 3) if r.ndim == 4 else (channel_axis(r.shape),)
            for s, axis in zip(stats.setdefault(name, [ChannelStats() for _ in axes]), axes, strict=True):
                s.add(r, g, axis)
    return stats


def _tail(out: str, consumers: Mapping[str, list[tuple[str, str]]]) -> list[str]:
    """The ops after the op writing ``out`` when they are all non-compute ops up to the outputs
    (QUANTIZE/DEQUANTIZE are followed, not listed), else none."""
    found: list[str] = []
    frontier = [out]
    while frontier:
        for kind, nxt in consumers.get(frontier.pop(), []):
            if kind in COMPUTE_OPS or len(found) >= TAIL_DEPTH:
                return []
            if nxt not in found:
                if kind not in NOT_QUANTIZED:
                    found.append(nxt)
                frontier.append(nxt)
    return found


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
