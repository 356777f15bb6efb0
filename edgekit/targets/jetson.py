"""``jetson`` target: an ONNX model ready for TensorRT on NVIDIA Jetson / GPUs.

The artifact is ONNX; the engine is built on the device (engines are not portable across GPUs or
TensorRT versions) by ``device_agents.runtimes.tensorrt``, with the builder flags recorded in the
manifest's ``target_options``.

- ``int8``: an explicit-quantization Q/DQ model as TensorRT expects it: ONNX Runtime static
  quantization, QDQ format, symmetric int8 activations and symmetric per-channel int8 weights,
  Q/DQ only on the inputs of weighted ops (Conv, ConvTranspose, Gemm, MatMul) and float biases,
  following TensorRT's Q/DQ placement recommendations. A TensorRT calibration cache computed
  from the same calibration ranges ships beside it for implicit-quantization builds of the FP32
  graph (TensorRT 10 ignores it for the Q/DQ model).
- ``fp16``: the FP32 ONNX plus the builder flag ``fp16``.
- ``fp32``: the FP32 ONNX.

TensorRT does not run here. Validation runs the artifact's ONNX under ONNX Runtime on the CPU
(``BuildResult.intermediate``); TensorRT latency and layer placement are measured on the device.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from edgekit.bundle.codec import to_data
from edgekit.bundle.manifest import Compatibility, Precision, Signature
from edgekit.compress.trt_calibration_table import CALIBRATORS, write_table
from edgekit.errors import MissingSDKError
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.targets.op_support import UnsupportedNode, raise_unsupported
from edgekit.validate.ort_runner import ort_cpu_runner

ARTIFACT = "model.onnx"
CALIBRATION_TABLE = "calibration.cache"
MIN_TENSORRT = "10.0"
CalibrationName = Literal["entropy", "percentile", "minmax"]
NOT_MEASURED = (
    "TensorRT layer info: not measured here (the engine is built on the device)",
    "TensorRT latency: not measured here",
)

# Ops TensorRT 10's ONNX parser has no importer for (onnx-tensorrt docs/operators.md, "N" rows
# that stayed unsupported through 10.x). Used only when the tensorrt package is absent here; with
# it, the parser itself is asked.
_TRT_PARSER_LACKS = frozenset(
    """
    ConcatFromSequence SequenceAt SequenceConstruct SequenceEmpty SequenceErase SequenceInsert SequenceLength
    SplitToSequence Optional OptionalGetElement OptionalHasElement StringNormalizer TfIdfVectorizer ConvInteger
    MatMulInteger QLinearConv QLinearMatMul DynamicQuantizeLinear NegativeLogLikelihoodLoss SoftmaxCrossEntropyLoss
    Unique Multinomial
    """.split()
)


@dataclass(frozen=True)
class JetsonOptions:
    """Settings of the ``jetson`` target (``--option jetson.KEY=VALUE``)."""

    workspace_mb: int = 1024  # TensorRT builder workspace bound on the device
    int8_calibration: Literal["auto", "entropy", "percentile", "minmax"] = "auto"  # auto: entropy, then others
    percentile: float = 99.999
    quantize_op_types: tuple[str, ...] = ("Conv", "ConvTranspose", "Gemm", "MatMul")
    int8_fp16_fallback: bool = True  # let layers left in float run in FP16 (builder flags int8 + fp16)
    max_calib_samples: int = 256
    calibration_table_trt_version: str = "10.0.0"  # version written in the calibration cache header

    def __post_init__(self) -> None:
        if self.workspace_mb < 16:
            raise ValueError(f"workspace_mb must be >= 16 (TensorRT's suggested minimum), got {self.workspace_mb}")
        if not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {self.percentile}")
        if self.max_calib_samples < 1:
            raise ValueError(f"max_calib_samples must be >= 1, got {self.max_calib_samples}")
        if not self.quantize_op_types:
            raise ValueError("quantize_op_types must name at least one op type")


class JetsonTarget:
    name: ClassVar[str] = "jetson"
    runtime: ClassVar[str] = "tensorrt"
    precisions: ClassVar[tuple[str, ...]] = ("int8", "fp16", "fp32")
    Options: ClassVar[type] = JetsonOptions
    static_shapes: ClassVar[bool] = True

    def check_model(self, model_path: Path) -> None:
        """Ask TensorRT's ONNX parser where it is installed; else refuse the ops its parser lacks
        and ops of custom domains (they need a TensorRT plugin)."""
        import onnx

        model = onnx.load(str(model_path), load_external_data=False)
        nodes = _parser_unsupported(model)
        tool = "TensorRT's ONNX parser"
        if nodes is None:
            tool = "TensorRT 10's ONNX parser (onnx-tensorrt operator table)"
            nodes = [
                UnsupportedNode(n.op_type, n.domain, n.name or n.output[0])
                for n in model.graph.node
                if n.domain not in ("", "ai.onnx") or n.op_type in _TRT_PARSER_LACKS
            ]
        if nodes:
            raise_unsupported(self.name, tool, model_path, nodes)

    def build(self, ctx: BuildContext) -> BuildResult:
        ort = _onnxruntime()
        opts: JetsonOptions = ctx.options
        out = ctx.out_dir / ARTIFACT
        files = {ARTIFACT: "artifact"}
        notes: list[str] = list(NOT_MEASURED)
        flags: tuple[str, ...]
        if ctx.precision == "fp32":
            shutil.copyfile(ctx.model_path, out)
            precision = Precision("fp32", "fp32", "onnx fp32; TensorRT builds the engine on the device")
            flags = ()
            intermediate, intermediate_name = ort_cpu_runner(out), "ONNX Runtime CPU on the FP32 ONNX"
        elif ctx.precision == "fp16":
            shutil.copyfile(ctx.model_path, out)
            precision = Precision("fp16", "fp16", "onnx fp32 + TensorRT builder flag fp16")
            flags = ("fp16",)
            emulated = fp16_weights_model(ctx.model_path, ctx.work_dir / "fp16-weights.onnx")
            intermediate = ort_cpu_runner(emulated)
            intermediate_name = "ONNX Runtime CPU on the FP32 ONNX with weights rounded to FP16 (activations FP32)"
            notes.append("FP16 kernels run on the device only: activations were computed in FP32 here")
        elif ctx.precision == "int8":
            method, int8_notes = self._build_int8(ctx, opts, out)
            files[CALIBRATION_TABLE] = "calibration"
            notes.extend(int8_notes)
            flags = ("int8", "fp16") if opts.int8_fp16_fallback else ("int8",)
            precision = Precision("int8", "int8", method)
            intermediate, intermediate_name = ort_cpu_runner(out), "ONNX Runtime CPU on the TensorRT Q/DQ ONNX"
        else:  # the packager checks precisions first; this guards direct callers
            raise ValueError(f"jetson target cannot build precision {ctx.precision!r}")
        artifact_signature = static_signature(out, ctx.served, ctx.static_shapes)
        target_options = to_data(opts) | {
            "builder_flags": list(flags),
            "engine": "built on the device from the ONNX artifact; cached per GPU, compute capability, "
            "TensorRT version and artifact sha256",
        }
        if CALIBRATION_TABLE in files:
            target_options["calibration_table"] = CALIBRATION_TABLE
            target_options["calibration_table_tensors"] = "tensor names of the FP32 source graph"
        return BuildResult(
            files=files,
            compatibility=Compatibility(
                runtime="tensorrt",
                runtime_version=MIN_TENSORRT,
                min_runtime_version=MIN_TENSORRT,
                arch=("aarch64", "x86_64"),
                accelerator="cuda",
            ),
            artifact_signature=artifact_signature,
            mapping=(),
            precision=precision,
            runnable_here=False,
            op_placement=None,
            notes=(*notes, f"validated with onnxruntime {ort.__version__} on the CPU"),
            target_options=target_options,
            intermediate=intermediate,
            intermediate_name=intermediate_name,
            static=True,
        )

    # -- INT8 -------------------------------------------------------------------------------
    def _build_int8(self, ctx: BuildContext, opts: JetsonOptions, out: Path) -> tuple[str, list[str]]:
        from edgekit.compress.qdq_structure import check_tensorrt_qdq
        from edgekit.validate.calib import sample_count, take

        calib = ctx.calib
        notes = []
        n = sample_count(calib)
        if n > opts.max_calib_samples:
            calib = take(calib, 0, opts.max_calib_samples)
            notes.append(f"calibrated on the first {opts.max_calib_samples} of {n} samples (jetson.max_calib_samples)")
        methods: list[CalibrationName] = (
            ["entropy", "percentile", "minmax"] if opts.int8_calibration == "auto" else [opts.int8_calibration]
        )
        tried: list[tuple[CalibrationName, Path, dict[str, tuple[float, float]], bool]] = []
        for method in methods:
            ctx.progress(f"[jetson] int8 Q/DQ, {method} calibration")
            candidate = ctx.work_dir / f"qdq-{method}.onnx"
            ranges = quantize_for_tensorrt(ctx.model_path, candidate, calib, method, opts, ctx.work_dir)
            check_tensorrt_qdq(_load(candidate))
            if ctx.evaluate is None:
                notes.append(f"{method} calibration: not compared with fp32 (no evaluation data outside the packager)")
                tried.append((method, candidate, ranges, True))
                break
            comparison = ctx.evaluate(ort_cpu_runner(candidate))
            verdict = "passed" if comparison.passed else "failed: " + "; ".join(comparison.failures)
            notes.append(f"tried {method} calibration: {comparison.summary()} on ONNX Runtime CPU ({verdict})")
            tried.append((method, candidate, ranges, comparison.passed))
            if comparison.passed:
                break
        # The first passing method, else the first tried (the packager's gate then reports the failure).
        method, candidate, ranges, _ = next((t for t in tried if t[3]), tried[0])
        shutil.copyfile(candidate, out)
        summary = check_tensorrt_qdq(_load(out))
        write_table(
            ctx.out_dir / CALIBRATION_TABLE, ranges, method=method, trt_version=opts.calibration_table_trt_version
        )
        notes.append(
            f"chose {method} calibration; Q/DQ on {len(summary.quantized_ops)} weighted ops "
            f"({summary.per_channel_weights} per-channel weights), {len(summary.float_ops)} left in float"
        )
        label = f"percentile {opts.percentile}" if method == "percentile" else method
        return f"ort-static qdq s8s8 symmetric per-channel {label} (TensorRT explicit quantization)", notes


def quantize_for_tensorrt(
    model_path: Path,
    out_path: Path,
    calib: Mapping[str, np.ndarray],
    method: CalibrationName,
    opts: JetsonOptions,
    work_dir: Path,
) -> dict[str, tuple[float, float]]:
    """Write the TensorRT-style Q/DQ model to ``out_path``; return the calibrated range of every
    float tensor of the FP32 graph (for the calibration cache). One calibration pass serves both:
    ORT's ``quantize_static`` reads the saved ranges back from its calibration cache."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

    from edgekit.compress.ort_quant import ArrayCalibrationReader
    from edgekit.validate.calib import sample_count

    if method not in CALIBRATORS:
        raise ValueError(f"calibration method {method!r} is not one of {', '.join(CALIBRATORS)}")
    ort_method = {
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
        "minmax": CalibrationMethod.MinMax,
    }[method]
    calib_options: dict[str, Any] = {"symmetric": True}
    if method == "percentile":
        calib_options["percentile"] = opts.percentile
    batch = min(16, sample_count(calib))
    calibrator = create_calibrator(
        Path(model_path),
        None,  # every op: the calibration cache covers the whole FP32 graph
        augmented_model_path=str(work_dir / f"augmented-{method}.onnx"),
        calibrate_method=ort_method,
        providers=["CPUExecutionProvider"],
        extra_options=calib_options,
    )
    calibrator.collect_data(ArrayCalibrationReader(calib, batch))  # duck-typed: ORT only calls get_next()
    tensors = calibrator.compute_data()
    cache = work_dir / f"ranges-tensorrt-{method}.json"
    save_tensors_data(tensors, cache)
    quantize_static(
        str(model_path),
        str(out_path),
        calibration_data_reader=None,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(opts.quantize_op_types),
        per_channel=True,
        activation_type=QuantType.QInt8,
        weight_type=QuantType.QInt8,
        calibrate_method=ort_method,
        calibration_providers=["CPUExecutionProvider"],
        extra_options={
            "ActivationSymmetric": True,
            "WeightSymmetric": True,
            "QuantizeBias": False,  # TensorRT takes float biases and folds them itself
            # TensorRT fuses Q/DQ with Relu/Clip itself; keep them explicit so the graph's math holds.
            "QDQKeepRemovableActivations": True,
            # Q/DQ on the inputs of weighted ops only, not on their outputs (TensorRT's recommendation).
            "OpTypesToExcludeOutputQuantization": list(opts.quantize_op_types),
        },
        calibration_cache_path=str(cache),
    )
    # Some calibrators give 0-d ranges, others 1-element arrays.
    return {
        name: (float(np.min(tensors[name].range_value[0])), float(np.max(tensors[name].range_value[1])))
        for name in tensors
    }


