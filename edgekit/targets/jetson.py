"""``jetson`` target: an ONNX model ready for TensorRT on NVIDIA Jetson / GPUs.

The artifact is ONNX; the engine is built on the device (engines are not portable across GPUs or
TensorRT versions) by ``device_agents.runtimes.tensorrt``, with the builder flags recorded in the
manifest's ``target_options``.

The target describes candidates; the optimisation engine (``edgekit.optimize``) builds them, gates
them and chooses:

- ``fp32``: the FP32 ONNX (the baseline); ``fp16``: the FP32 ONNX plus the builder flag ``fp16``;
- ``int8``: explicit-quantization Q/DQ models as TensorRT takes them (ONNX Runtime static
  quantization, QDQ format, symmetric int8 activations, symmetric per-channel int8 weights, float
  biases), one per Q/DQ placement (``weighted-inputs``: Q/DQ only on the inputs of Conv /
  ConvTranspose / Gemm / MatMul; ``all``: on every op ONNX Runtime quantizes, residual Add and
  Concat inputs included), entropy calibration first and percentile / minmax as refinements of a
  placement that missed the budget. A TensorRT calibration cache from the same calibration pass
  ships beside it for implicit-quantization builds of the FP32 graph (TensorRT 10 ignores it for
  the Q/DQ model);
- mixed precision: the most sensitive layers (``edgekit.optimize.sensitivity``) are left without
  Q/DQ; TensorRT runs them in FP16 on the device (builder flags ``int8`` + ``fp16``).

TensorRT does not run here: every candidate is gated on its artifact under ONNX Runtime on the CPU
(``Built.open`` is None, ``Built.intermediate`` runs the Q/DQ ONNX), latency is "not measured here",
and ``auto`` ships the candidate expected fastest on the device class (``DEVICE_RANK``) within the
budget, unless a device profile (``edgekit package --device-profile``) gives measured latencies.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from edgekit.bundle.codec import to_data
from edgekit.bundle.manifest import Compatibility, Precision, Signature
from edgekit.compress.trt_calibration_table import CALIBRATORS, write_table
from edgekit.errors import MissingSDKError
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, Refinement
from edgekit.optimize.head_scope import head_offer
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.targets.op_support import UnsupportedNode, raise_unsupported
from edgekit.targets.shape_profile import PROFILE_KEY, optimization_profile, profile_data, profiled_signature
from edgekit.validate.ort_runner import ort_cpu_runner

ARTIFACT = "model.onnx"
CALIBRATION_TABLE = "calibration.cache"
FP16_EMULATION = "fp16-weights.onnx"  # in the candidate's folder: the fp16 candidate's intermediate
MIN_TENSORRT = "10.0"
CalibrationName = Literal["entropy", "percentile", "minmax"]
PlacementName = Literal["weighted-inputs", "all"]
PLACEMENTS: tuple[PlacementName, ...] = ("weighted-inputs", "all")
CALIBRATIONS: tuple[CalibrationName, ...] = ("entropy", "percentile", "minmax")
NOT_MEASURED = (
    "TensorRT layer info: not measured here (the engine is built on the device)",
    "TensorRT latency: not measured here",
)
# Expected speed order on Jetson-class GPUs, lower = faster: TensorRT's developer guide, "Reduced
# Precision" / "Working with Quantized Types" (https://docs.nvidia.com/deeplearning/tensorrt/latest/
# inference-library/work-quantized-types.html): lower precision needs less memory bandwidth and runs
# on faster kernels (INT8 and FP16 Tensor Cores on Xavier / Orin), so INT8 < FP16 < FP32. A mixed
# candidate runs its layers without Q/DQ in FP16, so it ranks after pure INT8 and before FP16. The
# guide ranks no Q/DQ placement above the other: both placements share rank 0 (the smaller artifact,
# then the more accurate, wins the tie). A device profile replaces this order with measurements.
DEVICE_RANK = {"int8": 0, "int8-mixed": 1, "fp16": 2, "fp32": 3}

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
    """Settings of the ``jetson`` target (``--option jetson.KEY=VALUE``). ``auto`` = let the search choose."""

    workspace_mb: int = 1024  # TensorRT builder workspace bound on the device
    int8_calibration: Literal["auto", "entropy", "percentile", "minmax"] = "auto"  # auto: entropy, then others
    percentile: float = 99.999
    # auto: both placements; weighted-inputs: Q/DQ on the inputs of quantize_op_types only; all: every op
    qdq_placement: Literal["auto", "weighted-inputs", "all"] = "auto"
    quantize_op_types: tuple[str, ...] = ("Conv", "ConvTranspose", "Gemm", "MatMul")
    int8_fp16_fallback: bool = True  # let layers left in float run in FP16 (builder flags int8 + fp16)
    max_calib_samples: int = 256
    calibration_table_trt_version: str = "10.0.0"  # version written in the calibration cache header
    # the TensorRT optimization profile (edgekit.targets.shape_profile; --batch): [MIN, OPT, MAX] of the
    # dynamic batch axis, and NAME=MIN:OPT:MAX shapes (1x3x320x320:4x3x480x480:8x3x640x640) for other axes
    batch: tuple[int, ...] = ()
    profile_shapes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.workspace_mb < 16:
            raise ValueError(f"workspace_mb must be >= 16 (TensorRT's suggested minimum), got {self.workspace_mb}")
        if not 50.0 < self.percentile <= 100.0:
            raise ValueError(f"percentile must be in (50, 100], got {self.percentile}")
        if self.max_calib_samples < 1:
            raise ValueError(f"max_calib_samples must be >= 1, got {self.max_calib_samples}")
        if not self.quantize_op_types:
            raise ValueError("quantize_op_types must name at least one op type")
        if self.batch and (len(self.batch) != 3 or not 1 <= self.batch[0] <= self.batch[1] <= self.batch[2]):
            raise ValueError(f"batch must be [MIN, OPT, MAX] with 1 <= MIN <= OPT <= MAX, got {list(self.batch)}")


class JetsonTarget:
    name: ClassVar[str] = "jetson"
    runtime: ClassVar[str] = "tensorrt"
    precisions: ClassVar[tuple[str, ...]] = ("int8", "fp16", "fp32", "auto")
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

    # -- candidates ---------------------------------------------------------------------------
    def candidates(self, ctx: BuildContext) -> CandidatePlan:
        opts: JetsonOptions = ctx.options
        optimization_profile(ctx.served, ctx.static_shapes, opts.batch, opts.profile_shapes)  # refused before builds
        want = ctx.precision
        auto = want == "auto"
        prepared = ctx.model_path
        first: list[Candidate] = [_float_candidate("fp32", prepared)]
        refinements: list[Refinement] = []
        skipped: tuple[tuple[str, str], ...] = ()
        if auto or want == "fp16":
            first.append(_float_candidate("fp16", prepared))
        if auto or want == "int8":
            placements = PLACEMENTS if opts.qdq_placement == "auto" else (opts.qdq_placement,)
            methods = CALIBRATIONS if opts.int8_calibration == "auto" else (opts.int8_calibration,)
            plains = [_int8_candidate(prepared, opts, placement, methods[0]) for placement in placements]
            for placement, plain in zip(placements, plains, strict=True):
                first.append(plain)
                refinements.extend(
                    Refinement(_int8_candidate(prepared, opts, placement, method), of=plain.name)
                    for method in methods[1:]
                )
            if auto:  # a detector's / segmenter's decode without Q/DQ (FP16 on the device), ranked as mixed INT8
                offered, skipped = head_offer(plains[0], prepared, ctx.heads)
                first.extend(offered)
        return CandidatePlan(first=tuple(first), refinements=tuple(refinements), skipped=skipped)

    def finish(self, ctx: BuildContext, built: Built, built_dir: Path) -> BuildResult:
        """The chosen candidate's files in ``ctx.out_dir``, described for the manifest."""
        ort = _onnxruntime()
        opts: JetsonOptions = ctx.options
        for path in built.files:
            shutil.copyfile(built_dir / path, ctx.out_dir / path)
        out = ctx.out_dir / ARTIFACT
        weights = built.precision.weights
        flags: tuple[str, ...] = ()
        if weights == "int8":
            flags = ("int8", "fp16") if opts.int8_fp16_fallback else ("int8",)
            intermediate = ort_cpu_runner(_int8_stand_in(out, ctx.work_dir, built.excluded_nodes, opts))
            intermediate_name = "ONNX Runtime CPU on the TensorRT Q/DQ ONNX"
            if built.excluded_nodes and opts.int8_fp16_fallback:
                intermediate_name += " (layers without Q/DQ: weights rounded to FP16)"
        elif weights == "fp16":
            flags = ("fp16",)
            intermediate = ort_cpu_runner(fp16_weights_model(out, ctx.work_dir / FP16_EMULATION))
            intermediate_name = "ONNX Runtime CPU on the FP32 ONNX with weights rounded to FP16 (activations FP32)"
        else:
            intermediate, intermediate_name = ort_cpu_runner(out), "ONNX Runtime CPU on the FP32 ONNX"
        target_options = to_data(opts) | {
            "builder_flags": list(flags),
            "engine": "built on the device from the ONNX artifact; cached per GPU, compute capability, "
            "TensorRT version and artifact sha256",
        }
        profile = optimization_profile(ctx.served, ctx.static_shapes, opts.batch, opts.profile_shapes)
        if profile is not None:  # the device builds the engine for these ranges; they stay dynamic when served
            target_options[PROFILE_KEY] = profile_data(profile)
        if CALIBRATION_TABLE in built.files:
            target_options["calibration_table"] = CALIBRATION_TABLE
            target_options["calibration_table_tensors"] = "tensor names of the FP32 source graph"
        return BuildResult(
            files=dict(built.files),
            compatibility=Compatibility(
                runtime="tensorrt",
                runtime_version=MIN_TENSORRT,
                min_runtime_version=MIN_TENSORRT,
                arch=("aarch64", "x86_64"),
                accelerator="cuda",
            ),
            artifact_signature=static_signature(out, ctx.served, ctx.static_shapes)
            if profile is None
            else profiled_signature(ctx.served, target_options),
            mapping=(),
            precision=built.precision,
            runnable_here=False,
            op_placement=None,
            notes=(*NOT_MEASURED, *built.notes, f"validated with onnxruntime {ort.__version__} on the CPU"),
            target_options=target_options,
            intermediate=intermediate,
            intermediate_name=intermediate_name,
            static=profile is None,
        )


