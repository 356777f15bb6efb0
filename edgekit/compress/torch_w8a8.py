"""W8A8 (int8 weights and 8-bit activations) for Core ML, quantized on the torch intermediate.

Core ML's own activation calibration (``coremltools.optimize.coreml.experimental.
linear_quantize_activations``) runs the model through Core ML, which needs macOS. So the torch graph
the package is converted from is quantized instead, with ``coremltools.optimize.torch``'s
``LinearQuantizer`` (torch.ao FX quantization, symmetric int8 per-channel weights, 8-bit per-tensor
activations): the calibration data is run through it with observers on and no training, then
``finalize`` gives a reference-quantized graph (``quantize_per_tensor``/``dequantize`` around each
op, weights quantized on the fly) that ``coremltools.convert`` turns into MIL ``quantize``/
``dequantize`` ops and ``constexpr_affine_dequantize`` weights.

The finalized graph is also the host-side intermediate, once it carries the *package's* numbers:
every int8 weight and its per-channel scale are read back from the saved package and put into the
reference module they came from (found by name), and every activation ``quantize`` op of the package
is matched, in program order, to the torch graph's activation quantization (scale within FP16
rounding, the same zero point); the torch graph then takes the package's FP16 scales. A quantize
after an ``add``/``sub`` whose scale coremltools normalized by one input's scale (its
``distributive_quantized_binary_op_scale_normalization`` pass: the same integers in other units)
is compared, and loaded, in the source's units, and the report lists it. A torch
requantization the package does not have must repeat the previous one exactly (coremltools drops
such no-ops, e.g. around a reshape); anything else means the intermediate would not compute what
the package computes, and raises ``ValidationFailedError``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from edgekit.errors import UnsupportedOpError, ValidationFailedError

# FP16 keeps 11 significant bits: a scale stored in the package is the torch scale to within 2**-11.
_SCALE_RTOL = 2.0**-10
_FP16_SUBNORMAL_STEP = 2.0**-24
_MIL_SUFFIXES = re.compile(r"(_cast_fp16|_cast_fp32|_to_fp16|_to_fp32)$")
_MIL_PREFIXES = ("var_", "op_", "_")


@dataclass(frozen=True)
class ActivationQuant:
    """One activation quantization: ``real = scale * (q - zero_point)`` with ``q`` in 0..255."""

    where: str  # torch FX node or MIL op name
    scale: float
    zero_point: int  # uint8 convention (an int8 zero point z is z + 128 here)


@dataclass(frozen=True)
class W8A8Report:
    weights: tuple[str, ...]  # package weights loaded into the intermediate, with their scales
    activations: int  # package activation quantize ops matched to the torch graph
    dropped_noops: tuple[str, ...]  # torch requantizations the package leaves out (exact repeats)
    rescaled: tuple[str, ...]  # package quantize ops after add/sub whose scale coremltools normalized
    worst_scale_error: float  # largest relative difference, package vs torch activation scale


def calibrate(module: Any, example: tuple[Any, ...], batches: Iterable[tuple[Any, ...]]) -> Any:
    """``module`` (an FX graph) quantized W8A8 with activation ranges from ``batches`` (min/max,
    no training); returns the finalized reference-quantized graph."""
    import torch
    from coremltools.optimize.torch.quantization import (
        LinearQuantizer,
        LinearQuantizerConfig,
        ModuleLinearQuantizerConfig,
    )

    config = LinearQuantizerConfig(
        global_config=ModuleLinearQuantizerConfig(
            quantization_scheme="symmetric",
            weight_observer="min_max",
            activation_observer="min_max",
            milestones=None,  # observers and fake quantization on from the start: calibration only
        ),
        # onnx2torch's own op modules branch on tensor values (e.g. OnnxBinaryMathOperation's integer
        # Div check), which FX cannot trace: they stay opaque float ops between the quantized ones
        non_traceable_module_names=opaque_modules(module),
        # None: this op is not quantized (it runs in float, FP16 in Core ML)
        module_name_configs=dict.fromkeys(float_fed_fixed_range_ops(module)),
    )
    quantizer = LinearQuantizer(module, config)
    try:
        prepared = quantizer.prepare(example_inputs=example)
    except torch.fx.proxy.TraceError as exc:
        raise UnsupportedOpError(
            f"coremltools.optimize.torch cannot trace the torch intermediate for W8A8 ({exc}); "
            "use --precision int8-weights"
        ) from exc
    prepared.eval()  # observers still record in eval mode; batch norm keeps its statistics
    with torch.no_grad():
        for batch in batches:
            prepared(*batch)
    return quantizer.finalize()


def float_fed_fixed_range_ops(module: Any) -> list[str]:
    """Names of the fixed-output-range activations (Sigmoid, Tanh, Hardsigmoid, Softmax) whose input
    comes from no quantized op (an opaque onnx2torch op, a graph input, a function).

    torch.ao gives these ops fixed quantization parameters (Sigmoid: scale 1/256, zero point 0, so
    [0, 1)), and where nothing upstream already quantized their input it quantizes the input with
    those same parameters: logits clamp to [0, 1) before the sigmoid, so every score lands in
    [0.5, 0.73] (YOLOv8's class sigmoid after its anchor Concat, its DFL softmax after a Transpose:
    class-score channel cosine 0.08 on a trained detector). Those ops stay float; a sigmoid fed by
    a quantized conv (SiLU in the backbone) keeps its quantization."""
    import torch

    fixed = (torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.Hardsigmoid, torch.nn.Softmax)
    graph = getattr(module, "graph", None)
    if graph is None:
        return []
    names = []
    for node in graph.nodes:
        if node.op != "call_module" or not isinstance(module.get_submodule(node.target), fixed):
            continue
        source = node.args[0] if node.args else None
        quantized_source = (
            isinstance(source, torch.fx.Node)
            and source.op == "call_module"
            and not type(module.get_submodule(source.target)).__module__.startswith("onnx2torch.")
            and str(source.target) not in names  # one kept float feeds this one float too
        )
        if not quantized_source:
            names.append(str(node.target))
    return names


def opaque_modules(module: Any) -> list[str]:
    """Names of the submodules that are onnx2torch op implementations (not torch.nn layers)."""
    return [name for name, sub in module.named_modules() if name and type(sub).__module__.startswith("onnx2torch.")]


def torch_activation_quant(graph_module: Any) -> list[ActivationQuant]:
    """The activation quantizations of a finalized graph, in graph order."""
    import torch

    found = []
    for node in graph_module.graph.nodes:
        if node.op != "call_function" or node.target is not torch.quantize_per_tensor:
            continue
        scale, zero_point, dtype = node.args[1], node.args[2], node.args[3]
        s = float(_attr(graph_module, scale))
        z = int(_attr(graph_module, zero_point))
        found.append(ActivationQuant(str(node.name), s, z + 128 if dtype == torch.qint8 else z))
    return found


def package_activation_quant(program: Any) -> list[ActivationQuant]:
    """The activation ``quantize`` ops of a MIL program, in program order, each with the scale of the
    grid it quantizes to in the source's units (see ``_normalization``)."""
    from edgekit.compress.mlpackage_weights import main_operations

    found = []
    effective: dict[int, float] = {}  # id(quantize op) -> its scale in the source's units
    for op in main_operations(program):
        if op.op_type != "quantize":
            continue
        zp_var = op.inputs.get("zero_point")
        zp = int(np.asarray(zp_var.val).ravel()[0]) if zp_var is not None and zp_var.val is not None else 0
        scale = np.asarray(op.inputs["scale"].val, dtype=np.float64)
        if scale.size != 1:
            raise ValidationFailedError(f"package op {op.name}: per-channel activation scales are not supported here")
        dtype = str(op.inputs["output_dtype"].val)
        s = float(scale.ravel()[0]) * _normalization(op, effective)
        effective[id(op)] = s
        found.append(ActivationQuant(str(op.name), s, zp + 128 if dtype == "int8" else zp))
    return found


