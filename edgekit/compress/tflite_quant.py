"""Full-integer TFLite variants from one float conversion: calibrate once per representative
dataset, then quantize as often as needed (per-channel or per-tensor weights, ops kept in float).

TensorFlow's converter does the same in two steps (``TFLiteConverter._quantize``: the calibrator
records min/max per tensor, then ``mlir_quantize`` turns the calibrated model into int8); doing
them separately lets every candidate of the coral search share the slow part. Ops kept in float
use the MLIR quantizer's ``denylisted_nodes`` (an op's output tensor names), the mechanism of
``tf.lite.experimental.QuantizationDebugger``'s selective quantization
(``QuantizationDebugOptions(denylisted_nodes=...)`` + ``get_nondebug_quantized_model()``): the
quantizer puts DEQUANTIZE/QUANTIZE around them, and also between two of them (a float-to-float
edge rounded through int8), which ``without_float_round_trips`` bypasses.

Calibration methods:
- ``minmax``: the calibrator's min/max over the representative data (TFLite's own default);
- ``percentile``: the same calibration, then each activation tensor's recorded range narrowed
  to the ``percentile``-th / ``100 - percentile``-th percentile of its values on the float model
  (the values a few outliers would otherwise stretch the int8 range for), written back into the
  calibrated model before quantizing.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgekit.compress.onnx2tflite import FloatConversion, import_tensorflow
from edgekit.errors import UnsupportedOpError

CALIBRATIONS = ("minmax", "percentile")
PERCENTILE_SAMPLES = 32  # float-model runs that set the percentile ranges
PERCENTILE_VALUES = 50_000  # values per tensor kept over all runs (evenly strided): bounds memory


@dataclass(frozen=True)
class QuantVariant:
    """One full-integer int8 build of a float conversion."""

    calibration: str = "minmax"  # one of CALIBRATIONS
    per_channel: bool = True  # LiteRT's default; False: one scale per weight tensor
    percentile: float = 99.99
    denylisted: tuple[str, ...] = ()  # op output tensor names kept in float

    @property
    def label(self) -> str:
        text = f"int8 {self.calibration} {'per-channel' if self.per_channel else 'per-tensor'}"
        if self.calibration == "percentile":
            text += f" {self.percentile:g}"
        if self.denylisted:
            text += f", {len(self.denylisted)} op(s) in float"
        return text


def representative(conversion: FloatConversion) -> Iterator[dict[str, np.ndarray]]:
    """The calibration batches in the artifact's layout and names (what the converter feeds)."""
    for batch in conversion.batches:
        yield {link.artifact: _layout(batch[link.served], link.transpose) for link in conversion.inputs}


def calibrate(conversion: FloatConversion) -> bytes:
    """The float model with the calibrator's min/max per tensor recorded (not yet quantized)."""
    tf = import_tensorflow()
    converter = tf.lite.TFLiteConverter.from_saved_model(str(conversion.saved_model))
    converter.optimizations = [tf.lite.Optimize.DEFAULT]
    converter.representative_dataset = lambda: representative(conversion)
    converter._experimental_calibrate_only = True  # the converter's own first step (see module doc)
    try:
        return bytes(converter.convert())
    except Exception as exc:  # TF raises ConverterError / RuntimeError / ValueError alike
        raise UnsupportedOpError(f"TFLite calibration failed: {_last_line(exc)}") from exc


def with_percentile_ranges(calibrated: bytes, conversion: FloatConversion, percentile: float) -> bytes:
    """``calibrated`` with each recorded activation range narrowed to the ``percentile`` of its
    values on the float model (weights keep their exact ranges: they are not calibrated)."""
    from tensorflow.lite.tools import flatbuffer_utils

    values = float_tensor_values(conversion, PERCENTILE_SAMPLES)
    model = flatbuffer_utils.read_model_from_bytearray(bytearray(calibrated))
    lo_q, hi_q = 100.0 - percentile, percentile
    for graph in model.subgraphs:
        for tensor in graph.tensors:
            name = tensor.name.decode() if isinstance(tensor.name, bytes) else str(tensor.name)
            q = tensor.quantization
            if q is None or q.min is None or q.max is None or name not in values or len(q.min) != 1:
                continue
            v = values[name]
            lo, hi = float(np.percentile(v, lo_q)), float(np.percentile(v, hi_q))
            # never wider than min/max, and the range must hold 0 (the quantizer's own rule)
            q.min[0] = min(max(lo, float(q.min[0])), 0.0)
            q.max[0] = max(min(hi, float(q.max[0])), 0.0)
    return bytes(flatbuffer_utils.convert_object_to_bytearray(model))


