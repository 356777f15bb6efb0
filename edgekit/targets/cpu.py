"""``cpu`` target: an artifact for any x86_64 / arm64 CPU, ONNX Runtime or OpenVINO.

The target describes candidates; the optimisation engine (``edgekit.optimize``) builds them,
measures them side by side on this host and chooses: which recipe is fastest differs per model
and per CPU, so it is measured, never assumed. Candidates:

- ``fp32``: the prepared graph (ONNX Runtime basic optimisation) — the baseline ``auto`` never
  ships anything slower than; under ``auto`` also ORT's offline *extended* optimisation, still
  ``.onnx``;
- ``fp16``: ONNX Runtime's float16 converter, float32 inputs/outputs kept;
- ``int8``: ORT static QDQ / QOperator, U8S8 / S8S8, per-channel / per-tensor (bounded by
  ``max_candidates``), with Percentile / Entropy calibration as refinements of a layout that
  missed the budget; QDQ layouts can keep their most sensitive layers in float (mixed precision);
  under ``auto``, where an output is a detector's or segmenter's head, the first QDQ layout with
  the head's decode kept in float (``edgekit.optimize.head_scope``);
- ``int8-weights``: ORT dynamic INT8 of MatMul/Gemm weights, per-tensor and per-channel, on the
  prepared graph and, where ONNX Runtime's transformer optimizer fuses something (attention,
  SkipLayerNormalization, Gelu), on the fused graph; 7-bit weights (``reduce_range``) as a
  refinement of a layout that missed the budget (u8s8 saturation without VNNI); ``int4-weights``:
  ``MatMulNBits`` with float compute and with accuracy level 4 (int8 compute); under ``auto``
  only where the graph has MatMul/Gemm weights;
- under ``auto`` with OpenVINO installed: OpenVINO FP32 IR and NNCF INT8 IR built from the
  source graph, shape sub-graphs folded (``edgekit.optimize.openvino_candidates`` says why), the
  NNCF INT8 IR with a detector's or segmenter's decode in float where there is such a head (as the
  ``intel`` target offers it, so both targets share the build), its float ops in bf16, and the IR
  (weights stored in fp16) computed in bf16 where this CPU's OpenVINO reports ``BF16``, served by
  the ``openvino`` runtime when one wins.

Explicit precisions keep ONNX Runtime as the runtime (a ``.onnx`` artifact); ``auto`` chooses the
runtime too, and the manifest's runtime names it.
"""

from __future__ import annotations

import importlib.util
import shutil
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Literal

from edgekit.bundle.codec import to_data
from edgekit.bundle.manifest import Compatibility, Precision
from edgekit.compress.ort_quant import (
    WEIGHT_ONLY_SHARE,
    StaticQuantConfig,
    fuse_transformer,
    matmul_weight_share,
    optimize_offline,
    quantize_static_int8,
    quantize_weights_int4,
    quantize_weights_int8,
)
from edgekit.errors import MissingSDKError
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, Refinement
from edgekit.optimize.head_scope import head_offer
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.validate.calib import fixed_batch, take
from edgekit.validate.ort_runner import ort_open
from edgekit.validate.placement import ort_op_placement

ARTIFACT = "model.onnx"


@dataclass(frozen=True)
class CpuOptions:
    """Settings of the ``cpu`` target (``--option cpu.KEY=VALUE``). ``auto`` = let the search choose."""

    activations: Literal["auto", "uint8", "int8"] = "auto"
    per_channel: Literal["auto", "on", "off"] = "auto"
    quant_format: Literal["auto", "qdq", "qoperator"] = "auto"
    calibration: Literal["auto", "minmax", "percentile", "entropy"] = "auto"
    reduce_range: bool = False  # 7-bit weights, for x86 CPUs without VNNI
    percentile: float = 99.999  # for calibration=percentile (needs > 1e5 activation values to clip one outlier)
    max_candidates: int = 6  # bound on static INT8 configurations built (calibration refinements included)
    int4_block_size: int = 32  # MatMulNBits block size for int4-weights
    openvino: bool = True  # under --precision auto, also try the OpenVINO runtime when it is installed

    def __post_init__(self) -> None:
        if self.max_candidates < 1:
            raise ValueError(f"max_candidates must be >= 1, got {self.max_candidates}")
        if not 0 < self.percentile <= 100:
            raise ValueError(f"percentile must be in (0, 100], got {self.percentile}")
        if self.int4_block_size < 16 or self.int4_block_size & (self.int4_block_size - 1):
            raise ValueError(f"int4_block_size must be a power of two >= 16, got {self.int4_block_size}")