def _normalization(quantize: Any, effective: dict[int, float]) -> float:
    """The factor coremltools divided ``quantize``'s scale by, 1.0 when it did not.

    coremltools' ``distributive_quantized_binary_op_scale_normalization`` pass (coremltools 9,
    ``optimize_quantization.py``) rewrites ``quantize(dequantize(x, s_x) + dequantize(y, s_y), s_z)``
    (``add``/``sub``, optionally through a ``relu``) into ``quantize(dequantize(x, s_x/s_y) +
    dequantize(y, 1.0), s_z/s_y)``: the same integers, computed in units of ``s_y``, so the
    quantize op holds ``s_z/s_y``. It is recognised by a ``dequantize`` of scale 1.0 whose source
    quantize has another scale; ``s_y`` is that source's scale, and the other input's rewritten
    scale must then be its source's scale over ``s_y`` too, or this raises: anything else is not
    that pass, and the package's numerics are not the torch graph's."""
    producer = quantize.inputs["input"].op
    if producer is not None and producer.op_type == "relu":
        producer = producer.inputs["x"].op
    if producer is None or producer.op_type not in ("add", "sub"):
        return 1.0
    sides = [producer.inputs[k].op for k in ("x", "y")]
    if any(d is None or d.op_type != "dequantize" for d in sides):
        return 1.0
    pairs = []  # (dequantize scale, the scale of the quantize it reads in source units)
    for d in sides:
        source = d.inputs["input"].op
        scale = np.asarray(d.inputs["scale"].val, dtype=np.float64)
        if source is None or id(source) not in effective or scale.size != 1:
            return 1.0
        pairs.append((float(scale.ravel()[0]), effective[id(source)]))
    for k, (unit_scale, s_y) in enumerate(pairs):
        if unit_scale != 1.0 or _close(s_y, 1.0):
            continue
        other_scale, s_x = pairs[1 - k]
        if not _close(other_scale * s_y, s_x):
            raise ValidationFailedError(
                f"package op {quantize.name}: the {producer.op_type} before it reads dequantize scales "
                f"{other_scale:.6g} and 1.0, which is not coremltools' scale normalization of inputs quantized at "
                f"{s_x:.6g} and {s_y:.6g}; the package's W8A8 numerics cannot be checked here: "
                "use --precision int8-weights"
            )
        return s_y
    return 1.0


