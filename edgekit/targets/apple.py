"""``apple`` target: a Core ML ML Program (``.mlpackage``) for Apple Silicon / iOS.

Path: ONNX -> frozen graph (input shapes fixed, constants folded, onnxslim; ``edgekit.compress.freeze``)
-> PyTorch (onnx2torch) ->
``torch.jit.trace`` (or, where tracing raises or coremltools refuses the traced graph, ``torch.export``
lowered to core ATen; ``apple_graph.convert_module``) -> ``coremltools.convert(convert_to="mlprogram")``,
then weight compression:

- ``fp32`` / ``fp16``: compute precision of the ML Program (I/O stay float32);
- ``int8-weights``: ``linear_quantize_weights`` (symmetric int8, per output channel);
- ``palettize6`` / ``palettize4``: ``palettize_weights`` (k-means LUT of 64 / 16 entries per weight,
  or per group of output channels with ``palettize_granularity=per_grouped_channel`` on iOS18+;
  needs scikit-learn).

The target describes candidates; the optimisation engine (``edgekit.optimize``) builds and
chooses. Under ``--precision auto`` every precision above is a candidate (fp32 is skipped: the
Neural Engine computes in fp16) plus W8A8 (``int8``: ``build_w8a8``), each judged by the
intermediate carrying its own package's weights; an explicit precision builds only that one.
Core ML latency cannot be measured here, so ``auto`` ships the candidate Apple's documentation
ranks fastest within the budget (``device_rank``) and the report says latency was not measured.

Core ML prediction does not run on Linux. The package is checked structurally (spec, inputs and
outputs, compression ops really present) and numerically through the torch graph it was
converted from, with the weights the saved package holds (LUT + indices / int8 + scales,
decompressed by coremltools; scales coremltools folded into a weight divided back out, see
``edgekit.compress.mlpackage_weights``) loaded into it and activations rounded to FP16 at every module
output, as Core ML computes in FP16. Op placement comes from the MIL program (op types), with the
compute device measured only on macOS (``MLComputePlan``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from edgekit.bundle.codec import to_data
from edgekit.bundle.manifest import (
    Compatibility,
    CompressionStep,
    OpPlacement,
    OpPlacementEntry,
    Precision,
    Signature,
    TensorMapping,
    TensorSpec,
)
from edgekit.errors import ConfigError, MissingSDKError, ValidationFailedError
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.targets.op_support import raise_unsupported

if TYPE_CHECKING:
    from edgekit.targets.apple_graph import Conversion

PACKAGE = "model.mlpackage"
_PALETTE_BITS = {"palettize6": 6, "palettize4": 4}
_IOS18 = ("iOS18", "macOS15")
_PIP_NAMES = {"sklearn": "scikit-learn"}
_ML_DTYPES = {"FLOAT32": "float32", "FLOAT16": "float16", "INT32": "int32", "DOUBLE": "float32"}


@dataclass(frozen=True)
class AppleOptions:
    """Settings of the ``apple`` target (``--option apple.KEY=VALUE``)."""

    # None: the lowest the precision needs (iOS16; iOS17 for int8 = W8A8, whose activation quantize ops
    # are Core ML 7; iOS18 for per_grouped_channel LUTs); the manifest records the one used
    minimum_deployment_target: Literal["iOS16", "iOS17", "iOS18", "macOS13", "macOS14", "macOS15"] | None = None
    compute_units: Literal["ALL", "CPU_AND_NE", "CPU_AND_GPU", "CPU_ONLY"] = "ALL"
    # coremltools leaves weights with fewer elements than this uncompressed (its default: 2048)
    weight_threshold: int = 2048
    palettize_mode: Literal["kmeans", "uniform"] = "kmeans"
    # one LUT per weight (iOS16+) or per group of output channels (iOS18+: more accurate at 4 bits; a
    # weight whose channel count the group size does not divide stays uncompressed)
    palettize_granularity: Literal["per_tensor", "per_grouped_channel"] = "per_tensor"
    palettize_group_size: int = 4
    calibration_samples: int = 128  # W8A8: at most this many calibration samples set the activation ranges

    def __post_init__(self) -> None:
        if self.weight_threshold < 0:
            raise ValueError(f"weight_threshold must be >= 0, got {self.weight_threshold}")
        if self.palettize_group_size < 1:
            raise ConfigError(f"targets.apple.palettize_group_size: must be >= 1, got {self.palettize_group_size}")
        if self.calibration_samples < 1:
            raise ConfigError(f"targets.apple.calibration_samples: must be >= 1, got {self.calibration_samples}")
        if (
            self.palettize_granularity == "per_grouped_channel"
            and self.minimum_deployment_target is not None
            and self.minimum_deployment_target not in _IOS18
        ):
            raise ConfigError(
                "targets.apple.palettize_granularity: per_grouped_channel LUTs need Core ML 8 "
                f"(minimum_deployment_target {' or '.join(_IOS18)}), not {self.minimum_deployment_target}; "
                "set targets.apple.minimum_deployment_target=iOS18"
            )


class AppleTarget:
    name: ClassVar[str] = "apple"
    runtime: ClassVar[str] = "coreml"
    precisions: ClassVar[tuple[str, ...]] = (
        "fp16",
        "int8",
        "int8-weights",
        "palettize6",
        "palettize4",
        "fp32",
        "auto",
    )
    Options: ClassVar[type] = AppleOptions
    static_shapes: ClassVar[bool] = True

    def check_model(self, model_path: Path) -> None:
        """Refuse ops onnx2torch's converter registry has no entry for."""
        import onnx

        from edgekit.compress.onnx_to_torch import unconvertible_nodes

        nodes = unconvertible_nodes(onnx.load(str(model_path), load_external_data=False))
        if nodes:
            raise_unsupported(self.name, "onnx2torch (the ONNX -> PyTorch step before coremltools)", model_path, nodes)

    # -- candidates ---------------------------------------------------------------------------
    def candidates(self, ctx: BuildContext) -> CandidatePlan:
        """Every Core ML precision under ``auto`` (one package each, judged by the intermediate
        carrying that package's own weights), else the one asked for. Core ML does not run here:
        ``device_rank`` orders them by Apple's documentation (``DEVICE_RANK``)."""
        opts: AppleOptions = ctx.options or AppleOptions()
        skipped: list[tuple[str, str]] = []
        if ctx.precision != "auto":
            if ctx.precision == "int8":
                deployment_target(opts, "int8")  # refuse a deployment target W8A8 cannot run on, before converting
            wanted = [ctx.precision]
        else:
            wanted = list(AUTO_ORDER)
            skipped.append(
                (
                    _candidate_name("fp32"),
                    "fp32 compute is never the faster Core ML build: the Neural Engine computes in fp16, so fp32 "
                    "runs on the CPU/GPU only (ask for it with --precision fp32)",
                )
            )
            if opts.minimum_deployment_target is not None and opts.minimum_deployment_target not in _W8A8_TARGETS:
                wanted.remove("int8")
                skipped.append(
                    (
                        _candidate_name("int8"),
                        f"targets.apple.minimum_deployment_target={opts.minimum_deployment_target}: W8A8 needs "
                        f"Core ML 7 activation quantization ({' or '.join(_W8A8_TARGETS)})",
                    )
                )
        return CandidatePlan(first=tuple(self._candidate(ctx, p) for p in wanted), skipped=tuple(skipped))

    def _candidate(self, ctx: BuildContext, precision: str) -> Candidate:
        opts: AppleOptions = ctx.options or AppleOptions()

        def build(space: BuildSpace) -> Built:
            scratch = space.work_dir / "scratch"
            scratch.mkdir()
            one = dataclasses.replace(
                ctx,
                precision=precision,
                calib=space.calib,
                out_dir=space.work_dir,
                work_dir=scratch,
                progress=space.progress,
            )
            result = build_one(one)
            return Built(
                files=result.files,
                runtime="coreml",
                precision=result.precision,
                open=None,  # Core ML does not run here: "latency not measured here"
                intermediate=result.intermediate,
                detail=result,
            )

        return Candidate(
            name=_candidate_name(precision),
            precision=precision,
            runtime="coreml",
            build=build,
            settings={"precision": precision, "compute_units": opts.compute_units},
            family=precision,
            device_rank=device_rank(precision, opts.compute_units),
        )

    def finish(self, ctx: BuildContext, built: Built, built_dir: Path) -> BuildResult:
        """The chosen package in ``ctx.out_dir``; its description is the candidate's own."""
        import shutil

        for path in built.files:
            dest = ctx.out_dir / path
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(built_dir / path, dest)
        result: BuildResult = built.detail
        return result