class CpuTarget:
    name: ClassVar[str] = "cpu"
    runtime: ClassVar[str] = "onnxruntime"
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "fp16", "int8", "int8-weights", "int4-weights", "auto")
    Options: ClassVar[type] = CpuOptions
    static_shapes: ClassVar[bool] = False

    def check_model(self, model_path: Path) -> None:
        """ONNX Runtime's CPU provider runs every standard ONNX op; nothing to refuse up front."""
        _onnxruntime()

    # -- candidates ---------------------------------------------------------------------------
    def candidates(self, ctx: BuildContext) -> CandidatePlan:
        opts: CpuOptions = ctx.options
        want = ctx.precision
        auto = want == "auto"
        prepared = ctx.model_path
        max_refinements = 0
        first: list[Candidate] = [_ort_candidate("ort fp32", "fp32", prepared, _copy, baseline=True)]
        refinements: list[Refinement] = []
        skipped: list[tuple[str, str]] = []
        if auto:
            first.append(_ort_candidate("ort fp32 offline-optimised (extended)", "fp32", prepared, _offline))
            if ctx.source_path is not None and ctx.source_path != prepared:
                # the graph as given (shape sub-graphs folded): the rest of preparation (opset
                # upgrade, basic optimisation) is measured too
                first.append(_ort_candidate("ort fp32 source graph", "fp32", ctx.source_path, _copy_source))
        if auto or want == "fp16":
            first.append(_ort_candidate("ort fp16", "fp16", prepared, _fp16))
        if auto or want == "int8":
            configs = candidate_configs(opts)
            first.extend(_static_candidate(prepared, config) for config in configs)
            if opts.calibration == "auto":
                refinements.extend(
                    Refinement(_static_candidate(prepared, replace(config, calibration=method)), of=config.label)
                    for config in configs
                    for method in ("percentile", "entropy")
                )
            max_refinements = max(0, opts.max_candidates - len(configs))
            if auto:  # a detector's / segmenter's decode in float: the recipe INT8 detectors ship with
                qdq = next((_static_candidate(prepared, c) for c in configs if c.quant_format == "qdq"), None)
                offered, refused = head_offer(qdq, prepared, ctx.heads)
                first.extend(offered)
                skipped.extend(refused)
        share = matmul_weight_share(prepared)  # weight-only pays where MatMul/Gemm hold most weights
        for precision in ("int8-weights", "int4-weights"):
            if want == precision or (auto and share >= WEIGHT_ONLY_SHARE):
                if precision == "int8-weights":
                    first.extend(_dynamic_candidates(ctx, auto, refinements, skipped))
                else:
                    label = f"ort MatMulNBits int4 block {opts.int4_block_size}"
                    first.append(_ort_candidate(label, precision, prepared, _int4(opts.int4_block_size)))
                    # accuracy level 4: int8 compute (activations quantized per call); whether
                    # it pays depends on the CPU's int8 dot-product support: measured
                    first.append(_ort_candidate(f"{label} accuracy-level 4", precision, prepared,
                                                _int4(opts.int4_block_size, 4), accuracy_level=4))  # fmt: skip
            elif auto:
                why = (
                    f"MatMul/Gemm hold {share:.0%} of the weights (< {WEIGHT_ONLY_SHARE:.0%}): not a MatMul-heavy graph"
                )
                skipped.append((f"ort {precision}", why))
        if auto and opts.openvino:
            if importlib.util.find_spec("openvino") is None:
                skipped.append(
                    ("openvino fp32 / nncf int8", "openvino is not installed (pip install 'edgekit[openvino]')")
                )
            else:
                from edgekit.optimize import openvino_candidates as ov

                source = ctx.source_path or prepared
                first.append(ov.ir_candidate("openvino fp32 ir", "fp32", source, device="CPU"))
                base = ov.NncfRecipe("performance", True)
                first.append(ov.nncf_candidate(source, base, device="CPU", prepared=prepared))
                # the NNCF INT8 with the head's decode in float (IgnoredScope), as the intel target
                # offers it: the same candidate, so a run packaging both builds it once
                offered, refused = head_offer(first[-1], source, ctx.heads)
                first.extend(offered)
                skipped.extend(refused)
                offered, refused = ov.nncf_bf16_offer(source, base, "CPU", prepared, ctx.heads)
                first.extend(offered)
                skipped.extend(refused)
                why = ov.bf16_unavailable("CPU")
                if why:
                    skipped.append((ov.BF16_NAME, why))
                else:
                    first.append(ov.bf16_candidate(source, device="CPU"))
        return CandidatePlan(
            first=tuple(first),
            refinements=tuple(refinements),
            skipped=tuple(skipped),
            max_refinements=max_refinements,
            bound_name=f"cpu.max_candidates={opts.max_candidates}",
        )

    def finish(self, ctx: BuildContext, built: Built, built_dir: Path) -> BuildResult:
        """The chosen candidate's files in ``ctx.out_dir``, described for the manifest."""
        opts: CpuOptions = ctx.options
        if built.runtime == "openvino":
            from edgekit.optimize.openvino_candidates import ir_build_result

            return ir_build_result(ctx, built, built_dir, device="CPU", options=to_data(opts))
        ort = _onnxruntime()
        out = ctx.out_dir / ARTIFACT
        shutil.copyfile(built_dir / ARTIFACT, out)
        feed = take(ctx.calib, 0, fixed_batch(ctx.served) or 1)
        return BuildResult(
            files={ARTIFACT: "artifact"},
            compatibility=Compatibility(runtime="onnxruntime", runtime_version=ort.__version__),
            artifact_signature=ctx.served,
            mapping=(),
            precision=built.precision,
            runnable_here=True,
            op_placement=ort_op_placement(out, feed),
            notes=built.notes,
            target_options=to_data(opts),
        )


