"""``intel`` target: OpenVINO IR (``model.xml`` + ``model.bin``) for Intel CPU, iGPU and NPU.

Precisions:
- ``int8``: NNCF post-training quantization on the calibration set (FakeQuantize on weights and
  activations). If the configured recipe misses the default validation gate on the calibration
  samples, a more accurate recipe is tried (``mixed`` preset, full bias correction) and the
  manifest says which one was used.
- ``int8-weights`` / ``int4-weights``: ``nncf.compress_weights`` (weights only, activations stay
  float; meant for MatMul-heavy models). INT4 keeps a share of the layers (``1 - int4_ratio``)
  and, by NNCF's default, the first and last layers in INT8; a build that put no weight in INT4
  is refused rather than labelled int4.
- ``fp16``: weights stored as FP16 (GPU/NPU run FP16; the CPU plugin upconverts).
- ``fp32``: the IR as converted.

The op-placement report comes from OpenVINO's ``Core.query_model`` for the configured device.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np

from edgekit.bundle.manifest import (
    Compatibility,
    OpPlacement,
    OpPlacementEntry,
    Precision,
    Signature,
    TensorMapping,
    TensorSpec,
)
from edgekit.errors import ConfigError, MissingSDKError, ModelFormatError
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.targets.op_support import onnx_nodes_by_name, raise_unsupported
from edgekit.validate.calib import fixed_batch, iter_batches, sample_count

DEVICES = ("CPU", "GPU", "NPU", "AUTO")
PRESETS = ("performance", "mixed")
ARTIFACT_XML = "model.xml"
ARTIFACT_BIN = "model.bin"
_OV_DTYPES = {"f32": "float32", "f16": "float16", "i8": "int8", "u8": "uint8", "i32": "int32", "i64": "int64"}


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
    subset_size: int = 300  # calibration samples NNCF uses for statistics
    model_type: Literal["", "transformer"] = ""  # "transformer" turns on NNCF's SmoothQuant & co.
    int4_group_size: int = 128  # -1 = per output channel
    int4_ratio: float = 0.8  # share of the weights in INT4, the rest INT8
    int4_all_layers: bool = False  # also the first and last weight layers (NNCF keeps them INT8 by default)

    def __post_init__(self) -> None:
        _choice("targets.intel.device", self.device, DEVICES)
        _choice("targets.intel.nncf_preset", self.nncf_preset, PRESETS)
        _choice("targets.intel.model_type", self.model_type, ("", "transformer"))
        if self.subset_size < 1:
            raise ConfigError(f"targets.intel.subset_size: must be >= 1, got {self.subset_size}")
        if self.int4_group_size != -1 and self.int4_group_size < 1:
            raise ConfigError(f"targets.intel.int4_group_size: must be -1 or >= 1, got {self.int4_group_size}")
        if not 0.0 < self.int4_ratio <= 1.0:
            raise ConfigError(f"targets.intel.int4_ratio: must be in (0, 1], got {self.int4_ratio}")


def _import_openvino() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise MissingSDKError("openvino", "openvino", "the intel target") from exc
    return openvino


def _import_nncf() -> Any:
    try:
        import nncf
    except ImportError as exc:
        raise MissingSDKError("nncf", "openvino", "quantizing for the intel target") from exc
    return nncf


def ov_version(ov: Any) -> str:
    return str(ov.get_version()).split("-")[0]


@dataclass(frozen=True)
class _Recipe:
    preset: str
    fast_bias_correction: bool

    @property
    def label(self) -> str:
        return f"preset={self.preset} bias_correction={'fast' if self.fast_bias_correction else 'full'}"


class IntelTarget:
    name: ClassVar[str] = "intel"
    runtime: ClassVar[str] = "openvino"
    precisions: ClassVar[tuple[str, ...]] = ("int8", "fp16", "fp32", "int8-weights", "int4-weights")
    Options: ClassVar[type] = IntelOptions
    static_shapes: ClassVar[bool] = False

    def check_model(self, model_path: Path) -> None:
        """Raise ``UnsupportedOpError`` for ops OpenVINO's ONNX frontend cannot convert."""
        _import_openvino()
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
                    self.name, f"OpenVINO {ov_version(_import_openvino())} ONNX frontend", model_path, found
                )
            raise ModelFormatError(f"{model_path}: OpenVINO could not convert {', '.join(unconverted)}")

    def build(self, ctx: BuildContext) -> BuildResult:
        ov = _import_openvino()
        opts: IntelOptions = ctx.options or IntelOptions()
        core = ov.Core()
        notes: list[str] = []
        if ctx.precision == "int8":
            model, precision = self._quantize(core, ctx, opts, notes)
        elif ctx.precision in ("int8-weights", "int4-weights"):
            model, precision = self._compress_weights(convert_onnx(ov, ctx.model_path), ctx.precision, opts)
        elif ctx.precision == "fp32":
            model = convert_onnx(ov, ctx.model_path)
            precision = Precision("fp32", "fp32", f"openvino {ov_version(ov)} convert")
        elif ctx.precision == "fp16":
            model = convert_onnx(ov, ctx.model_path)
            # The CPU plugin computes FP16 weights in FP32 (its only f16-like mode is bf16); GPU/NPU in FP16.
            activations: Literal["fp16", "fp32"] = (
                "fp16" if inference_precision(opts.device, ctx.precision) == "f16" else "fp32"
            )
            precision = Precision("fp16", activations, f"openvino {ov_version(ov)} convert, weights compressed to fp16")
        else:
            raise ConfigError(f"--precision: {ctx.precision!r} is not one of {', '.join(self.precisions)} for intel")
        xml = ctx.out_dir / ARTIFACT_XML
        ov.save_model(model, str(xml), compress_to_fp16=ctx.precision == "fp16")
        saved = core.read_model(str(xml))
        artifact_sig, mapping = _artifact_signature(saved, ctx.served)
        placement = _op_placement(core, saved, opts.device, notes)
        here = opts.device in ("CPU", "AUTO") or _available(core, opts.device)
        intermediate = None
        if not here:
            intermediate = served_fn(_compile_cpu(core, saved), ctx.served)
            notes.append(f"device {opts.device} is not on this host: validated with the CPU plugin on the same IR")
        accelerator = {"GPU": "intel-gpu", "NPU": "intel-npu"}.get(opts.device)
        return BuildResult(
            files={ARTIFACT_XML: "artifact", ARTIFACT_BIN: "artifact"},
            compatibility=Compatibility(runtime="openvino", runtime_version=ov_version(ov), accelerator=accelerator),
            artifact_signature=artifact_sig,
            mapping=mapping,
            precision=precision,
            runnable_here=here,
            op_placement=placement,
            notes=tuple(notes),
            target_options={**asdict(opts), "inference_precision": inference_precision(opts.device, ctx.precision)},
            intermediate=intermediate,
            intermediate_name="openvino CPU plugin (same IR)" if intermediate else "",
        )

    # -- precisions -------------------------------------------------------------------
    def _quantize(self, core: Any, ctx: BuildContext, opts: IntelOptions, notes: list[str]) -> tuple[Any, Precision]:
        """NNCF PTQ; the configured recipe first, then NNCF's more accurate one if it misses the gate."""
        nncf = _import_nncf()
        batch = fixed_batch(ctx.served) or 1
        samples = [feed for feed in iter_batches(ctx.calib, batch) if sample_count(feed) == batch]
        if not samples:
            raise ConfigError(f"--calib: the intel target needs at least {batch} calibration sample(s) for int8")
        recipes = list(dict.fromkeys([_Recipe(opts.nncf_preset, True), _Recipe("mixed", False)]))
        used = min(opts.subset_size, len(samples)) * batch
        tried: list[tuple[_Recipe, Any, Any]] = []
        for recipe in recipes:
            ctx.progress(f"[intel] NNCF int8 {recipe.label}")
            model = nncf.quantize(
                convert_onnx(_import_openvino(), ctx.model_path),
                nncf.Dataset(samples),
                preset=nncf.QuantizationPreset(recipe.preset),
                target_device=nncf.TargetDevice.ANY if opts.device == "AUTO" else nncf.TargetDevice(opts.device),
                subset_size=opts.subset_size,
                fast_bias_correction=recipe.fast_bias_correction,
                model_type=nncf.ModelType.TRANSFORMER if opts.model_type == "transformer" else None,
            )
            if ctx.evaluate is None:  # outside the packager: nothing to judge recipes by
                tried.append((recipe, model, None))
                break
            comparison = ctx.evaluate(served_fn(_compile_cpu(core, model), ctx.served))
            tried.append((recipe, model, comparison))
            verdict = "passed" if comparison.passed else "failed: " + "; ".join(comparison.failures)
            notes.append(f"tried nncf {recipe.label}: {comparison.summary()} ({verdict})")
            if comparison.passed:
                break
        passing = [t for t in tried if t[2] is None or t[2].passed]
        recipe, model, _ = passing[0] if passing else max(tried, key=lambda t: t[2].top1_agreement or t[2].cosine or 0)
        if len(tried) > 1:
            notes.append(f"chose nncf {recipe.label}")
        kind = f" model_type={opts.model_type}" if opts.model_type else ""
        method = f"nncf {nncf.__version__} ptq {recipe.label}{kind} samples={used}"
        return model, Precision("int8", "int8", method)

    def _compress_weights(self, source: Any, precision: str, opts: IntelOptions) -> tuple[Any, Precision]:
        nncf = _import_nncf()
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