# Core ML does not run here, so ``auto`` ships by the expected speed order on the device (lower =
# faster), from coremltools' optimization guide, "Performance"
# (https://apple.github.io/coremltools/docs-guides/source/opt-quantization-perf.html): W8A8 gets
# int8-int8 compute on the Neural Engine of A17 Pro / M4 and later and "may lead to more gains when
# compared to weight-only quantization"; weight-only compression reduces the data moved per
# prediction, which helps memory-bound models (fewer bits, less data); fp16 is the uncompressed
# Neural Engine build. Activation quantization is "a considerable slowdown" on the CPU (and
# sometimes the GPU), so with compute units that exclude the Neural Engine W8A8 ranks last.
AUTO_ORDER = ("int8", "palettize4", "palettize6", "int8-weights", "fp16")
_NO_NEURAL_ENGINE = ("CPU_ONLY", "CPU_AND_GPU")


def device_rank(precision: str, compute_units: str) -> int:
    order = [p for p in AUTO_ORDER if not (p == "int8" and compute_units in _NO_NEURAL_ENGINE)]
    if precision == "int8" and compute_units in _NO_NEURAL_ENGINE:
        return len(AUTO_ORDER)
    return order.index(precision) if precision in order else len(AUTO_ORDER) + 1  # fp32: CPU/GPU only