def candidate_configs(opts: CpuOptions) -> list[StaticQuantConfig]:
    """The static INT8 configurations of the first wave, in order, honouring the fixed options."""
    calibration = "minmax" if opts.calibration == "auto" else opts.calibration
    base = [
        StaticQuantConfig("uint8", True, "qdq"),
        StaticQuantConfig("uint8", True, "qoperator"),
        StaticQuantConfig("uint8", False, "qdq"),
        StaticQuantConfig("int8", True, "qdq"),
    ]
    out: list[StaticQuantConfig] = []
    for c in base:
        c = replace(
            c,
            activations=c.activations if opts.activations == "auto" else opts.activations,
            per_channel=c.per_channel if opts.per_channel == "auto" else opts.per_channel == "on",
            quant_format=c.quant_format if opts.quant_format == "auto" else opts.quant_format,
            calibration=calibration,
            reduce_range=opts.reduce_range,
            percentile=opts.percentile,
        )
        if c not in out:
            out.append(c)
    # leave room for the calibration refinements within max_candidates
    room = opts.max_candidates - (2 if opts.calibration == "auto" else 0)
    return out[: max(1, room)]


# -- candidate builders -------------------------------------------------------------------------


def _ort_candidate(
    name: str, precision: str, prepared: Path, make: Any, baseline: bool = False, **settings: Any
) -> Candidate:
    def build(space: BuildSpace) -> Built:
        out = space.work_dir / ARTIFACT
        prec = make(prepared, out, space)
        return Built(files={ARTIFACT: "artifact"}, runtime="onnxruntime", precision=prec, open=ort_open(out))

    return Candidate(
        name=name,
        precision=precision,
        runtime="onnxruntime",
        build=build,
        settings={"recipe": name, **settings},
        family=name,
        baseline=baseline,
    )


def _static_candidate(prepared: Path, config: StaticQuantConfig) -> Candidate:
    def build(space: BuildSpace) -> Built:
        out = space.work_dir / ARTIFACT
        # ranges cached per calibration method one folder up: shared by every layout
        quantize_static_int8(prepared, out, space.calib, config, space.work_dir.parent, space.calib_batch)
        return Built(
            files={ARTIFACT: "artifact"},
            runtime="onnxruntime",
            precision=Precision("int8", config.activations, config.label),
            open=ort_open(out),
            excluded_nodes=config.exclude,
        )

    def rank(space: BuildSpace, built: Built) -> list[tuple[tuple[str, ...], float]]:
        from edgekit.optimize.sensitivity import rank_qdq_layers

        return rank_qdq_layers(prepared, space.work_dir / ARTIFACT, space.calib, space.work_dir, space.calib_batch)

    qdq = config.quant_format == "qdq"
    return Candidate(
        name=config.label,
        precision="int8",
        runtime="onnxruntime",
        build=build,
        settings={**to_data(config), "exclude": list(config.exclude)},
        family=config.layout,
        exclude=(lambda nodes: _static_candidate(prepared, replace(config, exclude=nodes))) if qdq else None,
        rank_layers=rank if qdq else None,
    )


def _copy(src: Path, dst: Path, space: BuildSpace) -> Precision:
    shutil.copyfile(src, dst)
    return Precision("fp32", "fp32", "onnx fp32, prepared (see notes)")


def _copy_source(src: Path, dst: Path, space: BuildSpace) -> Precision:
    from edgekit.compress.onnx_prep import model_size_bytes

    if model_size_bytes(src) != src.stat().st_size:
        raise ValueError("the source model keeps its weights in external data files; the prepared graph ships instead")
    shutil.copyfile(src, dst)
    return Precision("fp32", "fp32", "onnx fp32, the source graph (shape sub-graphs folded)")