# -- helpers used by build -------------------------------------------------------------
def inference_precision(device: str, precision: str) -> str:
    """OpenVINO's ``INFERENCE_PRECISION_HINT`` that computes what the manifest's precision says.

    Left to itself the CPU plugin computes in bf16 on CPUs that have it (AVX512-BF16, AMX), which
    is not what an fp32 / int8 / fp16 manifest promises; the runtime sets this hint explicitly.
    """
    return "f16" if precision == "fp16" and device in ("GPU", "NPU") else "f32"


def convert_onnx(ov: Any, path: Path) -> Any:
    """The ONNX model as an OpenVINO model, the way ``ovc`` converts it.

    ``Core.read_model`` on an ONNX file skips the MOC transformations ``convert_model`` runs: on
    a model with dynamic height/width (paddle2onnx's PP-OCR classifier) it kept 191 ShapeOf and 53
    Broadcast nodes for the conv biases and left HSwish unfused, which made the INT8 IR 1.8x the
    size of the FP32 ONNX (XML 780 KB) and gave NNCF a graph it could not pattern-match.
    """
    return ov.convert_model(str(path))


def _compile_cpu(core: Any, model: Any) -> Any:
    return core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})


def _available(core: Any, device: str) -> bool:
    """``GPU`` is available when OpenVINO lists ``GPU`` or ``GPU.0``, ``GPU.1``, ..."""
    return any(device in (d, d.split(".")[0]) for d in core.available_devices)