def _candidate_name(precision: str) -> str:
    return {
        "int8": "coreml w8a8 (coremltools.optimize.torch)",
        "int8-weights": "coreml int8 weights",
        "palettize6": "coreml palettized 6-bit",
        "palettize4": "coreml palettized 4-bit",
        "fp16": "coreml fp16",
        "fp32": "coreml fp32",
    }[precision]


def build_one(ctx: BuildContext) -> BuildResult:
    """One ``.mlpackage`` of ``ctx.precision`` in ``ctx.out_dir``: one candidate the engine builds.
    The torch graph is converted by ``torch.jit.trace``, or by ``torch.export`` where that fails
    (``apple_graph.convert_module``); the provenance and a note name the path that built it."""
    ct = _sdk("coremltools", "the apple target")
    torch = _sdk("torch", "the apple target")
    from edgekit.compress.mlpackage_weights import load_into_torch, load_program, package_weights
    from edgekit.targets.apple_graph import TRACE, convert_module

    opts: AppleOptions = ctx.options or AppleOptions()
    if ctx.precision == "int8":
        return build_w8a8(ctx)
    deployment = deployment_target(opts, ctx.precision)
    if ctx.precision in _PALETTE_BITS and opts.palettize_mode == "kmeans":
        _sdk("sklearn", "k-means palettization")  # coremltools imports it lazily: fail before converting
    inputs, frozen, module, example = _torch_graph(ctx)
    ctx.progress(f"[apple] coremltools {ct.__version__}: mlprogram, {ctx.precision}")
    fp32 = ctx.precision == "fp32"
    conversion = convert_module(
        torch,
        module,
        example,
        lambda graph: _convert(ct, graph, inputs, ctx.served, deployment, fp32),
        ct.__version__,
        frozen.path,
    )
    if conversion.path != TRACE:
        ctx.progress(f"[apple] {TRACE}: {conversion.trace_failure}; converted from {conversion.path}")
    mlmodel = conversion.model
    compressed, precision = _compress(ct, mlmodel, ctx.precision, opts)
    package = ctx.out_dir / PACKAGE
    compressed.save(str(package))

    spec, program = load_program(package)
    artifact_signature, mapping = _interface(spec, ctx.served, inputs)
    weights = package_weights(program)
    summary = check_compression(weights, ctx.precision, opts)
    reference = weights
    if compressed is not mlmodel:  # the same program before compression ties each weight to its torch tensor
        mlmodel.save(str(ctx.work_dir / "uncompressed.mlpackage"))
        reference = package_weights(load_program(ctx.work_dir / "uncompressed.mlpackage")[1])
    intermediate_module = copy.deepcopy(module)
    report = load_into_torch(intermediate_module, weights, reference)
    fp16_activations = ctx.precision != "fp32"
    files = {p.relative_to(ctx.out_dir).as_posix(): "artifact" for p in sorted(package.rglob("*")) if p.is_file()}
    worst = report.min_compressed_cosine
    notes = [
        *(f"frozen: {step}" for step in frozen.steps),
        _conversion_note(conversion),
        summary,
        f"intermediate: {len(report.compressed_loaded)} compressed and {len(report.plain_loaded)} plain weights "
        "read back from the saved package" + (f" (worst cosine to the fp32 weight {worst:.4f})" if worst else ""),
        "Core ML latency: not measured here",
    ]
    if report.by_value:
        notes.append(
            f"intermediate: {len(report.by_value)} weight(s) found by value, {len(report.rescaled)} with a scale "
            f"coremltools fused in divided out ({', '.join(report.rescaled[:3])})"
        )
    if report.plain_unmatched:
        notes.append(
            f"intermediate: {len(report.plain_unmatched)} uncompressed package constant(s) match no torch tensor "
            f"and keep their FP32 values ({', '.join(report.plain_unmatched[:3])})"
        )
    return BuildResult(
        files=files,
        **_coreml_result_fields(ct, opts, program, package, spec, deployment, notes),
        artifact_signature=artifact_signature,
        mapping=mapping,
        precision=precision,
        intermediate=torch_runner(intermediate_module, ctx.served, inputs, fp16_activations),
        intermediate_name=(
            "torch intermediate with the mlpackage's dequantized weights"
            + (", activations rounded to FP16" if fp16_activations else "")
        ),
        static=True,
        provenance=(
            *frozen.provenance(),
            CompressionStep(
                kind="convert",
                tool=f"{_onnx2torch_version()} -> {conversion.path} -> coremltools {ct.__version__}",
                settings={
                    "convert_to": "mlprogram",
                    "compute_precision": "fp32" if ctx.precision == "fp32" else "fp16",
                    "minimum_deployment_target": deployment,
                },
            ),
            *(
                ()
                if compressed is mlmodel
                else (
                    CompressionStep(
                        kind="palettize" if ctx.precision in _PALETTE_BITS else "quantize",
                        tool=f"coremltools {ct.__version__}",
                        settings={"method": precision.method, "weight_threshold": str(opts.weight_threshold)},
                        metric="worst cosine of a compressed weight to its fp32 weight" if worst else "",
                        after=worst,
                    ),
                )
            ),
        ),
    )