def _offline(src: Path, dst: Path, space: BuildSpace) -> Precision:
    optimize_offline(src, dst)
    return Precision("fp32", "fp32", "onnx fp32, onnxruntime offline optimisation (extended)")


def _fp16(src: Path, dst: Path, space: BuildSpace) -> Precision:
    import onnx
    from onnxruntime.transformers.float16 import convert_float_to_float16

    from edgekit.compress.shape_fold import empty_resize_inputs_as_float32

    model = convert_float_to_float16(onnx.load(str(src)), keep_io_types=True)
    empty_resize_inputs_as_float32(model)  # an empty ``scales`` cast from float16 makes ORT refuse the Resize
    onnx.save(model, str(dst))
    return Precision("fp16", "fp16", "onnxruntime float16 converter, float32 inputs/outputs kept")


DYNAMIC = "ort dynamic int8 (MatMul/Gemm weights)"


def _dynamic_candidates(
    ctx: BuildContext, auto: bool, refinements: list[Refinement], skipped: list[tuple[str, str]]
) -> list[Candidate]:
    """ORT dynamic INT8 layouts (which one is fastest depends on the CPU: measured, never assumed),
    and the same on the graph ONNX Runtime's transformer optimizer fused, where it fuses anything."""
    prepared = ctx.model_path
    per_channel = _ort_candidate(
        "ort dynamic int8 per-channel", "int8-weights", prepared, _dynamic(True, False), per_channel=True
    )
    out = [_ort_candidate(DYNAMIC, "int8-weights", prepared, _dynamic(False, False)), per_channel]
    seven_bit = _ort_candidate("ort dynamic int8 reduce-range", "int8-weights", prepared, _dynamic(False, True),
                               reduce_range=True)  # fmt: skip
    refinements.append(Refinement(seven_bit, of=DYNAMIC))
    fused_path = ctx.work_dir / "transformer-fused.onnx"
    name = "ort dynamic int8 transformer-fused"
    try:
        fused = fuse_transformer(prepared, fused_path)
    # The optimizer is pattern matching over arbitrary graphs and may raise anything on one it
    # was not written for; that form is then not a candidate, and the record says why.
    except Exception as exc:
        skipped.append((name, f"onnxruntime's transformer optimizer raised {type(exc).__name__}: {exc}"[:300]))
        return out
    if not fused:
        skipped.append((name, "onnxruntime's transformer optimizer fused nothing (no attention / LayerNorm / GELU)"))
        return out
    what = ",".join(f"{op}x{n}" for op, n in sorted(fused.items()))
    out.append(_ort_candidate(name, "int8-weights", fused_path, _dynamic(False, False), fused=what))
    out.append(_ort_candidate(f"{name} per-channel", "int8-weights", fused_path, _dynamic(True, False), fused=what,
                              per_channel=True))  # fmt: skip
    if auto:
        out.append(_ort_candidate("ort fp32 transformer-fused", "fp32", fused_path, _fused_fp32(what), fused=what))
    return out


def _dynamic(per_channel: bool, reduce_range: bool) -> Any:
    def make(src: Path, dst: Path, space: BuildSpace) -> Precision:
        quantize_weights_int8(src, dst, per_channel=per_channel, reduce_range=reduce_range)
        layout = ("per-channel " if per_channel else "") + ("7-bit " if reduce_range else "")
        return Precision("int8", "uint8", f"ort-dynamic MatMul/Gemm {layout}int8 weights, uint8 activations per call")

    return make


def _fused_fp32(what: str) -> Any:
    def make(src: Path, dst: Path, space: BuildSpace) -> Precision:
        shutil.copyfile(src, dst)
        return Precision("fp32", "fp32", f"onnx fp32, onnxruntime transformer optimizer fusions ({what})")

    return make


def _int4(block: int, accuracy_level: int | None = None) -> Any:
    def make(src: Path, dst: Path, space: BuildSpace) -> Precision:
        quantize_weights_int4(src, dst, block_size=block, accuracy_level=accuracy_level)
        if accuracy_level == 4:
            return Precision(
                "int4", "int8", f"ort MatMulNBits 4-bit symmetric, block {block}, accuracy level 4 (int8 compute)"
            )
        return Precision("int4", "fp32", f"ort MatMulNBits 4-bit symmetric, block {block} (MatMul/Gemm weights)")

    return make


def _onnxruntime() -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise MissingSDKError("onnxruntime", "host", "the cpu target") from exc
    return onnxruntime


__all__ = ["CpuOptions", "CpuTarget", "candidate_configs"]