def served_fn(compiled: Any, served: Signature) -> Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Served inputs -> served outputs on a compiled OpenVINO model (it keeps the ONNX tensor names)."""
    ports = {name: port for port in compiled.outputs for name in port.get_names()}
    missing = [o.name for o in served.outputs if o.name not in ports]
    if missing:
        raise ModelFormatError(f"the OpenVINO model lost output {missing[0]!r} of the source model")
    outputs = [(o.name, ports[o.name]) for o in served.outputs]

    def run(inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        result = compiled.create_infer_request().infer(inputs)
        return {name: np.array(result[port]) for name, port in outputs}

    return run


def _weight_types(model: Any) -> dict[str, int]:
    """How many constants of the model have each element type (``i4``, ``u8``, ``f32``, ...)."""
    counts: dict[str, int] = {}
    for op in model.get_ordered_ops():
        if op.get_type_name() == "Constant":
            name = op.get_output_element_type(0).get_type_name()
            counts[name] = counts.get(name, 0) + 1
    return counts


def _port_dtype(port: Any) -> str:
    name = port.get_element_type().get_type_name()
    if name not in _OV_DTYPES:
        raise ModelFormatError(
            f"OpenVINO tensor {port.get_any_name()!r} has type {name}, which no manifest dtype matches"
        )
    return _OV_DTYPES[name]


def _artifact_signature(model: Any, served: Signature) -> tuple[Signature, tuple[TensorMapping, ...]]:
    """The IR's tensors, matched to the served ones by name (OpenVINO keeps ONNX names) or position."""

    def specs(ports: list[Any], served_specs: tuple[TensorSpec, ...]) -> list[tuple[TensorSpec, TensorMapping]]:
        if len(ports) != len(served_specs):
            raise ModelFormatError(f"the IR has {len(ports)} tensors where the source model has {len(served_specs)}")
        out = []
        for i, (port, want) in enumerate(zip(ports, served_specs, strict=True)):
            names = port.get_names()
            name = want.name if want.name in names else port.get_any_name()
            shape = port.get_partial_shape()
            dims = tuple(
                int(d.get_length())
                if d.is_static
                else (want.shape[k] if k < len(want.shape) and isinstance(want.shape[k], str) else f"d{i}_{k}")
                for k, d in enumerate(shape)
            )
            spec = TensorSpec(name, _port_dtype(port), dims, layout=want.layout)
            out.append((spec, TensorMapping(served=want.name, artifact=name)))
        return out

    ins = specs(list(model.inputs), served.inputs)
    outs = specs(list(model.outputs), served.outputs)
    sig = Signature(inputs=tuple(s for s, _ in ins), outputs=tuple(s for s, _ in outs))
    return sig, tuple(m for _, m in (*ins, *outs))


def _op_placement(core: Any, model: Any, device: str, notes: list[str]) -> OpPlacement:
    """``query_model`` on ``device`` (CPU where the device is AUTO or not on this host)."""
    queried = device
    if device == "AUTO" or not _available(core, device):
        queried = "CPU"
        why = "a virtual device" if device == "AUTO" else "not on this host"
        notes.append(f"op placement queried for CPU: {device} is {why}")
    placed = core.query_model(model, queried)
    entries = tuple(
        OpPlacementEntry(
            op=op.get_type_name(), node=op.get_friendly_name(), device=placed.get(op.get_friendly_name(), "none")
        )
        for op in model.get_ordered_ops()
        if op.get_type_name() not in ("Constant", "Parameter", "Result")
    )
    on_device = sum(1 for e in entries if e.device == queried)
    return OpPlacement(
        tool=f"openvino query_model({queried})",
        accelerated=on_device,
        fallback=len(entries) - on_device,
        entries=entries,
    )