def _conversion_note(conversion: Conversion) -> str:
    if not conversion.trace_failure:
        return f"converted from {conversion.path}"
    return f"converted from {conversion.path}: the torch.jit.trace path failed, {conversion.trace_failure}"


_W8A8_TARGETS = ("iOS17", "iOS18", "macOS14", "macOS15")


def deployment_target(opts: AppleOptions, precision: str) -> str:
    """The Core ML deployment target a build uses: the one set, checked against what ``precision``
    needs, else the lowest that suffices."""
    grouped = precision in _PALETTE_BITS and opts.palettize_granularity == "per_grouped_channel"
    chosen = opts.minimum_deployment_target
    if chosen is None:
        return "iOS18" if grouped else "iOS17" if precision == "int8" else "iOS16"
    if precision == "int8" and chosen not in _W8A8_TARGETS:
        raise ConfigError(
            f"targets.apple.minimum_deployment_target={chosen}: --precision int8 (W8A8) needs Core ML 7 activation "
            f"quantization ({' or '.join(_W8A8_TARGETS)}); set it to iOS17, or use --precision int8-weights"
        )
    return chosen


def _torch_graph(ctx: BuildContext) -> tuple[list[TensorSpec], Any, Any, tuple[Any, ...]]:
    """(static input specs, frozen graph, onnx2torch module, example inputs) for ``ctx``'s model."""
    import torch

    from edgekit.compress.freeze import freeze_graph
    from edgekit.compress.onnx_to_torch import onnx_to_torch
    from edgekit.targets.apple_graph import prelu_as_relu

    inputs = [_static(spec, ctx.static_shapes) for spec in ctx.served.inputs]
    ctx.progress("[apple] freeze (onnxslim) -> onnx2torch")
    shapes = {s.name: tuple(int(d) for d in s.shape) for s in inputs}
    # onnx2torch has no auto_pad SAME_* (Keras/TF exporters write it): explicit pads, the shapes being static
    frozen = freeze_graph(
        ctx.model_path, ctx.work_dir / "folded.onnx", shapes, check=_check_batch(ctx.calib, inputs), pads=True
    )
    # a PRelu onnx2torch would run as a boolean mask becomes Relu arithmetic (static shapes for Core ML)
    convertible, _ = prelu_as_relu(frozen.path, ctx.work_dir / "prelu_as_relu.onnx")
    module = onnx_to_torch(convertible)
    example = tuple(torch.zeros(shapes[s.name], dtype=_torch_dtype(torch, s.dtype)) for s in inputs)
    return inputs, frozen, module, example