def _close(a: float, b: float) -> bool:
    # two FP16 roundings (the scale and the quotient coremltools stores)
    return abs(a - b) <= max(2 * _SCALE_RTOL * abs(b), _FP16_SUBNORMAL_STEP)


def align(torch_q: Sequence[ActivationQuant], package_q: Sequence[ActivationQuant]) -> list[int | None]:
    """For each torch quantization, the index of the package op it is, or ``None`` for a no-op repeat
    the package dropped. Raises ``ValidationFailedError`` when the two do not line up."""
    out: list[int | None] = []
    j = 0
    for i, tq in enumerate(torch_q):
        if j < len(package_q) and _same(tq, package_q[j]):
            out.append(j)
            j += 1
        elif i > 0 and (tq.scale, tq.zero_point) == (torch_q[i - 1].scale, torch_q[i - 1].zero_point):
            out.append(None)
        else:
            want = package_q[j] if j < len(package_q) else None
            raise ValidationFailedError(
                f"activation quantization {tq.where} (scale {tq.scale:.6g}, zero point {tq.zero_point}) of the torch "
                f"intermediate is not in the package (next package op: "
                f"{f'{want.where} scale {want.scale:.6g} zero point {want.zero_point}' if want else 'none'}); "
                "the package's W8A8 numerics cannot be checked here: use --precision int8-weights"
            )
    if j != len(package_q):
        extra = package_q[j]
        raise ValidationFailedError(
            f"package activation quantization {extra.where} (scale {extra.scale:.6g}) has no counterpart in the torch "
            "intermediate; use --precision int8-weights"
        )
    return out


def load_package_quantization(graph_module: Any, program: Any) -> W8A8Report:
    """Put the package's int8 weights, weight scales and activation scales into ``graph_module``
    (a finalized graph from ``calibrate``, in place); see the module docstring."""
    import torch

    weights = _load_weights(graph_module, program)
    torch_q = torch_activation_quant(graph_module)
    package_q = package_activation_quant(program)
    raw = {q.where: q.scale for q in _raw_scales(program)}
    rescaled = tuple(q.where for q in package_q if not _close(q.scale, raw[q.where]))
    matched = align(torch_q, package_q)
    nodes = {
        n.name: n for n in graph_module.graph.nodes if n.op == "call_function" and n.target is torch.quantize_per_tensor
    }
    worst = 0.0
    previous: ActivationQuant | None = None
    for tq, j in zip(torch_q, matched, strict=True):
        pq = package_q[j] if j is not None else previous
        if pq is None:  # align never marks the first one a repeat
            raise ValidationFailedError(f"activation quantization {tq.where} has nothing to repeat")
        worst = max(worst, abs(pq.scale - tq.scale) / tq.scale)
        node = nodes[tq.where]
        with torch.no_grad():
            _set_attr(graph_module, node.args[1], pq.scale)
        previous = pq if j is not None else previous
    return W8A8Report(
        weights=weights,
        activations=len(package_q),
        dropped_noops=tuple(tq.where for tq, j in zip(torch_q, matched, strict=True) if j is None),
        rescaled=rescaled,
        worst_scale_error=worst,
    )


def _raw_scales(program: Any) -> list[ActivationQuant]:
    """Each quantize op's scale as stored (no normalization undone)."""
    from edgekit.compress.mlpackage_weights import main_operations

    return [
        ActivationQuant(str(op.name), float(np.asarray(op.inputs["scale"].val, dtype=np.float64).ravel()[0]), 0)
        for op in main_operations(program)
        if op.op_type == "quantize"
    ]


