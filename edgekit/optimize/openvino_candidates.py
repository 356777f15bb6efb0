"""OpenVINO candidates: IR conversion, NNCF INT8 and the IR's bundle description, for every
target whose candidates run on OpenVINO (``intel``, and ``cpu`` where OpenVINO is installed).

Every candidate converts the *original* ONNX graph (``convert_onnx``), never ONNX Runtime's
prepared one: NNCF INT8 of a MobileNetV3-class graph kept 100 % top-1 agreement on the original
and 25 % after ONNX Runtime's optimisation had fused it. The op-placement report comes from
OpenVINO's ``Core.query_model`` for the configured device.

Every candidate is timed and gated compiled the way the ``openvino`` runtime compiles it, with the
same ``INFERENCE_PRECISION_HINT``: f32 for FP32 / INT8 / FP16 IRs on the CPU (left to itself the
CPU plugin computes in bf16 where the CPU has it), and bf16 for ``bf16_candidate`` (the IR, weights
stored in fp16, computed in bf16) and for the NNCF INT8 IR's "float ops bf16" form (what it keeps
in float computed in bf16), offered only where this CPU's OpenVINO reports ``BF16``
(``bf16_unavailable``).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal

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
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, RunFn
from edgekit.targets.base import BuildContext, BuildResult
from edgekit.validate.calib import fixed_batch, iter_batches, sample_count

ARTIFACT_XML = "model.xml"
ARTIFACT_BIN = "model.bin"
_OV_DTYPES = {"f32": "float32", "f16": "float16", "i8": "int8", "u8": "uint8", "i32": "int32", "i64": "int64"}
# quantize_with_accuracy_control: the most layers it may revert to float (NNCF's default is every
# quantized layer, one full evaluation each: over 9 minutes on a MobileNetV3-small at 224x224 on a
# 2-core machine), and the samples its layer ranking runs on (NNCF's default, 300: fewer ranked a
# tiny classifier's layers badly enough that all of them were reverted).
ACCURACY_CONTROL_MAX_LAYERS = 8
ACCURACY_CONTROL_RANKING_SAMPLES = 300
BF16_NAME = "openvino bf16 ir"
FLOAT_OPS_BF16 = "float ops bf16"
# NNCF INT8 IRs built in this process, by (source, its version, recipe, device, model type): the
# recipe's bf16 form (``nncf_candidate(float_bf16=True)``) reuses the IR instead of quantizing again
_QUANTIZED: dict[tuple[Any, ...], tuple[Path, str]] = {}
# the layers NNCF quantizes that accuracy control ranks one by one (at least these: it counts
# some elementwise ops too)
QUANTIZED_LAYERS = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm"})


def import_openvino() -> Any:
    try:
        import openvino
    except ImportError as exc:
        raise MissingSDKError("openvino", "openvino", "the intel target") from exc
    return openvino


def import_nncf() -> Any:
    try:
        import nncf
    except ImportError as exc:
        raise MissingSDKError("nncf", "openvino", "quantizing for the intel target") from exc
    return nncf


def ov_version(ov: Any) -> str:
    return str(ov.get_version()).split("-")[0]


@dataclass(frozen=True)
class NncfRecipe:
    """One ``nncf.quantize`` setting (``accuracy_control``: ``quantize_with_accuracy_control``)."""

    preset: str
    fast_bias_correction: bool
    accuracy_control: bool = False
    exclude: tuple[str, ...] = ()  # ONNX node names kept in float (NNCF IgnoredScope)
    max_reverted_layers: int = ACCURACY_CONTROL_MAX_LAYERS  # accuracy control's bounds
    ranking_samples: int = ACCURACY_CONTROL_RANKING_SAMPLES

    @property
    def label(self) -> str:
        text = f"nncf int8 preset={self.preset} bias_correction={'fast' if self.fast_bias_correction else 'full'}"
        if self.accuracy_control:
            text += " accuracy-control"
        if self.exclude:
            text += f", {len(self.exclude)} layer(s) in float"
        return text


# -- candidates ------------------------------------------------------------------------------------
def ov_open(xml: Path, device: str = "CPU", hint: str = "f32") -> Callable[[int], RunFn]:
    """threads -> a runner of the IR compiled the way the device runtime compiles it for ``device``
    (``hint``: the ``INFERENCE_PRECISION_HINT`` the manifest will promise)."""

    def open_(threads: int) -> RunFn:
        ov = import_openvino()
        core = ov.Core()
        config: dict[str, Any] = {"INFERENCE_PRECISION_HINT": hint}
        if threads:
            config["INFERENCE_NUM_THREADS"] = threads
        compiled = core.compile_model(core.read_model(str(xml)), device, config)
        request = compiled.create_infer_request()
        outputs = [(port.get_any_name(), port) for port in compiled.outputs]
        names = {port.get_any_name(): port.get_names() for _, port in outputs}

        def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            result = request.infer(feed)
            out: dict[str, np.ndarray] = {}
            for any_name, port in outputs:
                value = np.array(result[port])
                for n in names[any_name]:
                    out[n] = value
            return out

        return run

    return open_


def ir_built(model: Any, space: BuildSpace, precision: Precision, device: str, fp16: bool = False, **kw: Any) -> Built:
    ov = import_openvino()
    xml = space.work_dir / ARTIFACT_XML
    ov.save_model(model, str(xml), compress_to_fp16=fp16)
    core = ov.Core()
    here = device in ("CPU", "AUTO") or _available(core, device)
    cpu = ov_open(xml, "CPU", "bf16" if precision.activations == "bf16" else "f32")
    return Built(
        files={ARTIFACT_XML: "artifact", ARTIFACT_BIN: "artifact"},
        runtime="openvino",
        precision=precision,
        open=cpu if here else None,  # another device's latency is not measured here
        intermediate=None if here else cpu(0),
        **kw,
    )


def ir_candidate(name: str, precision: str, source: Path, device: str, baseline: bool = False) -> Candidate:
    def build(space: BuildSpace) -> Built:
        ov = import_openvino()
        model = convert_onnx(ov, source)
        if precision == "fp16":
            act: Literal["fp16", "fp32"] = "fp16" if inference_precision(device, "fp16") == "f16" else "fp32"
            prec = Precision("fp16", act, f"openvino {ov_version(ov)} convert, weights compressed to fp16")
        else:
            prec = Precision("fp32", "fp32", f"openvino {ov_version(ov)} convert")
        return ir_built(model, space, prec, device, fp16=precision == "fp16")

    return Candidate(
        name=name,
        precision=precision,
        runtime="openvino",
        build=build,
        settings={"recipe": name, "device": device},
        family=name,
        baseline=baseline,
    )


def bf16_candidate(source: Path, device: str) -> Candidate:
    """The IR computed in bf16 by the CPU plugin (``INFERENCE_PRECISION_HINT`` bf16): what
    OpenVINO does by itself on CPUs with AVX512-BF16 / AMX, here a lossy candidate of its own, timed
    and gated with that hint. Its weights are stored in fp16 (``compress_to_fp16``, OpenVINO's own
    default for ``save_model``; half the size): fp16 keeps more mantissa bits than bf16 computes
    with (10 against 7), though less range (beyond +-65504 and under 6e-8 it saturates or
    flushes), and the gate measures the artifact as stored. Offer it only where
    ``bf16_unavailable(device)`` is empty."""

    def build(space: BuildSpace) -> Built:
        ov = import_openvino()
        method = f"openvino {ov_version(ov)} convert, weights in fp16, CPU plugin INFERENCE_PRECISION_HINT bf16"
        return ir_built(convert_onnx(ov, source), space, Precision("fp16", "bf16", method), device, fp16=True)

    return Candidate(
        name=BF16_NAME,
        precision="bf16",
        runtime="openvino",
        build=build,
        settings={"recipe": BF16_NAME, "device": device, "inference_precision": "bf16"},
        family=BF16_NAME,
    )


def bf16_unavailable(device: str) -> str:
    """Why the bf16 candidate cannot be built and measured here; "" where it can.

    Asks OpenVINO (``device_agents.runtimes.openvino.cpu_capabilities``, the agent's own question):
    without ``BF16`` the CPU plugin computes f32 whatever the hint, so bf16 numerics cannot be
    measured on this host.
    """
    if device != "CPU":
        return f"bf16 is a CPU plugin precision (targets.intel.device is {device})"
    from device_agents.runtimes import openvino as runtime

    capabilities = runtime.cpu_capabilities()
    if "BF16" not in capabilities:
        return f"{runtime.NO_BF16} (OPTIMIZATION_CAPABILITIES: {', '.join(capabilities) or 'none'})"
    return ""


def nncf_candidate(
    source: Path, recipe: NncfRecipe, device: str, prepared: Path, model_type: str = "", float_bf16: bool = False
) -> Candidate:
    """NNCF INT8 of the source graph (shape sub-graphs folded); ``prepared``: the ORT-prepared
    graph layer sensitivity is ranked on (its node names are the source graph's). ``float_bf16``:
    the same IR with the ops it keeps in float (those NNCF leaves unquantized, the layers mixed
    precision or a head scope keeps in float) computed in bf16 by the CPU plugin; the IR is
    quantized once per recipe in a process and reused by its bf16 form (``_QUANTIZED``)."""

    def build(space: BuildSpace) -> Built:
        ov = import_openvino()
        key = _quantized_key(source, recipe, device, model_type, space.calib)
        cached = _QUANTIZED.get(key)
        if cached is not None and cached[0].is_file():  # the same recipe's IR, already quantized
            quantized, method = ov.Core().read_model(str(cached[0])), cached[1]
        else:
            quantized, method = _quantize(space)
        acts: Literal["int8", "bf16"] = "int8"
        if float_bf16:
            acts, method = "bf16", f"{method}; {FLOAT_OPS_BF16} (INFERENCE_PRECISION_HINT bf16)"
        built = ir_built(quantized, space, Precision("int8", acts, method), device, excluded_nodes=recipe.exclude)
        if not float_bf16:
            _QUANTIZED[key] = (space.work_dir / ARTIFACT_XML, method)
        return built

    def _quantize(space: BuildSpace) -> tuple[Any, str]:
        ov, nncf = import_openvino(), import_nncf()
        batch = fixed_batch(space.served) or 1
        samples = [feed for feed in iter_batches(space.calib, batch) if sample_count(feed) == batch]
        if not samples:
            raise ConfigError(f"--calib: the intel target needs at least {batch} calibration sample(s) for int8")
        common: dict[str, Any] = {
            "preset": nncf.QuantizationPreset(recipe.preset),
            "target_device": nncf.TargetDevice.ANY if device == "AUTO" else nncf.TargetDevice(device),
            "subset_size": len(samples),
            "fast_bias_correction": recipe.fast_bias_correction,
            "model_type": nncf.ModelType.TRANSFORMER if model_type == "transformer" else None,
        }
        if recipe.exclude:
            # OpenVINO names a Conv with a bias "<onnx name>/WithoutBiases" and its Add "<onnx name>"
            patterns = [re.escape(n) + "(/WithoutBiases)?" for n in recipe.exclude]
            common["ignored_scope"] = nncf.IgnoredScope(patterns=patterns, validate=False)
        model = convert_onnx(ov, source)
        if recipe.accuracy_control:
            bounds = restorer_parameters(nncf, recipe, len(samples))
            quantized = _quantize_with_accuracy_control(ov, nncf, model, samples, common, bounds)
        else:
            quantized = nncf.quantize(model, nncf.Dataset(samples), **common)
        kind = f" model_type={model_type}" if model_type else ""
        recipe_text = recipe.label.removeprefix("nncf int8 ")
        return quantized, f"nncf {nncf.__version__} ptq {recipe_text}{kind} samples={len(samples) * batch}"

    def rank(space: BuildSpace, built: Built) -> list[tuple[tuple[str, ...], float]]:
        from edgekit.compress.ort_quant import StaticQuantConfig, quantize_static_int8
        from edgekit.optimize.sensitivity import rank_qdq_layers

        folder = space.work_dir / "sensitivity"
        folder.mkdir(exist_ok=True)
        qdq = folder / "qdq.onnx"
        # one sample per calibrator call, as NNCF's own statistics (``calib_call_samples``): the
        # memory bound counted that much for this candidate
        quantize_static_int8(prepared, qdq, space.calib, StaticQuantConfig(), folder, space.calib_batch, 1)
        return rank_qdq_layers(prepared, qdq, space.calib, folder, space.calib_batch)

    settings: dict[str, Any] = {**asdict(recipe), "exclude": list(recipe.exclude), "device": device}
    settings["model_type"] = model_type
    if float_bf16:
        settings["inference_precision"] = "bf16"
    return Candidate(
        name=f"{recipe.label}, {FLOAT_OPS_BF16}" if float_bf16 else recipe.label,
        precision="int8",
        runtime="openvino",
        build=build,
        settings=settings,
        family=f"nncf int8 {device}" + (f" {FLOAT_OPS_BF16}" if float_bf16 else ""),
        exclude=lambda nodes: nncf_candidate(
            source, replace(recipe, exclude=nodes), device, prepared, model_type, float_bf16
        ),
        rank_layers=rank,
        holds_every_sample=not recipe.fast_bias_correction,
        calib_call_samples=1,  # NNCF's statistics collection runs one dataset item (batch) at a time
        cost_s=functools.partial(accuracy_control_cost, source, recipe) if recipe.accuracy_control else None,
    )


def accuracy_control_cost(source: Path, recipe: NncfRecipe, fp32_ms: float, calib_samples: int) -> tuple[float, str]:
    """(seconds, how) ``quantize_with_accuracy_control`` may take: where its first evaluation
    already meets ``max_drop`` it stops there; else NNCF ranks every quantized layer by evaluating
    the model with it reverted on the ranking items (``calib_samples``: the dataset's items, one
    call of about ``fp32_ms`` each), then up to ``max_reverted_layers`` evaluations more. U^2-Net-p
    320² (168 quantized operations, 96 items): the ranking alone ran over 9 minutes on 2 cores."""
    import onnx

    graph = onnx.load(str(source), load_external_data=False).graph
    layers = sum(1 for n in graph.node if n.op_type in QUANTIZED_LAYERS)
    samples = min(recipe.ranking_samples, calib_samples)  # restorer_parameters' ranking subset
    evaluations = layers + recipe.max_reverted_layers + 2
    return evaluations * samples * fp32_ms / 1000, (
        f"accuracy control evaluates the model up to {evaluations} times ({layers} quantized layers to rank, "
        f"up to {recipe.max_reverted_layers} reverted) on up to {samples} samples at ~{fp32_ms:.1f} ms each"
    )


def _quantized_key(
    source: Path, recipe: NncfRecipe, device: str, model_type: str, calib: Mapping[str, np.ndarray]
) -> tuple[Any, ...]:
    """What makes two NNCF INT8 builds the same IR: the source file as it is now, the recipe, the
    device, and the calibration data (names, shapes, and a digest of their bytes)."""
    import hashlib

    try:
        stat = source.stat()
        version: tuple[int, int] = (stat.st_mtime_ns, stat.st_size)
    except OSError:
        version = (0, 0)
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(calib):
        array = np.ascontiguousarray(calib[name])
        digest.update(f"{name}{array.shape}{array.dtype}".encode())
        digest.update(array.tobytes())
    return (str(source), version, recipe, device, model_type, digest.hexdigest())


def nncf_bf16_offer(
    source: Path,
    recipe: NncfRecipe,
    device: str,
    prepared: Path,
    heads: Mapping[str, str],
    model_type: str = "",
) -> tuple[tuple[Candidate, ...], tuple[tuple[str, str], ...]]:
    """(candidates, skipped): ``recipe``'s NNCF INT8 with its float ops computed in bf16, and its
    detect/segment head in float (``head_offer``) the same way, where this CPU's OpenVINO has BF16;
    else the reason. What OpenVINO does by itself on such CPUs with an INT8 IR (the f32 hint that
    edgekit's INT8 candidates carry is there to keep what an int8 manifest promises): the ops
    left in float run at bf16 speed, and the gate judges the result like any other candidate."""
    from edgekit.optimize.head_scope import head_offer

    name = f"{recipe.label}, {FLOAT_OPS_BF16}"
    why = bf16_unavailable(device)
    if why:
        return (), ((name, why),)
    sibling = nncf_candidate(source, recipe, device, prepared, model_type, float_bf16=True)
    offered, _ = head_offer(sibling, source, heads)
    return (sibling, *offered), ()


def restorer_parameters(nncf: Any, recipe: NncfRecipe, samples: int) -> Any:
    """NNCF's ``AdvancedAccuracyRestorerParameters`` bounded by the recipe: at most
    ``max_reverted_layers`` layers reverted to float, the ranking on at most ``ranking_samples``."""
    from nncf.quantization.advanced_parameters import AdvancedAccuracyRestorerParameters

    return AdvancedAccuracyRestorerParameters(
        max_num_iterations=recipe.max_reverted_layers, ranking_subset_size=min(recipe.ranking_samples, samples)
    )


def _quantize_with_accuracy_control(
    ov: Any, nncf: Any, model: Any, samples: list[Any], common: dict[str, Any], bounds: Any
) -> Any:
    """``nncf.quantize_with_accuracy_control`` with agreement to the FP32 IR on the calibration
    samples as the metric (no labels here), allowed to drop 0.01."""
    core = ov.Core()
    reference = core.compile_model(model, "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    expected = [np.array(reference.create_infer_request().infer(s)[reference.outputs[0]]) for s in samples]

    def metric(compiled: Any, data: Any) -> float:
        request = compiled.create_infer_request()
        scores = []
        for feed, want in zip(data, expected, strict=False):
            got = np.array(request.infer(feed)[compiled.outputs[0]]).reshape(want.shape[0], -1)
            ref = want.reshape(want.shape[0], -1)
            if ref.shape[1] > 1 and ref.ndim == 2 and want.ndim == 2:
                scores.append(float(np.mean(got.argmax(-1) == ref.argmax(-1))))
            else:
                den = np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1)
                scores.append(float(np.mean(np.sum(got * ref, axis=1) / np.maximum(den, 1e-12))))
        return float(np.mean(scores))

    dataset = nncf.Dataset(samples)
    return nncf.quantize_with_accuracy_control(
        model,
        dataset,
        dataset,
        validation_fn=metric,
        max_drop=0.01,
        drop_type=nncf.DropType.ABSOLUTE,
        advanced_accuracy_restorer_parameters=bounds,
        **common,
    )


def ir_build_result(
    ctx: BuildContext, built: Built, built_dir: Path, device: str, options: dict[str, Any]
) -> BuildResult:
    """The chosen IR in ``ctx.out_dir``, described for the manifest (op placement from
    ``query_model``, tensors matched to the served ones by name)."""
    import shutil

    ov = import_openvino()
    for name in (ARTIFACT_XML, ARTIFACT_BIN):
        shutil.copyfile(built_dir / name, ctx.out_dir / name)
    core = ov.Core()
    saved = core.read_model(str(ctx.out_dir / ARTIFACT_XML))
    notes = list(built.notes)
    artifact_sig, mapping = _artifact_signature(saved, ctx.served)
    placement = _op_placement(core, saved, device, notes)
    here = device in ("CPU", "AUTO") or _available(core, device)
    intermediate = None
    if not here:
        intermediate = served_fn(_compile_cpu(core, saved), ctx.served)
        notes.append(f"device {device} is not on this host: validated with the CPU plugin on the same IR")
    accelerator = {"GPU": "intel-gpu", "NPU": "intel-npu"}.get(device)
    precision_name = "fp16" if built.precision.weights == "fp16" else "fp32"
    if built.precision.activations == "bf16":
        precision_name = "bf16"
    return BuildResult(
        files={ARTIFACT_XML: "artifact", ARTIFACT_BIN: "artifact"},
        compatibility=Compatibility(runtime="openvino", runtime_version=ov_version(ov), accelerator=accelerator),
        artifact_signature=artifact_sig,
        mapping=mapping,
        precision=built.precision,
        runnable_here=here,
        op_placement=placement,
        notes=tuple(notes),
        target_options={
            **options,
            "device": device,
            "inference_precision": inference_precision(device, precision_name),
        },
        intermediate=intermediate,
        intermediate_name="openvino CPU plugin (same IR)" if intermediate else "",
    )


# -- helpers ---------------------------------------------------------------------------------------
def inference_precision(device: str, precision: str) -> str:
    """OpenVINO's ``INFERENCE_PRECISION_HINT`` that computes what the manifest's precision says.

    Left to itself the CPU plugin computes in bf16 on CPUs that have it (AVX512-BF16, AMX), which
    is not what an fp32 / int8 / fp16 manifest promises; the runtime sets this hint explicitly.
    ``bf16`` (the bf16 candidate, CPU only) promises bf16.
    """
    if precision == "bf16":
        return "bf16"
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