def _mlprogram(
    ct: Any,
    traced: Any,
    inputs: list[TensorSpec],
    served: Signature,
    deployment: str,
    fp32: bool = False,
    source: Path | None = None,
) -> Any:
    from edgekit.targets.apple_graph import converter_refusal, register_torch_ops

    register_torch_ops()
    try:
        return _convert(ct, traced, inputs, served, deployment, fp32)
    except (NotImplementedError, RuntimeError, ValueError) as exc:
        refusal = converter_refusal(exc, traced, ct.__version__, source)
        if refusal is None:
            raise
        raise refusal from None


def _convert(ct: Any, traced: Any, inputs: list[TensorSpec], served: Signature, deployment: str, fp32: bool) -> Any:
    return ct.convert(
        traced,
        inputs=[ct.TensorType(name=s.name, shape=s.shape, dtype=np.dtype(s.dtype).type) for s in inputs],
        outputs=[
            ct.TensorType(name=o.name, dtype=np.float32 if o.dtype.startswith("float") else None)
            for o in served.outputs
        ],
        convert_to="mlprogram",
        minimum_deployment_target=getattr(ct.target, deployment),
        compute_precision=ct.precision.FLOAT32 if fp32 else ct.precision.FLOAT16,
        skip_model_load=True,
    )


def build_w8a8(ctx: BuildContext) -> BuildResult:
    """W8A8 ``.mlpackage``: the torch intermediate quantized with ``coremltools.optimize.torch``
    (int8 symmetric per-channel weights, 8-bit per-tensor activations, min/max over up to
    ``calibration_samples`` calibration samples), converted with its quantize/dequantize ops, and
    validated through that quantized graph carrying the package's own weights and activation scales
    (``edgekit.compress.torch_w8a8``). One candidate the optimisation engine can build."""
    ct = _sdk("coremltools", "the apple target")
    torch = _sdk("torch", "the apple target")
    from edgekit.compress.mlpackage_weights import load_program, package_weights
    from edgekit.compress.torch_w8a8 import calibrate, load_package_quantization

    opts: AppleOptions = ctx.options or AppleOptions()
    deployment = deployment_target(opts, "int8")
    inputs, frozen, module, example = _torch_graph(ctx)
    batch = int(inputs[0].shape[0]) if inputs[0].shape else 1
    count = min(opts.calibration_samples, min(len(ctx.calib[s.name]) for s in inputs))
    count -= count % batch
    if count < 1:
        raise ConfigError(f"the apple W8A8 build needs at least {batch} calibration samples of the static batch")
    batches = [
        tuple(
            torch.from_numpy(np.ascontiguousarray(ctx.calib[s.name][i : i + batch].astype(np.dtype(s.dtype))))
            for s in inputs
        )
        for i in range(0, count, batch)
    ]
    ctx.progress(f"[apple] coremltools.optimize.torch W8A8: calibrating on {count} samples")
    quantized = calibrate(module, example, batches)
    # Traced only: torch.export of the quantized module fails in torch 2.13 (its FX-quantized convs run
    # quantized tensors, which export's fake tensors refuse: "quantized nyi in meta tensors"), so W8A8
    # has no second path: a graph coremltools refuses traced is refused here, where the other precisions
    # can still build from torch.export
    with torch.no_grad():
        traced = torch.jit.trace(quantized, example, check_trace=False)
    ctx.progress(f"[apple] coremltools {ct.__version__}: mlprogram, W8A8 ({deployment})")
    mlmodel = _mlprogram(ct, traced, inputs, ctx.served, deployment, source=frozen.path)
    package = ctx.out_dir / PACKAGE
    mlmodel.save(str(package))
    spec, program = load_program(package)
    artifact_signature, mapping = _interface(spec, ctx.served, inputs)
    kinds: dict[str, int] = {}
    for w in package_weights(program):
        kinds[w.compression] = kinds.get(w.compression, 0) + 1
    report = load_package_quantization(quantized, program)
    if not report.weights or not report.activations:
        raise ValidationFailedError(
            f"apple int8: the package holds {len(report.weights)} int8 weights and {report.activations} activation "
            "quantize ops; W8A8 needs both (the model has no conv/linear layer coremltools.optimize.torch quantizes?)"
        )
    method = (
        f"coremltools.optimize.torch LinearQuantizer: int8 symmetric per-channel weights, 8-bit per-tensor "
        f"activations, min/max calibration on {count} samples, fp16 compute"
    )
    notes = [
        *(f"frozen: {step}" for step in frozen.steps),
        "package weights: " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())),
        f"intermediate: the quantized torch graph with the package's {len(report.weights)} int8 weights and scales "
        f"and its {report.activations} activation scales (torch vs package scale: within "
        f"{report.worst_scale_error:.1e} relative)"
        + (f"; {len(report.dropped_noops)} no-op requantization(s) coremltools removed" if report.dropped_noops else "")
        + (
            f"; {len(report.rescaled)} add/sub output quantization(s) whose scale coremltools normalized by an "
            "input's scale (distributive_quantized_binary_op_scale_normalization), compared in the source's units"
            if report.rescaled
            else ""
        ),
        "Core ML latency: not measured here",
    ]
    files = {p.relative_to(ctx.out_dir).as_posix(): "artifact" for p in sorted(package.rglob("*")) if p.is_file()}
    return BuildResult(
        files=files,
        **_coreml_result_fields(ct, opts, program, package, spec, deployment, notes),
        artifact_signature=artifact_signature,
        mapping=mapping,
        precision=Precision("int8", "int8", method),
        intermediate=torch_runner(quantized, ctx.served, inputs, fp16_activations=True),
        intermediate_name=(
            "quantized torch intermediate with the mlpackage's int8 weights and activation scales, "
            "activations rounded to FP16"
        ),
        static=True,
        provenance=(
            *frozen.provenance(),
            CompressionStep(
                kind="quantize",
                tool=f"coremltools {ct.__version__} optimize.torch LinearQuantizer",
                settings={
                    "weights": "int8 symmetric per-channel",
                    "activations": "8-bit per-tensor",
                    "observer": "min_max",
                    "calibration_samples": str(count),
                },
            ),
            CompressionStep(
                kind="convert",
                tool=f"{_onnx2torch_version()} -> torch.jit.trace -> coremltools {ct.__version__}",
                settings={
                    "convert_to": "mlprogram",
                    "compute_precision": "fp16",
                    "minimum_deployment_target": deployment,
                },
            ),
        ),
    )