def quantize_calibrated(calibrated: bytes, variant: QuantVariant) -> bytes:
    """int8 weights and activations, int8 inputs/outputs; ``variant.denylisted`` ops stay float.
    Where a denylisted op writes a model output (a head's tail kept in float), the outputs are
    float32: an int8 output would put the one scale back on the tensor the float tail kept apart
    (a YOLO output of pixel boxes and 0-1 scores)."""
    tf = import_tensorflow()
    from tensorflow.lite.python import convert

    float_out = bool(set(variant.denylisted) & set(output_names(calibrated)))

    printed = io.StringIO()  # the MLIR quantizer prints its settings
    try:
        with contextlib.redirect_stdout(printed):
            model = convert.mlir_quantize(
                calibrated,
                disable_per_channel=not variant.per_channel,
                input_data_type=tf.int8,
                output_data_type=tf.float32 if float_out else tf.int8,
                denylisted_nodes=list(variant.denylisted) or None,
            )
    except Exception as exc:  # the wrapper raises ConverterError / RuntimeError alike
        raise UnsupportedOpError(f"TFLite int8 quantization ({variant.label}) failed: {_last_line(exc)}") from exc
    return without_float_round_trips(bytes(model)) if variant.denylisted else bytes(model)


def without_float_round_trips(model: bytes) -> bytes:
    """``model`` with every QUANTIZE -> DEQUANTIZE pair between two float tensors bypassed: the
    consumers of the DEQUANTIZE read the float tensor the QUANTIZE read.

    The MLIR quantizer keeps a denylisted op in float but still rounds its output through int8
    when the consumer is denylisted too: on YOLOv8n (onnx2tf), with the class LOGISTIC and the
    output CONCATENATION both denylisted, the float sigmoid went QUANTIZE (LOGISTIC's fixed int8
    output scale, 1/256) -> DEQUANTIZE -> float CONCATENATION, and class scores peaking at 0.015
    came out as 0 to 3/256 whatever was kept in float. A QUANTIZE whose int8 tensor other
    (quantized) ops read stays for them; only the pair's float-to-float path is bypassed."""
    from tensorflow.lite.tools import flatbuffer_utils

    schema = flatbuffer_utils.schema_fb
    obj = flatbuffer_utils.read_model_from_bytearray(bytearray(model))
    kind = [max(c.builtinCode, c.deprecatedBuiltinCode) for c in obj.operatorCodes]
    changed = False
    for graph in obj.subgraphs:
        is_float = [t.type == schema.TensorType.FLOAT32 for t in graph.tensors]
        quantized_from = {  # int8 tensor -> the float tensor a QUANTIZE made it from
            int(op.outputs[0]): int(op.inputs[0])
            for op in graph.operators
            if kind[op.opcodeIndex] == schema.BuiltinOperator.QUANTIZE and is_float[int(op.inputs[0])]
        }
        bypass: dict[int, int] = {}  # a DEQUANTIZE's float output -> the float tensor before the pair
        kept = []
        outputs = {int(i) for i in graph.outputs}
        for op in graph.operators:
            if kind[op.opcodeIndex] == schema.BuiltinOperator.DEQUANTIZE:
                src, out = int(op.inputs[0]), int(op.outputs[0])
                if src in quantized_from and is_float[out] and out not in outputs:
                    bypass[out] = quantized_from[src]
                    continue
            kept.append(op)
        if not bypass:
            continue
        changed = True
        for op in kept:
            op.inputs = [bypass.get(int(i), int(i)) for i in op.inputs]
        read = {int(i) for op in kept for i in op.inputs} | outputs
        graph.operators = [  # a QUANTIZE only the bypassed DEQUANTIZEs read
            op
            for op in kept
            if not (kind[op.opcodeIndex] == schema.BuiltinOperator.QUANTIZE and int(op.outputs[0]) not in read)
        ]
    return bytes(flatbuffer_utils.convert_object_to_bytearray(obj)) if changed else model


