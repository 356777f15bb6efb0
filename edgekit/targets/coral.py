"""``coral`` target: full-integer INT8 ``.tflite`` for LiteRT, compiled for the Edge TPU when
``edgetpu_compiler`` is on PATH.

The target describes candidates; the optimisation engine (``edgekit.optimize``) builds, measures
and chooses. The slow part is done once per search and shared: the graph is frozen (static input
shapes, constants folded and simplified by onnxslim, TF-valid node names:
``edgekit.compress.freeze``, so dynamic-shape graphs such as YOLOv8 convert), onnx2tf makes the
SavedModel and the float TFLite, and TFLite's calibrator records the activation ranges once per
calibration method (``edgekit.compress.tflite_quant``). Candidates:

- full-integer INT8 (int8 activations, what the Edge TPU runs), per-channel weights (LiteRT's
  default) and per-tensor weights, MinMax ranges; percentile ranges as the refinement of a layout
  that missed the budget; mixed precision keeps the most sensitive ops in float (the MLIR
  quantizer's ``denylisted_nodes``), ranked by their measured error (``optimize.tflite_sensitivity``);
- under ``auto`` for a detector's or segmenter's head outputs (``BuildContext.heads``): int8 per-channel
  MinMax with the head's decode kept in float (the DFL softmax and projection, the anchor and stride
  arithmetic, the class sigmoid: ``optimize.head_scope.tflite_head_scope`` on the float TFLite), the
  recipe the cpu, intel and jetson targets offer on their ONNX graphs;
- 16x8 (int16 activations, int8 weights) under ``auto`` or with ``activations=int16``, only where
  the Edge TPU is not the target: the Edge TPU runs int8 only (the skip is recorded). LiteRT runs
  16x8 on reference kernels (YOLOv8n at 320: 663 ms, 0.03x ONNX Runtime FP32, int8 11 ms), so under
  ``auto`` with the latency objective the engine's prescreen (``optimize.engine.DOMINATED_FACTOR``)
  usually skips its accuracy run as dominated, and says so;
- under ``auto`` without the Edge TPU, when no int8 candidate met the budget (mixed precision
  included): the float32 TFLite of the same conversion, for LiteRT's CPU kernels, shipped as fp32.

Timing: without the compiler the bundle holds ``model.tflite`` for the CPU (XNNPACK) and every
candidate is timed here on host LiteRT, as the cpu target's are. With the compiler each int8
candidate is compiled (``model_edgetpu.tflite``, runs only with the Edge TPU delegate,
``Compatibility.accelerator = "edgetpu"``; the compiler's log becomes ``op_placement``), its latency
is "not measured here", accuracy is measured on the uncompiled int8 model (same int8 arithmetic)
and ``device_rank`` orders candidates by Coral's documentation: fewer ops falling back to the CPU
is faster.

Inputs and outputs are int8 (int16 for 16x8); their scale and zero point go into the manifest
(artifact signature) and the agent quantizes / dequantizes for clients that send floats, and
transposes NCHW <-> NHWC (``TensorMapping.transpose``). Shapes are static (``ctx.static_shapes``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np

from edgekit.bundle.manifest import (
    Compatibility,
    CompressionStep,
    OpPlacement,
    OpPlacementEntry,
    Precision,
    QuantParams,
    Signature,
    TensorMapping,
    TensorSpec,
)
from edgekit.compress.tflite_quant import CALIBRATIONS, QuantVariant
from edgekit.errors import ConfigError, EdgekitError, MissingSDKError
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, Refinement
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.targets.op_support import UnsupportedNode, raise_unsupported

if TYPE_CHECKING:
    from edgekit.compress.onnx2tflite import FloatConversion, TensorLink, TfliteModel
    from edgekit.optimize.head_scope import HeadScope

ARTIFACT = "model.tflite"
COMPILED = "model_edgetpu.tflite"
COMPILER_LOG = "model_edgetpu.log"
EDGETPU_COMPILER = "edgetpu_compiler"
EDGETPU_TIMEOUT_S = 600
_LOG_ROW = re.compile(r"^(?P<op>[A-Z][A-Z0-9_]*)\s+(?P<count>\d+)\s+(?P<status>\S.*?)\s*$")


@dataclass(frozen=True)
class CoralOptions:
    """Settings of the ``coral`` target (``targets.coral.*``). ``auto`` = let the search choose."""

    # Compile for the Edge TPU: "auto" when edgetpu_compiler is on PATH, True requires it, False never.
    edgetpu: bool | Literal["auto"] = "auto"
    calibration_samples: int = 300  # at most this many calibration samples feed the representative dataset
    edgetpu_compiler: str = EDGETPU_COMPILER  # command name or path
    # int8: full-integer INT8 (Edge TPU or CPU); int16: 16x8 (int16 activations, int8 weights), CPU only;
    # auto: int8, and under --precision auto also 16x8 where the Edge TPU is not the target
    activations: Literal["auto", "int8", "int16"] = "auto"
    calibration: Literal["auto", "minmax", "percentile"] = "auto"  # auto: minmax, percentile where it misses
    per_channel: Literal["auto", "on", "off"] = "auto"  # weight scales per output channel (LiteRT's default)
    percentile: float = 99.99  # for calibration=percentile: activation ranges cover this share of values

    def __post_init__(self) -> None:
        if self.edgetpu not in (True, False, "auto"):
            raise ConfigError(f"targets.coral.edgetpu: {self.edgetpu!r} is not one of true, false, auto")
        for key, choices in (
            ("activations", ("auto", "int8", "int16")),
            ("calibration", ("auto", *CALIBRATIONS)),
            ("per_channel", ("auto", "on", "off")),
        ):
            if getattr(self, key) not in choices:
                raise ConfigError(f"targets.coral.{key}: {getattr(self, key)!r} is not one of {', '.join(choices)}")
        if self.activations == "int16" and self.edgetpu is True:
            raise ConfigError(
                "targets.coral.activations=int16: the Edge TPU runs int8 activations only, so a 16x8 model "
                "cannot be compiled for it; set targets.coral.edgetpu to auto or false (LiteRT CPU), or "
                "targets.coral.activations=int8"
            )
        if self.activations == "int16" and (self.calibration == "percentile" or self.per_channel == "off"):
            raise ConfigError(
                "targets.coral.activations=int16: 16x8 is built with the converter's own min/max calibration and "
                "per-channel weights; drop targets.coral.calibration=percentile / per_channel=off, or use int8"
            )
        if self.calibration_samples < 1:
            raise ConfigError(f"targets.coral.calibration_samples: must be >= 1, got {self.calibration_samples}")
        if not 50.0 < self.percentile <= 100.0:
            raise ConfigError(f"targets.coral.percentile: must be in (50, 100], got {self.percentile}")


@dataclass(frozen=True)
class _CoralBuild:
    """What ``finish`` needs of one candidate (``Built.detail``)."""

    converted: TfliteModel
    variant: QuantVariant | None  # None: 16x8
    samples: int
    compiled: tuple[str, str] | None  # (edgetpu_compiler version, its log) where compiled


class _Shared:
    """The float conversion every candidate of one search shares (onnx2tf runs once: the slow part)
    and the calibrated model per calibration method. A failure is kept and raised again for every
    candidate (the same reason each time, without converting again)."""

    def __init__(self, ctx: BuildContext, opts: CoralOptions) -> None:
        self.ctx, self.opts = ctx, opts
        self._conversion: FloatConversion | None = None
        self._failed: Exception | None = None
        self._calibrated: dict[tuple[str, float], bytes] = {}
        self._order: list[str] | None = None
        self._head: HeadScope | None = None

    @property
    def call_samples(self) -> int:
        """Samples per calibration call: the converter's representative dataset yields one static
        batch at a time (the calibrator records each tensor's min/max, and keeps no more than that
        call's tensors: ``Candidate.calib_call_samples``)."""
        first = self.ctx.served.inputs[0].name
        shape = self.ctx.static_shapes.get(first, ())
        return int(shape[0]) if shape and int(shape[0]) > 0 else 1

    def conversion(self, space: BuildSpace) -> FloatConversion:
        from edgekit.compress import onnx2tflite

        if self._failed is not None:
            raise self._failed
        if self._conversion is None:
            ctx = self.ctx
            static = {s.name: tuple(ctx.static_shapes[s.name]) for s in ctx.served.inputs}
            folder = ctx.work_dir / "float"
            folder.mkdir(parents=True, exist_ok=True)
            space.progress("[coral] freeze (onnxslim) -> onnx2tf -> SavedModel -> float TFLite (once per search)")
            try:
                self._conversion = onnx2tflite.to_float(
                    ctx.model_path,
                    folder,
                    static,
                    [o.name for o in ctx.served.outputs],
                    space.calib,
                    self.opts.calibration_samples,
                )
            except Exception as exc:
                self._failed = exc
                raise
        return self._conversion

    def calibrated(self, conversion: FloatConversion, calibration: str, percentile: float) -> bytes:
        from edgekit.compress.tflite_quant import calibrate, with_percentile_ranges

        key = (calibration, percentile if calibration == "percentile" else 0.0)
        if ("minmax", 0.0) not in self._calibrated:
            self._calibrated[("minmax", 0.0)] = calibrate(conversion)
        if key not in self._calibrated:
            self._calibrated[key] = with_percentile_ranges(self._calibrated[("minmax", 0.0)], conversion, percentile)
        return self._calibrated[key]

    def head(self, conversion: FloatConversion) -> HeadScope:
        """The head's decode ops on the float TFLite (walked once per search)."""
        from edgekit.optimize.head_scope import tflite_head_scope

        if self._head is None:
            heads = self.ctx.heads
            outputs = [link.artifact for link in conversion.outputs if link.served in heads]
            self._head = tflite_head_scope(conversion.float32, outputs, heads)
        return self._head

    def head_nodes(self) -> tuple[str, ...] | None:
        """The head's decode ops where the float TFLite was walked already, else None."""
        return self._head.nodes if self._head is not None else None

    def cpu_ops_from(self, nodes: tuple[str, ...]) -> int:
        """How many ops run on the CPU once ``nodes`` stay float: the first of them and every op
        after it (coral.ai/docs/edgetpu/models-intro: the compiler maps one subgraph to the Edge
        TPU, up to the first unsupported op; that op and everything after it runs on the CPU)."""
        from edgekit.compress.tflite_quant import op_outputs

        if self._order is None:
            if self._conversion is None:
                return len(nodes)
            self._order = [out for _, out, _ in op_outputs(self._conversion.float32)]
        first = min((self._order.index(n) for n in nodes if n in self._order), default=len(self._order))
        return len(self._order) - first


class CoralTarget:
    name: ClassVar[str] = "coral"
    runtime: ClassVar[str] = "litert"
    precisions: ClassVar[tuple[str, ...]] = ("int8", "auto")
    Options: ClassVar[type] = CoralOptions
    static_shapes: ClassVar[bool] = True

    def check_model(self, model_path: Path) -> None:
        """Raise ``UnsupportedOpError`` for ops onnx2tf has no converter for (its own op table)."""
        import onnx

        from edgekit.compress.onnx2tflite import onnx2tf_ops

        known = onnx2tf_ops()
        model = onnx.load(str(model_path), load_external_data=False)
        bad = [
            UnsupportedNode(n.op_type, n.domain, n.name or n.output[0])
            for n in model.graph.node
            if n.domain not in ("", "ai.onnx") or n.op_type not in known
        ]
        if bad:
            raise_unsupported(self.name, "onnx2tf", model_path, bad)

    # -- candidates ---------------------------------------------------------------------------
    def candidates(self, ctx: BuildContext) -> CandidatePlan:
        """Full-integer INT8 layouts (per-channel / per-tensor weights), MinMax calibration with
        percentile ranges as the refinement of a layout that missed the budget, ops kept in float
        for mixed precision, and 16x8 where the Edge TPU is not the target. With the compiler every
        int8 candidate is compiled for the Edge TPU, its latency is not measured here and
        ``device_rank`` orders them by how many ops fall back to the CPU (Coral's documentation)."""
        opts: CoralOptions = ctx.options or CoralOptions()
        compiler = self._compiler(opts)
        self._check_shapes(ctx)
        auto = ctx.precision == "auto"
        shared = _Shared(ctx, opts)
        first: list[Candidate] = []
        refinements: list[Refinement] = []
        skipped: list[tuple[str, str]] = []
        if opts.activations != "int16":
            per_channel = {"auto": (True, False), "on": (True,), "off": (False,)}[opts.per_channel]
            method = "minmax" if opts.calibration == "auto" else opts.calibration
            for pc in per_channel:
                variant = QuantVariant(method, pc, opts.percentile)
                first.append(_int8_candidate(shared, variant, compiler))
                if opts.calibration == "auto":
                    better = QuantVariant("percentile", pc, opts.percentile)
                    refinements.append(Refinement(_int8_candidate(shared, better, compiler), of=variant.label))
            if auto and ctx.heads:  # a detector's / segmenter's decode in float: the recipe INT8 detectors ship with
                offered, refused = _head_offer(
                    ctx, shared, QuantVariant(method, per_channel[0], opts.percentile), compiler
                )
                first.extend(offered)
                skipped.extend(refused)
        pinned = [
            f"{k}={v}" for k, v in (("calibration", "percentile"), ("per_channel", "off")) if getattr(opts, k) == v
        ]
        if opts.activations == "int16" or (auto and opts.activations == "auto"):
            if pinned and opts.activations == "auto":
                skipped.append(
                    (SIXTEEN_BY_EIGHT, f"16x8 uses min/max ranges and per-channel weights; targets.coral.{pinned[0]}")
                )
            elif compiler is not None and opts.activations == "auto":
                skipped.append(
                    (
                        SIXTEEN_BY_EIGHT,
                        "the Edge TPU runs int8 activations only (coral.ai/docs/edgetpu/models-intro); "
                        "16x8 would run on the CPU, set targets.coral.edgetpu=false to search it",
                    )
                )
            else:
                first.append(_int16_candidate(shared))
        # nothing int8 met the budget: the float TFLite for LiteRT's CPU; the Edge TPU runs int8 only
        fallback = (_float_candidate(shared),) if auto and compiler is None else ()
        return CandidatePlan(
            first=tuple(first), refinements=tuple(refinements), skipped=tuple(skipped), fallback=fallback
        )

    def finish(self, ctx: BuildContext, built: Built, built_dir: Path) -> BuildResult:
        """The chosen candidate's files in ``ctx.out_dir``, described for the manifest."""
        detail: _CoralBuild = built.detail
        for path in built.files:
            shutil.copyfile(built_dir / path, ctx.out_dir / path)
        opts: CoralOptions = ctx.options or CoralOptions()
        return describe_tflite(ctx.served, detail, opts, built.notes)

    def _compiler(self, opts: CoralOptions) -> str | None:
        found = shutil.which(opts.edgetpu_compiler)
        if opts.edgetpu is True and found is None:
            raise ConfigError(
                f"targets.coral.edgetpu=true but {opts.edgetpu_compiler} is not on PATH: install the Edge TPU "
                "compiler (package edgetpu-compiler from Coral's Debian repository; x86-64 only), or set "
                "targets.coral.edgetpu to auto or false to build for the CPU"
            )
        return found if opts.edgetpu is not False else None

    @staticmethod
    def _check_shapes(ctx: BuildContext) -> None:
        missing = [s.name for s in ctx.served.inputs if s.name not in ctx.static_shapes]
        if missing:
            raise ConfigError(f"--input-shape: the coral target needs a static shape for input {missing[0]!r}")


SIXTEEN_BY_EIGHT = "int16 16x8 minmax per-channel"
FLOAT_FALLBACK = "float32 tflite (fallback)"


def _int8_candidate(shared: _Shared, variant: QuantVariant, compiler: str | None) -> Candidate:
    from edgekit.compress.tflite_quant import quantize_calibrated

    def build(space: BuildSpace) -> Built:
        conversion = shared.conversion(space)
        model = quantize_calibrated(shared.calibrated(conversion, variant.calibration, variant.percentile), variant)
        return _built(space, shared, conversion.model(model, "int8"), variant, compiler)

    def rank(space: BuildSpace, built: Built) -> list[tuple[tuple[str, ...], float]]:
        from edgekit.compress.tflite_quant import representative
        from edgekit.optimize.tflite_sensitivity import rank_ops

        detail: _CoralBuild = built.detail
        conversion = shared.conversion(space)
        return rank_ops(conversion.float32, detail.converted.quantized, list(representative(conversion)))

    settings: dict[str, Any] = {
        "activations": "int8",
        "calibration": variant.calibration,
        "per_channel": variant.per_channel,
        "denylisted": list(variant.denylisted),
    }
    if variant.calibration == "percentile":
        settings["percentile"] = variant.percentile
    return Candidate(
        name=variant.label,
        precision="int8",
        runtime="litert",
        build=build,
        settings=settings,
        family=f"int8 {'per-channel' if variant.per_channel else 'per-tensor'}",
        # Where the Edge TPU runs it (latency not measured here): only fully-int8 ops run on the
        # TPU, and the first op kept in float and everything after it run on the CPU
        # (https://coral.ai/docs/edgetpu/models-intro/): fewer CPU ops ranks faster.
        device_rank=(shared.cpu_ops_from(variant.denylisted) if variant.denylisted else 0) if compiler else None,
        exclude=lambda nodes: _int8_candidate(shared, replace(variant, denylisted=nodes), compiler),
        rank_layers=rank,
        calib_call_samples=shared.call_samples,
    )


def _head_offer(
    ctx: BuildContext, shared: _Shared, variant: QuantVariant, compiler: str | None
) -> tuple[tuple[Candidate, ...], tuple[tuple[str, str], ...]]:
    """``variant`` with the head's decode kept in float, or why not. The decode ops are found on
    the float TFLite when the candidate is built (the plan comes before the conversion); the ONNX
    graph's decode (``head_scope``) decides here whether there is one to keep, and, with the
    compiler, gives the device rank: the ops from its first decode node on (``cpu_ops_from``'s
    rule, counted on the graph before conversion)."""
    from edgekit.optimize.head_scope import head_scope

    scope = head_scope(ctx.model_path, ctx.heads)
    name = f"{variant.label}, {scope.what} head in float"
    if not scope.nodes:
        return (), ((name, scope.why),)
    rank = None
    if compiler is not None:
        import onnx

        names = [n.name for n in onnx.load(str(ctx.model_path), load_external_data=False).graph.node]
        rank = len(names) - names.index(scope.nodes[0])
    return (_head_candidate(shared, variant, compiler, scope.what, rank),), ()


def _head_candidate(
    shared: _Shared,
    variant: QuantVariant,
    compiler: str | None,
    what: str,
    rank: int | None,
    also: tuple[str, ...] = (),
) -> Candidate:
    """``variant`` with the head's decode ops (``_Shared.head``) and ``also`` kept in float."""

    def kept(space: BuildSpace) -> tuple[QuantVariant, HeadScope]:
        scope = shared.head(shared.conversion(space))
        if not scope.nodes:
            raise EdgekitError(f"no {what} head to keep in float on the float TFLite: {scope.why}")
        return replace(variant, denylisted=tuple(dict.fromkeys((*scope.nodes, *also)))), scope

    def build(space: BuildSpace) -> Built:
        full, scope = kept(space)
        built = _int8_candidate(shared, full, compiler).build(space)
        return replace(built, notes=(*built.notes, f"{scope.why} (on the float TFLite)"))

    def rank_layers(space: BuildSpace, built: Built) -> list[tuple[tuple[str, ...], float]]:
        full, _ = kept(space)
        ranked = _int8_candidate(shared, full, compiler).rank_layers
        return ranked(space, built) if ranked is not None else []

    head = shared.head_nodes()
    if compiler is not None and head is not None:  # converted already (mixed precision on top): exact
        rank = shared.cpu_ops_from((*head, *also))
    more = len(set(also) - set(head or ()))  # a ranked group may hold decode ops already kept
    name = f"{variant.label}, {what} head in float" + (f" + {more} layer(s)" if more else "")
    return Candidate(
        name=name,
        precision="int8",
        runtime="litert",
        build=build,
        settings={
            "activations": "int8",
            "calibration": variant.calibration,
            "per_channel": variant.per_channel,
            "head_in_float": what,
            "denylisted": list(also),
        },
        family=f"int8 {'per-channel' if variant.per_channel else 'per-tensor'}",
        # on the Edge TPU the first op kept in float and everything after it run on the CPU
        device_rank=rank if compiler else None,
        exclude=lambda nodes: _head_candidate(shared, variant, compiler, what, rank, nodes),
        rank_layers=rank_layers,
        calib_call_samples=shared.call_samples,
    )


def _int16_candidate(shared: _Shared) -> Candidate:
    def build(space: BuildSpace) -> Built:
        from edgekit.compress import onnx2tflite

        conversion = shared.conversion(space)
        return _built(space, shared, onnx2tflite.quantize(conversion, "int16"), None, None)

    return Candidate(
        name=SIXTEEN_BY_EIGHT,
        precision="int8",
        runtime="litert",
        build=build,
        settings={"activations": "int16", "calibration": "minmax", "per_channel": True},
        family="int16 16x8",
        calib_call_samples=shared.call_samples,
    )


def _float_candidate(shared: _Shared) -> Candidate:
    """The float32 TFLite of the shared conversion, for LiteRT's CPU kernels: the engine's fallback
    under ``auto`` when no int8 candidate met the budget (a MobileNetV3 whose held-out decisions are
    too close for any int8 layout), shipped as fp32, never labelled int8."""

    def build(space: BuildSpace) -> Built:
        conversion = shared.conversion(space)
        return _built(space, shared, conversion.model(conversion.float32, "float32"), None, None)

    return Candidate(
        name=FLOAT_FALLBACK,
        precision="fp32",
        runtime="litert",
        build=build,
        settings={"activations": "float32"},
        family="float32",
    )


def _built(
    space: BuildSpace, shared: _Shared, converted: TfliteModel, variant: QuantVariant | None, compiler: str | None
) -> Built:
    conversion = shared.conversion(space)
    (space.work_dir / ARTIFACT).write_bytes(converted.quantized)
    artifact_sig = _artifact_signature(converted, space.served)
    mapping = _mapping(converted)
    precision = _precision(converted, variant, conversion.samples)
    excluded = variant.denylisted if variant is not None else ()
    if compiler is None or converted.activations != "int8":
        return Built(
            files={ARTIFACT: "artifact"},
            runtime="litert",
            precision=precision,
            # opened as the litert runtime opens it: timed here on host LiteRT (XNNPACK)
            open=lambda threads: served_runner(converted.quantized, artifact_sig, mapping, space.served, threads),
            excluded_nodes=excluded,
            detail=_CoralBuild(converted, variant, conversion.samples, None),
        )
    space.progress(f"[coral] {compiler} (Edge TPU)")
    compiled = compile_for_edgetpu(compiler, space.work_dir / ARTIFACT, space.work_dir)
    (space.work_dir / COMPILER_LOG).write_text(compiled[1])
    return Built(
        files={COMPILED: "artifact", COMPILER_LOG: "report"},
        runtime="litert",
        precision=precision,
        open=None,  # the Edge TPU is not here: "latency not measured here"
        intermediate=served_runner(converted.quantized, artifact_sig, mapping, space.served),
        excluded_nodes=excluded,
        detail=_CoralBuild(converted, variant, conversion.samples, compiled),
    )


def _mapping(converted: TfliteModel) -> tuple[TensorMapping, ...]:
    return tuple(
        TensorMapping(link.served, link.artifact, link.transpose) for link in (*converted.inputs, *converted.outputs)
    )


def _precision(converted: TfliteModel, variant: QuantVariant | None, samples: int) -> Precision:
    if converted.activations == "float32":
        method = "onnx2tf float32 TFLite, not quantized (LiteRT CPU; the Edge TPU runs int8 only)"
        return Precision("fp32", "fp32", method)
    if variant is None:
        return Precision(
            "int8",
            "int16",
            f"onnx2tf -> TFLiteConverter 16x8 PTQ (int16 activations, int8 per-channel weights), "
            f"{samples} calibration samples",
        )
    ranges = "min/max" if variant.calibration == "minmax" else f"{variant.percentile:g}th-percentile"
    weights = "per-channel" if variant.per_channel else "per-tensor"
    floats = f", {len(variant.denylisted)} op(s) kept in float" if variant.denylisted else ""
    return Precision(
        "int8",
        "int8",
        f"onnx2tf -> TFLiteConverter full-integer PTQ, {weights} weights, {ranges} activation ranges, "
        f"{samples} calibration samples{floats}",
    )


def describe_tflite(
    served: Signature, detail: _CoralBuild, opts: CoralOptions, extra_notes: tuple[str, ...] = ()
) -> BuildResult:
    """One candidate's artifact (already in the bundle folder) described for the manifest."""
    converted = detail.converted
    artifact_sig = _artifact_signature(converted, served)
    mapping = _mapping(converted)
    notes = [
        *(f"frozen: {step}" for step in converted.frozen.steps),
        f"onnx2tf float conversion vs ONNX Runtime: cosine {converted.float_cosine:.5f}",
        *extra_notes,
    ]
    variant = detail.variant
    floats = variant.denylisted if variant is not None else ()
    if floats:
        notes.append(
            f"mixed precision: {len(floats)} op(s) kept in float ({', '.join(floats[:4])}"
            + (", ..." if len(floats) > 4 else "")
            + "); on the Edge TPU a float op and every op after it run on the CPU (coral.ai/docs/edgetpu/models-intro)"
        )
        float_outputs = [o.name for o in artifact_sig.outputs if o.quant is None]
        if float_outputs:
            notes.append(
                f"output(s) {', '.join(float_outputs)} float32: written by ops kept in float (one int8 output "
                "scale would crush the small-valued channels again)"
            )
    common: dict[str, Any] = {
        "artifact_signature": artifact_sig,
        "mapping": mapping,
        "precision": _precision(converted, variant, detail.samples),
        "target_options": asdict(opts),
        "static": True,
        "provenance": _provenance(converted, detail.samples, variant),
    }
    if detail.compiled is None:
        if converted.activations == "int16":
            notes.append(
                "16x8 (int16 activations, int8 weights): runs on LiteRT's CPU kernels; the Edge TPU runs int8 only"
            )
        elif converted.activations == "float32":
            notes.append(
                "float32 fallback: no int8 candidate met the accuracy budget; runs on LiteRT's CPU kernels (XNNPACK), "
                "not on the Edge TPU (int8 only)"
            )
        else:
            reason = "edgetpu=false" if opts.edgetpu is False else f"{opts.edgetpu_compiler} is not on PATH"
            notes.append(f"not compiled for the Edge TPU ({reason}): the runtime uses the CPU (XNNPACK)")
        return BuildResult(
            files={ARTIFACT: "artifact"},
            compatibility=Compatibility(runtime="litert", runtime_version=_litert_version()),
            runnable_here=True,
            op_placement=interpreter_placement(converted.quantized, converted.activations, floats),
            notes=tuple(notes),
            **common,
        )
    version, log_text = detail.compiled
    notes.append(f"compiled for the Edge TPU by edgetpu_compiler {version}; validated on the uncompiled int8 model")
    notes.append("Edge TPU latency: not measured here")
    return BuildResult(
        files={COMPILED: "artifact", COMPILER_LOG: "report"},
        compatibility=Compatibility(
            runtime="litert",
            runtime_version=_litert_version(),
            accelerator="edgetpu",
            hardware={"edgetpu_compiler": version},
        ),
        runnable_here=False,
        op_placement=edgetpu_placement(log_text, COMPILER_LOG),
        notes=tuple(notes),
        intermediate=served_runner(converted.quantized, artifact_sig, mapping, served),
        intermediate_name="uncompiled int8 .tflite on the LiteRT CPU interpreter",
        **common,
    )


def _provenance(
    converted: TfliteModel, samples: int, variant: QuantVariant | None = None
) -> tuple[CompressionStep, ...]:
    from importlib.metadata import version

    from edgekit.compress.onnx2tflite import import_tensorflow

    tf_version = str(import_tensorflow().__version__)
    convert = CompressionStep(
        kind="convert",
        tool=f"onnx2tf {version('onnx2tf')}",
        settings={"layout": "NCHW -> NHWC", "output": "SavedModel -> float32 TFLite"},
        metric="worst output cosine, float TFLite vs ONNX Runtime",
        after=converted.float_cosine,
    )
    if converted.activations == "float32":
        return (*converted.frozen.provenance(), convert)
    return (
        *converted.frozen.provenance(),
        convert,
        CompressionStep(
            kind="quantize",
            tool=f"tensorflow {tf_version} TFLiteConverter",
            settings={
                "weights": "int8 per-channel" if variant is None or variant.per_channel else "int8 per-tensor",
                "activations": converted.activations,
                "mode": "16x8" if converted.activations == "int16" else "full-integer",
                "calibration": "minmax" if variant is None else variant.calibration,
                "calibration_samples": str(samples),
                **({"ops_in_float": str(len(variant.denylisted))} if variant and variant.denylisted else {}),
            },
        ),
    )


def _litert_version() -> str:
    try:
        import ai_edge_litert
    except ImportError as exc:
        raise MissingSDKError("ai-edge-litert", "tflite", "the coral target") from exc
    return str(getattr(ai_edge_litert, "__version__", "unknown"))


def _artifact_signature(converted: TfliteModel, served: Signature) -> Signature:
    from edgekit.compress.onnx2tflite import signature_details

    in_details, out_details = signature_details(converted.quantized)

    def spec(name: str, d: Mapping[str, Any], layout: str | None) -> TensorSpec:
        scale, zero_point = d["quantization"]
        dtype = np.dtype(d["dtype"]).name
        quant = QuantParams(float(scale), int(zero_point), dtype) if scale else None
        return TensorSpec(name, dtype, tuple(int(x) for x in d["shape"]), layout=layout, quant=quant)

    def layout(link: TensorLink, served_spec: TensorSpec) -> str | None:
        if link.transpose and served_spec.layout == "NCHW":
            return "NHWC"
        return served_spec.layout if not link.transpose else None

    inputs = tuple(
        spec(link.artifact, in_details[link.artifact], layout(link, served.input(link.served)))
        for link in converted.inputs
    )
    by_name = {o.name: o for o in served.outputs}
    outputs = tuple(
        spec(link.artifact, out_details[link.artifact], layout(link, by_name[link.served]))
        for link in converted.outputs
    )
    return Signature(inputs=inputs, outputs=outputs)


def served_runner(
    model: bytes, artifact: Signature, mapping: tuple[TensorMapping, ...], served: Signature, threads: int = 0
) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Served float inputs -> served float outputs on an int8 ``.tflite``, opened as the litert
    runtime opens it (CPU, XNNPACK, ``threads``; 0: the interpreter's default)."""
    from ai_edge_litert.interpreter import Interpreter

    from device_agents.runtimes.base import dequantize, quantize

    runner = Interpreter(model_content=model, num_threads=threads or None).get_signature_runner()
    specs = {s.name: s for s in (*artifact.inputs, *artifact.outputs)}
    links = {m.served: m for m in mapping}

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feed = {}
        for name, arr in inputs.items():
            m = links[name]
            x = np.transpose(arr, m.transpose) if m.transpose else arr
            q = specs[m.artifact].quant
            feed[m.artifact] = quantize(x, q) if q else np.ascontiguousarray(x)
        raw = runner(**feed)
        out = {}
        for o in served.outputs:
            m = links[o.name]
            q = specs[m.artifact].quant
            y = dequantize(raw[m.artifact], q) if q else np.asarray(raw[m.artifact])
            out[o.name] = np.transpose(y, np.argsort(m.transpose)) if m.transpose else y
        return out

    return run


def interpreter_placement(model: bytes, activations: str = "int8", floats: tuple[str, ...] = ()) -> OpPlacement:
    """The LiteRT interpreter's own op list (not compiled for the Edge TPU: every op on the CPU).
    ``floats``: op outputs kept in float (mixed precision), named in their entries."""
    from edgekit.compress.tflite_quant import op_outputs

    kept = set(floats)
    entries = tuple(
        OpPlacementEntry(
            op=kind,
            node=f"op{i} {out}" + (" (kept in float: on the Edge TPU this op and all after it run on the CPU)"
                                   if out in kept else ""),
            device="CPU",
        )
        for i, (kind, out, _) in enumerate(op_outputs(model))
    )  # fmt: skip
    why = "not compiled for the Edge TPU"
    if activations in ("int16", "float32"):
        why = f"{'16x8' if activations == 'int16' else 'float32'}: the Edge TPU runs int8 only"
    return OpPlacement(
        tool=f"litert interpreter op list ({why})",
        accelerated=0,
        fallback=len(entries),
        entries=entries,
    )


def compile_for_edgetpu(compiler: str, tflite: Path, out_dir: Path) -> tuple[str, str]:
    """Run ``edgetpu_compiler``; returns (compiler version, its operation log)."""
    try:
        proc = subprocess.run(
            [compiler, "-s", "-o", str(out_dir), str(tflite)],
            capture_output=True,
            text=True,
            timeout=EDGETPU_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EdgekitError(f"{compiler} could not run: {exc}") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise EdgekitError(f"{compiler} failed (exit {proc.returncode}): {tail}")
    version = re.search(r"Edge TPU Compiler version (\S+)", proc.stdout)
    produced = out_dir / f"{tflite.stem}_edgetpu.tflite"
    if not produced.is_file():
        raise EdgekitError(f"{compiler} reported success but wrote no {produced.name}")
    if produced.name != COMPILED:
        produced.rename(out_dir / COMPILED)
    log = out_dir / f"{tflite.stem}_edgetpu.log"
    text = log.read_text() if log.is_file() else proc.stdout
    if log.is_file() and log.name != COMPILER_LOG:
        log.unlink()
    return (version.group(1) if version else "unknown"), text


def edgetpu_placement(log_text: str, log_file: str) -> OpPlacement:
    """Parse the compiler's ``Operator / Count / Status`` table (one entry per op type and status)."""
    entries, accelerated, fallback = [], 0, 0
    in_table = False
    for line in log_text.splitlines():
        if re.match(r"^\s*Operator\s+Count\s+Status", line):
            in_table = True
            continue
        row = _LOG_ROW.match(line.strip()) if in_table else None
        if row is None:
            continue
        count, status = int(row["count"]), row["status"]
        on_tpu = status.startswith("Mapped to Edge TPU")
        accelerated += count if on_tpu else 0
        fallback += 0 if on_tpu else count
        entries.append(
            OpPlacementEntry(op=row["op"], node=f"{count} op(s): {status}", device="EdgeTPU" if on_tpu else "CPU")
        )
    return OpPlacement(
        tool="edgetpu_compiler", accelerated=accelerated, fallback=fallback, entries=tuple(entries), log_file=log_file
    )