def _load_weights(graph_module: Any, program: Any) -> tuple[str, ...]:
    """Each int8 weight of the package into the reference module it belongs to, with its scale."""
    import torch

    from edgekit.compress.mlpackage_weights import _mil_name, main_operations

    modules = {
        _mil_name(f"{name}.weight"): m
        for name, m in graph_module.named_modules()
        if hasattr(m, "weight_scale") and isinstance(getattr(m, "weight", None), torch.nn.Parameter)
    }
    loaded: dict[str, str] = {}
    for op in main_operations(program):
        if op.op_type not in ("constexpr_affine_dequantize", "constexpr_blockwise_shift_scale"):
            continue
        name = str(op.outputs[0].name)
        key = _torch_key(name, modules)
        if key is None:
            raise ValidationFailedError(
                f"package weight {name} matches no quantized module of the torch intermediate "
                f"(modules: {', '.join(sorted(modules)[:4])}...); use --precision int8-weights"
            )
        if key in loaded:
            raise ValidationFailedError(f"package weights {loaded[key]} and {name} both match {key}")
        module = modules[key]
        values = np.asarray(op.materialized_val_inference(), dtype=np.float32)
        scale = np.asarray(op.inputs["scale"].val, dtype=np.float32)
        # the output-channel axis torch.ao quantizes along: 0, but 1 for a ConvTranspose ([in, out/groups, ...])
        axis = int(getattr(module, "weight_axis", 0))
        channels = module.weight.shape[axis]
        if values.shape != tuple(module.weight.shape) or scale.size != channels:
            raise ValidationFailedError(
                f"package weight {name} {list(values.shape)} (scale {list(scale.shape)}) does not fit {key} "
                f"{list(module.weight.shape)} with one scale per output channel (axis {axis})"
            )
        per_channel = scale.reshape(channels).astype(np.float32)
        with torch.no_grad():
            module.weight.copy_(torch.from_numpy(values))
            module.weight_scale.copy_(torch.from_numpy(per_channel))
            module.weight_zero_point.zero_()
            got = module.get_weight().numpy()
        # The same integers times the same FP16 scales; the package's materialized values are those
        # products rounded to FP16, as Core ML computes them.
        along = [1] * got.ndim
        along[axis] = channels
        codes = np.round(got / per_channel.reshape(along))
        stored = op.inputs.get("quantized_data", op.inputs.get("data"))
        if stored is not None and stored.val is not None and not np.array_equal(codes, stored.val.astype(np.float64)):
            raise ValidationFailedError(f"{key} does not reproduce the int8 codes of package weight {name}")
        if not np.allclose(got, values, rtol=2.0**-10, atol=float(per_channel.max()) * 2.0**-10):
            raise ValidationFailedError(f"{key} does not reproduce package weight {name} after loading it")
        loaded[key] = name
    missing = sorted(set(modules) - set(loaded))
    if missing:
        raise ValidationFailedError(
            f"quantized module weight(s) {', '.join(missing[:3])} of the torch intermediate have no int8 weight in "
            "the package; use --precision int8-weights"
        )
    return tuple(loaded.values())


def _torch_key(mil_name: str, modules: dict[str, Any]) -> str | None:
    name = mil_name
    while (stripped := _MIL_SUFFIXES.sub("", name)) != name:
        name = stripped
    for candidate in (name, *(name[len(p) :] for p in _MIL_PREFIXES if name.startswith(p))):
        if candidate in modules:
            return candidate
    return None


def _same(tq: ActivationQuant, pq: ActivationQuant) -> bool:
    # below 2**-14 FP16 is subnormal: its spacing is 2**-24 whatever the value
    tolerance = max(_SCALE_RTOL * abs(tq.scale), _FP16_SUBNORMAL_STEP)
    return tq.zero_point == pq.zero_point and abs(tq.scale - pq.scale) <= tolerance


def _attr(graph_module: Any, arg: Any) -> Any:
    """An FX node argument's value: a ``get_attr`` node's tensor, or the constant itself."""
    target = getattr(arg, "target", None)
    if getattr(arg, "op", None) == "get_attr" and isinstance(target, str):
        value = graph_module
        for part in target.split("."):
            value = getattr(value, part)
        return value.item() if hasattr(value, "item") else value
    return arg


def _set_attr(graph_module: Any, arg: Any, value: float) -> None:
    import torch

    target = getattr(arg, "target", None)
    if getattr(arg, "op", None) != "get_attr" or not isinstance(target, str):
        raise ValidationFailedError(f"activation scale {arg!r} is a constant of the graph, not a settable attribute")
    owner = graph_module
    *path, last = target.split(".")
    for part in path:
        owner = getattr(owner, part)
    current = getattr(owner, last)
    if isinstance(current, torch.Tensor):
        current.copy_(torch.tensor(value, dtype=current.dtype))
    else:
        setattr(owner, last, value)


__all__ = [
    "ActivationQuant",
    "W8A8Report",
    "align",
    "calibrate",
    "load_package_quantization",
    "opaque_modules",
    "package_activation_quant",
    "torch_activation_quant",
]