def op_outputs(model: bytes) -> list[tuple[str, str, tuple[str, ...]]]:
    """(op type, first output tensor name, activation input tensor names) in execution order."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    it = Interpreter(
        model_content=model, experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    produced = {int(d["index"]) for d in it.get_signature_runner().get_input_details().values()}
    ops = []
    for op in it._get_ops_details():  # the interpreter's only op listing (private API)
        outs = [int(i) for i in op["outputs"]]
        ins = [int(i) for i in op["inputs"] if int(i) in produced]
        names = tuple(str(it._get_tensor_details(i, 0)["name"]) for i in ins)
        ops.append((str(op["op_name"]), str(it._get_tensor_details(outs[0], 0)["name"]), names))
        produced.update(outs)
    return ops


def float_tensor_values(conversion: FloatConversion, samples: int) -> dict[str, np.ndarray]:
    """Every tensor of the float model over up to ``samples`` calibration samples (flattened)."""
    return tensor_values(conversion.float32, list(representative(conversion)), samples)


def tensor_values(model: bytes, feeds: Sequence[Mapping[str, np.ndarray]], samples: int) -> dict[str, np.ndarray]:
    """Every tensor ``model`` computes (dequantized where it is quantized), over the feeds given
    in the float artifact layout (quantized here for an int8-input model), flattened and strided
    to at most about ``PERCENTILE_VALUES`` values per tensor."""
    parts: dict[str, list[np.ndarray]] = {}
    per_run = max(1, PERCENTILE_VALUES // max(1, min(samples, len(feeds))))
    for run in iter_tensor_values(model, feeds, samples):
        for name, x in run.items():
            flat = x.ravel()
            parts.setdefault(name, []).append(flat[:: max(1, len(flat) // per_run)].astype(np.float32))
    return {name: np.concatenate(chunks) for name, chunks in parts.items()}


def iter_tensor_values(
    model: bytes, feeds: Sequence[Mapping[str, np.ndarray]], samples: int
) -> Iterator[dict[str, np.ndarray]]:
    """Per feed (up to ``samples`` samples), every tensor ``model`` computes, dequantized to
    float32 where it is quantized, in its own shape (one feed's tensors are alive at a time)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    it = Interpreter(
        model_content=model,
        experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES,
        experimental_preserve_all_tensors=True,
    )
    runner = it.get_signature_runner()
    inputs = runner.get_input_details()
    details = [t for t in it.get_tensor_details() if np.issubdtype(t["dtype"], np.number) and len(t["shape"])]
    seen = 0
    for feed in feeds:
        if seen >= samples:
            break
        runner(**{k: _to_input(v, inputs[k]) for k, v in feed.items()})
        seen += len(next(iter(feed.values())))
        values: dict[str, np.ndarray] = {}
        for t in details:
            try:
                v = it.get_tensor(t["index"])
            except ValueError:  # a tensor without data (unused)
                continue
            scale, zero = t["quantization"]
            values[str(t["name"])] = (v.astype(np.float32) - zero) * scale if scale else v.astype(np.float32)
        yield values


def output_names(model: bytes) -> tuple[str, ...]:
    """The model's output tensor names (its signature's)."""
    from ai_edge_litert.interpreter import Interpreter

    runner = Interpreter(model_content=model).get_signature_runner()
    return tuple(str(d["name"]) for d in runner.get_output_details().values())


def _to_input(x: np.ndarray, detail: Mapping[str, Any]) -> np.ndarray:
    scale, zero = detail["quantization"]
    dtype = np.dtype(detail["dtype"])
    if not scale:
        return np.ascontiguousarray(x.astype(dtype))
    info = np.iinfo(dtype)
    q: np.ndarray = np.clip(np.round(x / scale + zero), info.min, info.max).astype(dtype)
    return q


def _layout(arr: np.ndarray, perm: tuple[int, ...] | None) -> np.ndarray:
    return np.ascontiguousarray((np.transpose(arr, perm) if perm else arr).astype(np.float32))


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__