def _coreml_result_fields(
    ct: Any, opts: AppleOptions, program: Any, package: Path, spec: Any, deployment: str, notes: list[str]
) -> dict[str, Any]:
    """What every Core ML build records the same way: compatibility, op placement (with its
    not-measured note appended to ``notes``), notes and target options."""
    placement = op_placement(program, package, opts)
    if placement.tool.endswith("not measured here"):
        notes.append("Core ML compute-device placement: not measured here (needs macOS 14.4+)")
    return {
        "compatibility": Compatibility(
            runtime="coreml",
            runtime_version=ct.__version__,
            accelerator="ane" if opts.compute_units == "CPU_AND_NE" else None,
            hardware={"minimum_deployment_target": deployment},
        ),
        "runnable_here": False,
        "op_placement": placement,
        "notes": tuple(notes),
        "target_options": to_data(opts)
        | {"minimum_deployment_target": deployment, "package": PACKAGE, "spec_version": int(spec.specificationVersion)},
    }


def _onnx2torch_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"onnx2torch {version('onnx2torch')}"
    except PackageNotFoundError:
        return "onnx2torch"


def _compress(ct: Any, mlmodel: Any, precision: str, opts: AppleOptions) -> tuple[Any, Precision]:
    from coremltools.optimize import coreml as cto

    if precision == "fp32":
        return mlmodel, Precision("fp32", "fp32", "coremltools mlprogram fp32")
    if precision == "fp16":
        return mlmodel, Precision("fp16", "fp16", "coremltools mlprogram fp16")
    if precision == "int8-weights":
        config = cto.OptimizationConfig(
            global_config=cto.OpLinearQuantizerConfig(
                mode="linear_symmetric", dtype="int8", granularity="per_channel", weight_threshold=opts.weight_threshold
            )
        )
        method = "coremltools linear_quantize_weights linear_symmetric int8 per-channel, fp16 compute"
        return cto.linear_quantize_weights(mlmodel, config), Precision("int8", "fp16", method)
    if precision in _PALETTE_BITS:
        bits = _PALETTE_BITS[precision]
        grouped = opts.palettize_granularity == "per_grouped_channel"
        groups = {"group_size": opts.palettize_group_size} if grouped else {}
        config = cto.OptimizationConfig(
            global_config=cto.OpPalettizerConfig(
                mode=opts.palettize_mode,
                nbits=bits,
                granularity=opts.palettize_granularity,
                weight_threshold=opts.weight_threshold,
                **groups,
            )
        )
        luts = f"one LUT per {opts.palettize_group_size} output channels" if grouped else "per-tensor LUT"
        method = f"coremltools palettize_weights {opts.palettize_mode} {bits}-bit {luts}, fp16 compute"
        weights: Any = f"palettized-{bits}bit"
        return cto.palettize_weights(mlmodel, config), Precision(weights, "fp16", method)
    raise ValueError(f"apple target cannot build precision {precision!r}")  # the packager checks first


