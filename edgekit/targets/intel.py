"""``intel`` target: OpenVINO IR (``model.xml`` + ``model.bin``) for Intel CPU, iGPU and NPU.

The target describes candidates; the optimisation engine (``edgekit.optimize``) builds, measures
and chooses. Every candidate converts the *original* ONNX graph (``convert_model``), never ORT's
prepared one. Precisions:
- ``auto``: every candidate below; the engine picks the fastest within the budget, never slower
  than the FP32 IR.
- ``int8``: NNCF post-training quantization on the calibration subset (FakeQuantize on weights
  and activations); if the configured preset misses the budget, refinements: the ``mixed``
  preset with full bias correction, and ``quantize_with_accuracy_control``; then (``auto`` or
  ``--mixed-precision``) the most sensitive layers kept in float through NNCF's ``IgnoredScope``.
  Under ``auto``, where an output is a detector's or segmenter's head, also the head's decode kept
  in float from the start (``edgekit.optimize.head_scope``).
- ``int8-weights`` / ``int4-weights``: ``nncf.compress_weights`` (weights only, activations stay
  float; meant for MatMul-heavy models). INT4 keeps a share of the layers (``1 - int4_ratio``)
  and, by NNCF's default, the first and last layers in INT8; a build that put no weight in INT4
  is refused rather than labelled int4.
- ``fp16``: weights stored as FP16 (GPU/NPU run FP16; the CPU plugin upconverts).
- ``fp32``: the IR as converted.
- ``bf16``: the IR, weights stored in fp16, computed in bf16 by the CPU plugin (``INFERENCE_PRECISION_HINT`` bf16,
  which the manifest records and the runtime sets): what OpenVINO does by itself on CPUs with
  AVX512-BF16 / AMX, measured and gated as a lossy candidate of its own. Only for the CPU device
  and only where this host's OpenVINO reports ``BF16`` (else ``auto`` records it as skipped and an
  explicit ``bf16`` is refused: the host could not measure it).

The op-placement report comes from OpenVINO's ``Core.query_model`` for the configured device.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

from edgekit.bundle.manifest import Precision
from edgekit.errors import ConfigError, ModelFormatError
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, Refinement
from edgekit.optimize.head_scope import head_offer
from edgekit.optimize.openvino_candidates import (
    ACCURACY_CONTROL_MAX_LAYERS,
    ACCURACY_CONTROL_RANKING_SAMPLES,
    BF16_NAME,
    NncfRecipe,
    bf16_candidate,
    bf16_unavailable,
    convert_onnx,
    import_nncf,
    import_openvino,
    ir_build_result,
    ir_built,
    ir_candidate,
    nncf_bf16_offer,
    nncf_candidate,
    ov_version,
)
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.targets.op_support import onnx_nodes_by_name, raise_unsupported

DEVICES = ("CPU", "GPU", "NPU", "AUTO")
PRESETS = ("performance", "mixed")


def _choice(path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        near = difflib.get_close_matches(value, choices, n=1)
        hint = f"; did you mean {near[0]!r}?" if near else ""
        raise ConfigError(f"{path}: {value!r} is not one of {', '.join(choices)}{hint}")


@dataclass(frozen=True)
class IntelOptions:
    """Settings of the ``intel`` target (``targets.intel.*``)."""

    device: str = "CPU"  # the device the IR is quantized and its op placement queried for
    nncf_preset: Literal["performance", "mixed"] = "performance"
    model_type: Literal["", "transformer"] = ""  # "transformer" turns on NNCF's SmoothQuant & co.
    int4_group_size: int = 128  # -1 = per output channel
    int4_ratio: float = 0.8  # share of the weights in INT4, the rest INT8
    int4_all_layers: bool = False  # also the first and last weight layers (NNCF keeps them INT8 by default)
    # quantize_with_accuracy_control's bounds (why these defaults: edgekit.optimize.openvino_candidates)
    accuracy_control_max_layers: int = ACCURACY_CONTROL_MAX_LAYERS
    accuracy_control_ranking_samples: int = ACCURACY_CONTROL_RANKING_SAMPLES

    def __post_init__(self) -> None:
        _choice("targets.intel.device", self.device, DEVICES)
        _choice("targets.intel.nncf_preset", self.nncf_preset, PRESETS)
        _choice("targets.intel.model_type", self.model_type, ("", "transformer"))
        if self.int4_group_size != -1 and self.int4_group_size < 1:
            raise ConfigError(f"targets.intel.int4_group_size: must be -1 or >= 1, got {self.int4_group_size}")
        if not 0.0 < self.int4_ratio <= 1.0:
            raise ConfigError(f"targets.intel.int4_ratio: must be in (0, 1], got {self.int4_ratio}")
        for key in ("accuracy_control_max_layers", "accuracy_control_ranking_samples"):
            if getattr(self, key) < 1:
                raise ConfigError(f"targets.intel.{key}: must be >= 1, got {getattr(self, key)}")


class IntelTarget:
    name: ClassVar[str] = "intel"
    runtime: ClassVar[str] = "openvino"
    precisions: ClassVar[tuple[str, ...]] = ("int8", "fp16", "fp32", "bf16", "int8-weights", "int4-weights", "auto")
    Options: ClassVar[type] = IntelOptions
    static_shapes: ClassVar[bool] = False

    def check_model(self, model_path: Path) -> None:
        """Raise ``UnsupportedOpError`` for ops OpenVINO's ONNX frontend cannot convert."""
        import_openvino()
        from openvino.frontend import FrontEndManager

        frontend = FrontEndManager().load_by_framework("onnx")
        try:
            partial = frontend.convert_partially(frontend.load(str(model_path)))
        except RuntimeError as exc:
            raise ModelFormatError(f"{model_path}: OpenVINO cannot read the model ({exc})") from exc
        unconverted = [
            op.get_friendly_name() for op in partial.get_ordered_ops() if "FrameworkNode" in op.get_type_name()
        ]
        if unconverted:
            nodes = onnx_nodes_by_name(model_path)
            found = [nodes[name] for name in unconverted if name in nodes]
            if found:
                raise_unsupported(
                    self.name, f"OpenVINO {ov_version(import_openvino())} ONNX frontend", model_path, found
                )
            raise ModelFormatError(f"{model_path}: OpenVINO could not convert {', '.join(unconverted)}")

    def candidates(self, ctx: BuildContext) -> CandidatePlan:
        """OpenVINO/NNCF get the graph as given with its shape sub-graphs folded, not ORT's
        prepared one (see ``edgekit.optimize.openvino_candidates``)."""
        opts: IntelOptions = ctx.options or IntelOptions()
        want, auto = ctx.precision, ctx.precision == "auto"
        source = ctx.source_path or ctx.model_path
        dev = opts.device
        first = [ir_candidate("openvino fp32 ir", "fp32", source, dev, baseline=True)]
        refinements: list[Refinement] = []
        skipped: list[tuple[str, str]] = []
        if auto or want == "fp16":
            first.append(ir_candidate("openvino fp16 ir", "fp16", source, dev))
        if auto or want == "bf16":
            why = bf16_unavailable(dev)
            if not why:
                first.append(bf16_candidate(source, dev))
            elif auto:
                skipped.append((BF16_NAME, why))
            else:
                raise ConfigError(
                    f"--precision bf16: {why}, so bf16 cannot be measured here; package on a host whose CPU "
                    "has AVX512-BF16 or AMX, or choose fp32 / fp16"
                )
        if auto or want == "int8":
            kind = opts.model_type
            base = NncfRecipe(opts.nncf_preset, True)
            first.append(nncf_candidate(source, base, dev, ctx.model_path, kind))
            if auto:  # a detector's / segmenter's decode in float (NNCF IgnoredScope), as Ultralytics exports
                offered, refused = head_offer(first[-1], source, ctx.heads)
                first.extend(offered)
                skipped.extend(refused)
                # the same IRs with what they keep in float computed in bf16, where the CPU has it
                offered, refused = nncf_bf16_offer(source, base, dev, ctx.model_path, ctx.heads, kind)
                first.extend(offered)
                skipped.extend(refused)
            control = NncfRecipe(
                opts.nncf_preset,
                True,
                accuracy_control=True,
                max_reverted_layers=opts.accuracy_control_max_layers,
                ranking_samples=opts.accuracy_control_ranking_samples,
            )
            for recipe in (NncfRecipe("mixed", False), control):
                if recipe != base:
                    refinements.append(
                        Refinement(nncf_candidate(source, recipe, dev, ctx.model_path, kind), of=base.label)
                    )
        from edgekit.compress.ort_quant import WEIGHT_ONLY_SHARE, matmul_weight_share

        share = matmul_weight_share(ctx.model_path)  # weight-only pays where MatMul/Gemm hold most weights
        for precision in ("int8-weights", "int4-weights"):
            if want == precision or (auto and share >= WEIGHT_ONLY_SHARE):
                first.append(_weights_candidate(source, precision, opts))
            elif auto:
                why = (
                    f"MatMul/Gemm hold {share:.0%} of the weights (< {WEIGHT_ONLY_SHARE:.0%}): not a MatMul-heavy graph"
                )
                skipped.append((f"nncf {precision}", why))
        return CandidatePlan(first=tuple(first), refinements=tuple(refinements), skipped=tuple(skipped))

    def finish(self, ctx: BuildContext, built: Built, built_dir: Path) -> BuildResult:
        opts: IntelOptions = ctx.options or IntelOptions()
        return ir_build_result(ctx, built, built_dir, device=opts.device, options=asdict(opts))