def static_signature(model_path: Path, served: Signature, static_shapes: Mapping[str, tuple[int, ...]]) -> Signature:
    """The artifact's interface at the static input shapes (TensorRT's optimization profile),
    output shapes as ONNX Runtime computes them for one run at those shapes."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    feed = {}
    inputs = []
    for spec in served.inputs:
        given = tuple(static_shapes.get(spec.name, spec.shape))
        if any(isinstance(d, str) for d in given):
            raise ValueError(f"input {spec.name!r}: no static shape given for {list(spec.shape)}")
        shape = tuple(int(d) for d in given)
        feed[spec.name] = np.zeros(shape, dtype=np.dtype(spec.dtype))
        inputs.append(dataclasses.replace(spec, shape=shape))
    results = session.run([o.name for o in served.outputs], feed)
    outputs = tuple(
        dataclasses.replace(spec, shape=tuple(int(d) for d in np.shape(value)))
        for spec, value in zip(served.outputs, results, strict=True)
    )
    return Signature(inputs=tuple(inputs), outputs=outputs)


def fp16_weights_model(model_path: Path, out_path: Path) -> Path:
    """A copy of the FP32 model whose float32 initializers are rounded to FP16 (kept float32)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model = onnx.load(str(model_path))
    for init in model.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            rounded = numpy_helper.to_array(init).astype(np.float16).astype(np.float32)
            init.CopyFrom(numpy_helper.from_array(rounded, init.name))
    onnx.save(model, str(out_path))
    return out_path


def _parser_unsupported(model: Any) -> list[UnsupportedNode] | None:
    """Nodes TensorRT's own parser rejects, or ``None`` when tensorrt is not installed here."""
    try:
        import tensorrt as trt
    except ImportError:
        return None
    logger = trt.Logger(trt.Logger.ERROR)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if parser.parse(model.SerializeToString()):
        return []
    by_name = {n.name or n.output[0]: n for n in model.graph.node}
    found = []
    for i in range(parser.num_errors):
        error = parser.get_error(i)
        node = by_name.get(error.node_name())
        if node is not None and error.code() == trt.ErrorCode.UNSUPPORTED_NODE:
            found.append(UnsupportedNode(node.op_type, node.domain, error.node_name()))
    return found


def _load(path: Path) -> Any:
    import onnx

    return onnx.load(str(path))


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingSDKError("onnxruntime", "host", "validating the jetson target") from exc
    return onnxruntime


__all__ = ["JetsonOptions", "JetsonTarget", "fp16_weights_model", "quantize_for_tensorrt", "static_signature"]