def check_compression(weights: list[Any], precision: str, opts: AppleOptions) -> str:
    """Check that the saved package's weights are compressed as asked; return a one-line summary."""
    kinds: dict[str, int] = {}
    for w in weights:
        kinds[w.compression] = kinds.get(w.compression, 0) + 1
    listing = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    want = {"int8-weights": "int8", "palettize6": "palettized-6bit", "palettize4": "palettized-4bit"}.get(precision)
    if want is not None:
        got = [w for w in weights if w.compressed]
        wrong = sorted({w.compression for w in got if w.compression != want})
        if wrong:
            raise ValidationFailedError(f"apple {precision}: the package holds {', '.join(wrong)} weights, not {want}")
        if not got:
            raise ConfigError(
                f"targets.apple.weight_threshold: no weight has {opts.weight_threshold} or more elements, so "
                f"coremltools compressed nothing ({listing}); lower it (e.g. 0) or use --precision fp16"
            )
    return f"package weights: {listing or 'none'}"


def _interface(spec: Any, served: Signature, inputs: list[TensorSpec]) -> tuple[Signature, tuple[TensorMapping, ...]]:
    """The package's own signature (from its spec) and the served <-> artifact name mapping."""
    desc = spec.description
    # coremltools makes names valid identifiers (``input.1`` -> ``input_1``): inputs pair by position,
    # each with the sanitised form of its served name; the mapping serves the model's own names
    if [i.name for i in desc.input] != coreml_names([s.name for s in inputs]):
        raise ValidationFailedError(
            f"package inputs {[i.name for i in desc.input]} do not match the model's {[s.name for s in inputs]}"
        )
    if len(desc.output) != len(served.outputs):
        raise ValidationFailedError(f"package has {len(desc.output)} outputs, the model {len(served.outputs)}")
    art_in = []
    for feature, want in zip(desc.input, inputs, strict=True):
        spec_in = _feature_spec(feature, want.layout)
        if spec_in.shape != want.shape:
            raise ValidationFailedError(f"package input {feature.name}: shape {spec_in.shape}, expected {want.shape}")
        art_in.append(spec_in)
    art_out = [_feature_spec(f, None) for f in desc.output]
    mapping = tuple(
        TensorMapping(served=s.name, artifact=a.name)
        for s, a in (*zip(inputs, art_in, strict=True), *zip(served.outputs, art_out, strict=True))
    )
    return Signature(inputs=tuple(art_in), outputs=tuple(art_out)), mapping


def coreml_names(names: list[str]) -> list[str]:
    """The names coremltools gives tensors named ``names``, in order (its ``NameSanitizer``: invalid
    characters -> ``_``, a leading digit prefixed, repeats made unique)."""
    from coremltools.converters.mil.mil.passes.defs.preprocess import NameSanitizer

    sanitizer = NameSanitizer()
    return [str(sanitizer.sanitize_name(n)) for n in names]


def _feature_spec(feature: Any, layout: str | None) -> TensorSpec:
    arr = feature.type.multiArrayType
    from coremltools.proto import FeatureTypes_pb2 as ft

    dtype = _ML_DTYPES.get(ft.ArrayFeatureType.ArrayDataType.Name(arr.dataType), "float32")
    return TensorSpec(feature.name, dtype, tuple(int(d) for d in arr.shape), layout=layout)


def torch_runner(
    module: Any, served: Signature, inputs: list[TensorSpec], fp16_activations: bool
) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Served inputs -> served outputs through ``module``, at the package's static batch (larger
    feeds run slice by slice), activations rounded to FP16 at every leaf module's output."""
    import torch

    if fp16_activations:
        for sub in module.modules():
            if not list(sub.children()):
                sub.register_forward_hook(_round_fp16)
    batch = int(inputs[0].shape[0]) if inputs[0].shape else 1
    names = [o.name for o in served.outputs]

    def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        n = int(next(iter(feed.values())).shape[0])
        if n % batch:
            raise ValueError(f"{n} samples do not split into the package's static batch of {batch}")
        parts: list[list[np.ndarray]] = [[] for _ in names]
        # One intra-op thread: the slices are small (batch 1 mostly) and torch's thread pool cost
        # more than it gave here (digits example: 51 ms per sample on 2 busy cores, 4 ms on one).
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            with torch.no_grad():
                for start in range(0, n, batch):
                    args = [torch.from_numpy(np.ascontiguousarray(feed[s.name][start : start + batch])) for s in inputs]
                    result = module(*args)
                    result = result if isinstance(result, (tuple, list)) else (result,)
                    for i, value in enumerate(result):
                        parts[i].append(value.float().numpy())
        finally:
            torch.set_num_threads(threads)
        return {name: np.concatenate(p, axis=0) for name, p in zip(names, parts, strict=True)}

    return run