def _weights_candidate(source: Path, precision: str, opts: IntelOptions) -> Candidate:
    def build(space: BuildSpace) -> Built:
        ov = import_openvino()
        model, prec = _compress_weights(convert_onnx(ov, source), precision, opts)
        return ir_built(model, space, prec, opts.device)

    settings = {"recipe": f"nncf compress_weights {precision}"}
    if precision == "int4-weights":
        settings.update(group_size=str(opts.int4_group_size), ratio=str(opts.int4_ratio))
    return Candidate(
        name=f"nncf compress_weights {precision}",
        precision=precision,
        runtime="openvino",
        build=build,
        settings=settings,
        family=f"nncf {precision}",
    )


def _compress_weights(source: Any, precision: str, opts: IntelOptions) -> tuple[Any, Precision]:
    nncf = import_nncf()
    if precision == "int8-weights":
        mode, weights, extra = nncf.CompressWeightsMode.INT8_ASYM, "int8", {}
        method = "int8_asym per-channel"
    else:
        mode, weights = nncf.CompressWeightsMode.INT4_SYM, "int4"
        extra = {"group_size": opts.int4_group_size, "ratio": opts.int4_ratio, "all_layers": opts.int4_all_layers}
        method = f"int4_sym group_size={opts.int4_group_size} ratio={opts.int4_ratio}"
    try:
        model = nncf.compress_weights(source, mode=mode, **extra)
    except nncf.InvalidGroupSizeError as exc:
        channels = ", ".join(re.findall(r"channel size: (\d+)", str(exc))) or "unknown"
        raise ConfigError(
            f"targets.intel.int4_group_size: {opts.int4_group_size} does not divide the input channels of "
            f"every int4 layer (channels: {channels}); choose a divisor of them, or -1 for per-channel"
        ) from exc
    counts = _weight_types(model)
    int4, int8 = counts.get("i4", 0) + counts.get("u4", 0), counts.get("i8", 0) + counts.get("u8", 0)
    if weights == "int4" and not int4:
        raise ConfigError(
            f"targets.intel.int4_all_layers: NNCF put no weight in int4 ({int8} weight tensors in int8): it keeps "
            "the first and last weight layers in int8 unless int4_all_layers=true; set it, or build int8-weights"
        )
    if not int4 + int8:
        raise ConfigError(f"--precision {precision}: the model has no weights NNCF compresses (MatMul, Conv, Gemm)")
    detail = f"{int4} weight tensors int4, {int8} int8" if weights == "int4" else f"{int8} weight tensors int8"
    return model, Precision(weights, "fp32", f"nncf {nncf.__version__} compress_weights {method} ({detail})")  # type: ignore[arg-type]  # int8/int4


def _weight_types(model: Any) -> dict[str, int]:
    """How many constants of the model have each element type (``i4``, ``u8``, ``f32``, ...)."""
    counts: dict[str, int] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant":
            name = op.get_output_element_type(0).get_type_name()
            counts[name] = counts.get(name, 0) + 1
    return counts