# -- candidate builders -------------------------------------------------------------------------


def _float_candidate(precision: Literal["fp32", "fp16"], prepared: Path) -> Candidate:
    """The FP32 ONNX as the artifact; ``fp16`` adds TensorRT's fp16 builder flag and is gated with
    its weights rounded to FP16 (the FP16 kernels themselves run on the device only)."""

    def build(space: BuildSpace) -> Built:
        out = space.work_dir / ARTIFACT
        shutil.copyfile(prepared, out)
        if precision == "fp32":
            prec = Precision("fp32", "fp32", "onnx fp32; TensorRT builds the engine on the device")
            return Built({ARTIFACT: "artifact"}, "tensorrt", prec, open=None, intermediate=ort_cpu_runner(out))
        emulated = fp16_weights_model(out, space.work_dir / FP16_EMULATION)
        return Built(
            {ARTIFACT: "artifact"},
            "tensorrt",
            Precision("fp16", "fp16", "onnx fp32 + TensorRT builder flag fp16"),
            open=None,
            intermediate=ort_cpu_runner(emulated),
            notes=("FP16 kernels run on the device only: activations were computed in FP32 here",),
        )

    return Candidate(
        name=f"tensorrt {precision}",
        precision=precision,
        runtime="tensorrt",
        build=build,
        settings={"recipe": f"onnx {precision}"},
        family=f"tensorrt {precision}",
        baseline=precision == "fp32",
        device_rank=DEVICE_RANK[precision],
    )