def _round_fp16(_module: Any, _inputs: Any, output: Any) -> Any:
    if hasattr(output, "dtype") and output.dtype.is_floating_point:
        return output.half().float()
    return output


def op_placement(program: Any, package: Path, opts: AppleOptions) -> OpPlacement:
    """Ops by type from the MIL program; compute devices from ``MLComputePlan`` on macOS only."""
    from edgekit.compress.mlpackage_weights import compute_ops

    ops = compute_ops(program)
    devices = _compute_plan_devices(package, opts) if sys.platform == "darwin" else None
    if devices is None:
        entries = tuple(OpPlacementEntry(op=t, node=n, device="not measured here") for t, n in ops)
        return OpPlacement(
            tool="coremltools MIL program; device not measured here", accelerated=0, fallback=0, entries=entries
        )
    entries = tuple(OpPlacementEntry(op=t, node=n, device=devices.get(n, "unknown")) for t, n in ops)
    accelerated = sum(1 for e in entries if e.device in ("NeuralEngine", "GPU"))
    return OpPlacement(
        tool="Core ML MLComputePlan", accelerated=accelerated, fallback=len(entries) - accelerated, entries=entries
    )


def _compute_plan_devices(package: Path, opts: AppleOptions) -> dict[str, str] | None:  # pragma: no cover - macOS
    """op name -> preferred compute device, from Core ML's own plan (macOS 14.4+), else ``None``."""
    import coremltools as ct

    try:
        from coremltools.models.compute_plan import MLComputePlan
    except ImportError:
        return None
    compiled = ct.models.utils.compile_model(str(package))
    try:
        plan = MLComputePlan.load_from_path(
            path=str(compiled), compute_units=getattr(ct.ComputeUnit, opts.compute_units)
        )
    except (RuntimeError, OSError, AttributeError):
        return None
    devices = {}
    for op in plan.model_structure.program.functions["main"].block.operations:
        usage = plan.get_compute_device_usage_for_mlprogram_operation(op)
        if usage is not None and op.outputs:
            kind = type(usage.preferred_compute_device).__name__  # MLNeuralEngineComputeDevice, ...
            devices[op.outputs[0].name] = kind.removeprefix("ML").removesuffix("ComputeDevice")
    return devices


def _static(spec: TensorSpec, shapes: Mapping[str, tuple[int, ...]]) -> TensorSpec:
    shape = tuple(shapes.get(spec.name, spec.shape))
    if any(not isinstance(d, int) for d in shape):
        raise ConfigError(f"--input-shape {spec.name}=...: Core ML needs a static shape for {list(spec.shape)}")
    return dataclasses.replace(spec, shape=shape)


def _check_batch(calib: Mapping[str, np.ndarray], inputs: list[TensorSpec]) -> dict[str, np.ndarray] | None:
    """One static-shape batch of calibration samples to check the frozen graph on, if they fit."""
    batch: dict[str, np.ndarray] = {}
    for spec in inputs:
        arr = calib.get(spec.name)
        n = int(spec.shape[0]) if spec.shape else 1
        if arr is None or len(arr) < n or tuple(arr.shape[1:]) != tuple(spec.shape[1:]):
            return None
        batch[spec.name] = np.ascontiguousarray(arr[:n].astype(np.dtype(spec.dtype)))
    return batch


def _torch_dtype(torch: Any, dtype: str) -> Any:
    return torch.from_numpy(np.empty(0, dtype=np.dtype(dtype))).dtype


def _sdk(module: str, what: str) -> Any:
    """Import a package of the ``coreml`` extra, or say which extra to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingSDKError(_PIP_NAMES.get(module, module), "coreml", what) from exc


__all__ = [
    "AUTO_ORDER",
    "AppleOptions",
    "AppleTarget",
    "build_one",
    "build_w8a8",
    "check_compression",
    "deployment_target",
    "device_rank",
    "op_placement",
    "torch_runner",
]