def _int8_candidate(
    prepared: Path,
    opts: JetsonOptions,
    placement: PlacementName,
    method: CalibrationName,
    exclude: tuple[str, ...] = (),
) -> Candidate:
    """One TensorRT Q/DQ model. ``exclude``: layers left without Q/DQ (they run FP16 on the device)."""
    label = f"percentile {opts.percentile}" if method == "percentile" else method
    name = f"tensorrt int8 q/dq {placement} {label}"
    if exclude:
        name += f", {len(exclude)} layer(s) without q/dq"

    def build(space: BuildSpace) -> Built:
        from edgekit.compress.qdq_structure import check_tensorrt_qdq
        from edgekit.validate.calib import sample_count, take

        calib = space.calib
        notes: list[str] = []
        n = sample_count(calib)
        if n > opts.max_calib_samples:
            calib = take(calib, 0, opts.max_calib_samples)
            notes.append(f"calibrated on the first {opts.max_calib_samples} of {n} samples (jetson.max_calib_samples)")
        out = space.work_dir / ARTIFACT
        ranges = quantize_for_tensorrt(prepared, out, calib, method, opts, space.work_dir, placement, exclude)
        summary = check_tensorrt_qdq(_load(out))
        write_table(
            space.work_dir / CALIBRATION_TABLE, ranges, method=method, trt_version=opts.calibration_table_trt_version
        )
        notes.append(
            f"{method} calibration, Q/DQ placement {placement}: Q/DQ on {len(summary.quantized_ops)} weighted ops "
            f"({summary.per_channel_weights} per-channel weights), {len(summary.float_ops)} left in float"
        )
        if exclude:
            fp16 = "FP16 on the device (builder flags int8 + fp16)" if opts.int8_fp16_fallback else "FP32 on the device"
            here = "their weights rounded to FP16, activations FP32" if opts.int8_fp16_fallback else "FP32"
            notes.append(
                f"mixed precision: {len(exclude)} layer(s) left without Q/DQ run in {fp16}: {', '.join(exclude)}; "
                f"validated here under ONNX Runtime with {here}"
            )
        kept = f", {len(exclude)} layer(s) without Q/DQ" if exclude else ""
        method_text = (
            f"ort-static qdq s8s8 symmetric per-channel {label}, Q/DQ placement {placement}{kept} "
            "(TensorRT explicit quantization)"
        )
        return Built(
            files={ARTIFACT: "artifact", CALIBRATION_TABLE: "calibration"},
            runtime="tensorrt",
            precision=Precision("int8", "int8", method_text),
            open=None,
            intermediate=ort_cpu_runner(_int8_stand_in(out, space.work_dir, exclude, opts)),
            notes=tuple(notes),
            excluded_nodes=exclude,
        )

    def rank(space: BuildSpace, built: Built) -> list[tuple[tuple[str, ...], float]]:
        from edgekit.optimize.sensitivity import rank_qdq_layers

        return rank_qdq_layers(prepared, space.work_dir / ARTIFACT, space.calib, space.work_dir, space.calib_batch)

    settings: dict[str, Any] = {"placement": placement, "calibration": method, "exclude": list(exclude)}
    if method == "percentile":
        settings["percentile"] = opts.percentile
    if placement == "weighted-inputs":
        settings["op_types"] = list(opts.quantize_op_types)
    return Candidate(
        name=name,
        precision="int8",
        runtime="tensorrt",
        build=build,
        settings=settings,
        family=f"tensorrt int8 q/dq {placement}",
        device_rank=DEVICE_RANK["int8-mixed" if exclude else "int8"],
        exclude=None if exclude else (lambda nodes: _int8_candidate(prepared, opts, placement, method, nodes)),
        rank_layers=None if exclude else rank,
    )


def _int8_stand_in(qdq: Path, work_dir: Path, exclude: Sequence[str], opts: JetsonOptions) -> Path:
    """What the Q/DQ model is gated with here: itself, or with the weights of the layers left
    without Q/DQ rounded to FP16 where TensorRT runs those layers in FP16 (activations stay FP32)."""
    if not exclude or not opts.int8_fp16_fallback:
        return qdq
    return fp16_weights_model(qdq, work_dir / "qdq-fp16-layers.onnx", exclude)


def quantize_for_tensorrt(
    model_path: Path,
    out_path: Path,
    calib: Mapping[str, np.ndarray],
    method: CalibrationName,
    opts: JetsonOptions,
    work_dir: Path,
    placement: PlacementName = "weighted-inputs",
    exclude: Sequence[str] = (),
) -> dict[str, tuple[float, float]]:
    """Write the TensorRT-style Q/DQ model to ``out_path``; return the calibrated range of every
    float tensor of the FP32 graph (for the calibration cache). One calibration pass serves both:
    ORT's ``quantize_static`` reads the saved ranges back from its calibration cache.

    Placement follows TensorRT's developer guide, "Q/DQ Layer-Placement Recommendations"
    (https://docs.nvidia.com/deeplearning/tensorrt/latest/inference-library/quantized-types-explicit-quantization.html):
    quantize all inputs of weighted operations (Convolution, Transposed Convolution, GEMM) and, by
    default, not their outputs (``weighted-inputs``); the same guide asks for Q/DQ on the residual
    input of skip connections so TensorRT can fuse the Add into the INT8 convolution, which the
    ``all`` placement gives (Q/DQ on every op ONNX Runtime quantizes, as pytorch-quantization's
    default of quantizing every input of supported layers). ``exclude``: nodes left without Q/DQ."""
    from onnxruntime.quantization import CalibrationMethod, QuantFormat, QuantType, quantize_static

    from edgekit.compress.ort_quant import calibrate_to_cache
    from edgekit.validate.calib import even_batch, sample_count

    if method not in CALIBRATORS:
        raise ValueError(f"calibration method {method!r} is not one of {', '.join(CALIBRATORS)}")
    if placement not in PLACEMENTS:
        raise ValueError(f"Q/DQ placement {placement!r} is not one of {', '.join(PLACEMENTS)}")
    ort_method = {
        "entropy": CalibrationMethod.Entropy,
        "percentile": CalibrationMethod.Percentile,
        "minmax": CalibrationMethod.MinMax,
    }[method]
    calib_options: dict[str, Any] = {"symmetric": True}
    if method == "percentile":
        calib_options["percentile"] = opts.percentile
    batch = even_batch(sample_count(calib))
    cache = work_dir / f"ranges-tensorrt-{method}.json"
    # every op: the calibration cache covers the whole FP32 graph; entropy with TensorRT's histogram
    tensors = calibrate_to_cache(Path(model_path), calib, batch, method, cache, calib_options, work_dir)
    weighted = placement == "weighted-inputs"
    quantize_static(
        str(model_path),
        str(out_path),
        calibration_data_reader=None,
        quant_format=QuantFormat.QDQ,
        op_types_to_quantize=list(opts.quantize_op_types) if weighted else None,  # None: every op ORT quantizes
        nodes_to_exclude=list(exclude),
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
            # weighted-inputs: Q/DQ on the inputs of weighted ops only, not on their outputs
            "OpTypesToExcludeOutputQuantization": list(opts.quantize_op_types) if weighted else [],
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


def fp16_weights_model(model_path: Path, out_path: Path, nodes: Sequence[str] | None = None) -> Path:
    """A copy of the model whose float32 initializers are rounded to FP16 (kept float32).
    ``nodes``: only the initializers those nodes read (the layers a Q/DQ model leaves in float)."""
    import onnx
    from onnx import TensorProto, numpy_helper

    model = onnx.load(str(model_path))
    only = None if nodes is None else {i for n in model.graph.node if n.name in set(nodes) for i in n.input}
    for init in model.graph.initializer:
        if init.data_type == TensorProto.FLOAT and (only is None or init.name in only):
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


__all__ = [
    "DEVICE_RANK",
    "JetsonOptions",
    "JetsonTarget",
    "fp16_weights_model",
    "quantize_for_tensorrt",
    "static_signature",
]
