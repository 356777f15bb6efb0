"""The weights an ``.mlpackage`` really holds, read back from the saved package.

Core ML prediction does not run on Linux, so the apple target checks its artifact's numerics by
loading these weights into the torch graph it converted from: palettized weights are the LUT
looked up by the stored indices, int8 weights the stored integers times their scales
(``materialized_val_inference`` of the MIL ``constexpr_*`` ops), plain weights the stored FP16 or
FP32 values.

Which torch tensor a package weight belongs to is decided in two steps, and every compressed
weight must get through both or loading fails:

1. the compressed weight feeds the same input of the same op as a constant of the *uncompressed*
   program (coremltools keeps op names when it compresses; it does not keep constant names);
2. that uncompressed constant is a torch tensor, possibly transposed and scaled: found by name
   (the PyTorch frontend names a weight ``<module>_<param>``) or else by value. coremltools' graph
   passes fold a following scale into a conv or linear weight (``fuse_conv_scale``: HardSigmoid's
   slope, a ``mul`` by a constant, batch norm per channel) and give the result a new name
   (``op_813_weight_0``). The scale is fitted on the uncompressed FP16/FP32 constant, where it is
   exact up to FP16 rounding, and the package weight divided by it: the torch graph applies that
   scale itself after the conv. A scale fitted on the compressed values would be biased (k-means
   shrinks weights by 1-2%) and would hide part of the compression error.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import ValidationFailedError

# MIL ops that store a compressed weight, and what they hold.
COMPRESSION_OPS = {
    "constexpr_affine_dequantize": "int8",  # iOS16/17 linear quantization
    "constexpr_blockwise_shift_scale": "int8",  # iOS18 linear quantization
    "constexpr_lut_to_dense": "palettized",
}
_SUFFIXES = re.compile(r"(_to_fp16|_to_fp32|_palettized|_quantized|_sparsified)$")
_PREFIXES = ("op_", "var_", "_", "p_", "b_")  # p_/b_: torch.export's parameters and buffers
_MIN_MATCH_COSINE = 0.9  # a compressed weight far from its torch tensor means a wrong match
# An uncompressed constant is a (scaled) torch tensor when, after the least-squares scale, only
# FP16 rounding separates them: relative error <= 2**-11 per value gives a cosine above 1 - 1e-7.
# 1 - 1e-5 leaves room for FP16 subnormals and rules out chance matches (biases that went
# through ``a * b + c`` reach 0.97 on the PP-OCR classifier).
_SAME_COSINE = 0.99999
_UNIT_SCALE = 5e-4  # a fitted scale this close to 1 is FP16 rounding, not a fused scale
_MIN_PER_CHANNEL = 4  # a per-channel scale fits any channel of 1-3 values: demand more


@dataclass(frozen=True)
class PackageWeight:
    name: str  # MIL value name, e.g. conv1_weight_to_fp16_palettized
    values: np.ndarray  # float32, as the model computes with it
    compression: str  # fp16, fp32, int8, uint8, palettized-4bit, ...
    op_type: str  # const or the constexpr op that decompresses it
    consumers: tuple[tuple[str, str], ...] = ()  # (compute op name, input name) it feeds

    @property
    def compressed(self) -> bool:
        return self.op_type != "const"

    @property
    def base_name(self) -> str:
        name = self.name
        while (stripped := _SUFFIXES.sub("", name)) != name:
            name = stripped
        return name


@dataclass(frozen=True)
class TorchLink:
    """How an uncompressed package constant relates to a torch tensor: ``const = scale * tensor``
    (``const.T`` when ``transposed``), ``scale`` a scalar or one value per output channel (axis 0)."""

    tensor: str  # key in the module's tensors, as ``_mil_name`` writes it
    scale: np.ndarray  # shape () or (channels, 1, ...); exactly 1.0 when nothing was fused
    transposed: bool
    by: str  # "name" or "value"

    @property
    def rescaled(self) -> bool:
        return bool(np.any(self.scale != 1.0))

    def to_torch(self, values: np.ndarray) -> np.ndarray:
        """Package values laid out and scaled as the torch tensor (the fused scale divided out)."""
        oriented = (values.T if self.transposed else values).astype(np.float64)
        out: np.ndarray = np.divide(oriented, self.scale, out=np.zeros_like(oriented), where=self.scale != 0)
        return out.astype(np.float32)


@dataclass(frozen=True)
class LoadReport:
    compressed_loaded: tuple[str, ...]
    plain_loaded: tuple[str, ...]
    min_compressed_cosine: float | None  # worst cosine of a loaded compressed weight to the FP32 one
    plain_unmatched: tuple[str, ...] = ()  # uncompressed package constants with no torch tensor (left as they were)
    by_value: tuple[str, ...] = ()  # loaded weights whose torch tensor was found by value, not by name
    rescaled: tuple[str, ...] = ()  # loaded weights with a scale coremltools had fused in, divided out


def load_program(package: Path) -> tuple[Any, Any]:
    """(spec, MIL program) of a saved ML Program package, read without Core ML (works on Linux)."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto.load import load as load_mil

    spec = ct.utils.load_spec(str(package))
    if spec.WhichOneof("Type") != "mlProgram":
        raise ValidationFailedError(f"{package.name} is a {spec.WhichOneof('Type')}, not an ML Program")
    weights_dir = Path(package) / "Data" / "com.apple.CoreML" / "weights"
    return spec, load_mil(spec, spec.specificationVersion, str(weights_dir))


def main_operations(program: Any) -> list[Any]:
    return list(program.functions["main"].operations)


def compute_ops(program: Any) -> list[tuple[str, str]]:
    """(op type, op name) of every op that computes (not a const or a weight decompression)."""
    return [(op.op_type, op.name) for op in main_operations(program) if not _is_weight_op(op)]


def package_weights(program: Any) -> list[PackageWeight]:
    """Every float weight tensor the compute ops read (size > 1), decompressed to float32, with
    the op inputs it feeds."""
    ops = main_operations(program)
    consumers: dict[str, list[tuple[str, str]]] = {}
    for op in ops:
        if _is_weight_op(op):
            continue
        for key, value in op.inputs.items():
            for var in value if isinstance(value, (list, tuple)) else [value]:
                consumers.setdefault(var.name, []).append((str(op.name), str(key)))
    found = []
    for op in ops:
        name = op.outputs[0].name
        if not _is_weight_op(op) or name not in consumers:
            continue
        feeds = tuple(consumers[name])
        if op.op_type == "const":
            value = op.outputs[0].val
            if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.size <= 1:
                continue
            found.append(PackageWeight(name, value.astype(np.float32), value.dtype.name, "const", feeds))
        else:
            value = np.asarray(op.materialized_val_inference())
            found.append(PackageWeight(name, value.astype(np.float32), _compression(op), op.op_type, feeds))
    return found


def _compression(op: Any) -> str:
    op_type = str(op.op_type)
    kind = COMPRESSION_OPS.get(op_type, op_type)
    if kind == "palettized":
        lut = op.inputs["lut"].val
        # iOS16: lut is (2**nbits,); iOS18: (..., 2**nbits, vector_size)
        entries = lut.shape[0] if lut.ndim == 1 else lut.shape[-2]
        return f"palettized-{round(math.log2(entries))}bit"
    if kind == "int8":
        data = op.inputs.get("quantized_data", op.inputs.get("data"))
        return str(data.val.dtype) if data is not None and data.val is not None else "int8"
    return kind


def _is_weight_op(op: Any) -> bool:
    op_type = str(op.op_type)
    return op_type == "const" or op_type.startswith("constexpr_")


def link_weights(
    reference: Sequence[PackageWeight], tensors: Mapping[str, np.ndarray]
) -> tuple[dict[str, TorchLink], dict[str, str]]:
    """Link each uncompressed constant of ``reference`` to a torch tensor of ``tensors`` (keyed by
    ``_mil_name``): by name first, then by value among the tensors no constant took by name.
    Returns (links by constant name, why each other constant has none). A value match must be
    unique: a constant that fits several free tensors links none."""
    links: dict[str, TorchLink] = {}
    why: dict[str, str] = {}
    taken: set[str] = set()
    pending = []
    for const in reference:
        name = _lookup(tensors, const.base_name)
        link = _relate(const.values, tensors[name], name, "name") if name is not None else None
        if link is None:
            pending.append(const)
            continue
        links[const.name] = link
        taken.add(link.tensor)
    for const in pending:
        fits = [
            link
            for name, tensor in tensors.items()
            if name not in taken and (link := _relate(const.values, tensor, name, "value")) is not None
        ]
        if len(fits) == 1:
            links[const.name] = fits[0]
            taken.add(fits[0].tensor)
        elif fits:
            why[const.name] = f"fits several free torch tensors ({', '.join(f.tensor for f in fits[:3])}): ambiguous"
        else:
            why[const.name] = f"is no scaled copy of a free torch tensor of shape {list(const.values.shape)}"
    return links, why


def _relate(values: np.ndarray, tensor: np.ndarray, name: str, by: str) -> TorchLink | None:
    """``values`` as ``scale * tensor`` (possibly transposed), or ``None`` if they are not."""
    for transposed in (False, True) if values.ndim == 2 else (False,):
        oriented = values.T if transposed else values
        if oriented.shape != tensor.shape:
            continue
        scale = _fit_scale(oriented.astype(np.float64), tensor.astype(np.float64))
        if scale is not None:
            return TorchLink(name, scale, transposed, by)
    return None


def _fit_scale(values: np.ndarray, tensor: np.ndarray) -> np.ndarray | None:
    """The least-squares scale (one, else one per output channel) with ``values ~ scale * tensor``
    up to FP16 rounding, or ``None``."""
    norm = float(np.sum(tensor * tensor))
    if norm == 0.0:
        return np.ones(()) if not np.any(values) else None
    scale = np.asarray(float(np.sum(values * tensor)) / norm)
    if _cosine(values, scale * tensor) >= _SAME_COSINE:
        return np.ones(()) if abs(float(scale) - 1.0) <= _UNIT_SCALE else scale
    if tensor.ndim < 2 or tensor[0].size < _MIN_PER_CHANNEL:
        return None
    axes = tuple(range(1, tensor.ndim))
    norms = np.sum(tensor * tensor, axis=axes, keepdims=True)
    dots = np.sum(values * tensor, axis=axes, keepdims=True)
    per_channel = np.divide(dots, norms, out=np.ones_like(norms), where=norms > 0)
    if _cosine(values, per_channel * tensor) < _SAME_COSINE:
        return None
    return np.where(np.abs(per_channel - 1.0) <= _UNIT_SCALE, 1.0, per_channel)


def load_into_torch(module: Any, weights: Sequence[PackageWeight], reference: Sequence[PackageWeight]) -> LoadReport:
    """Copy the package's ``weights`` into the matching parameters/buffers of ``module`` (in place).

    ``reference`` are the weights of the same program before compression (the package's own
    weights when nothing was compressed): each package weight is tied to the reference constant
    feeding the same op input, and that constant to its torch tensor (``link_weights``).
    Raises ``ValidationFailedError`` naming every compressed weight that cannot be placed: the
    intermediate would then not compute with the artifact's weights.
    """
    import torch

    tensors = {_mil_name(name): t for name, t in (*module.named_parameters(), *module.named_buffers())}
    links, why = link_weights(reference, {k: t.detach().cpu().numpy() for k, t in tensors.items()})
    source = {key: const.name for const in reference for key in const.consumers}
    filled: dict[str, str] = {}
    loaded: dict[bool, list[str]] = {True: [], False: []}
    unplaced: dict[bool, list[tuple[str, str]]] = {True: [], False: []}
    by_value: list[str] = []
    rescaled: list[str] = []
    cosines: list[float] = []
    for weight in weights:
        link, reason = _place(weight, source, links, why, filled)
        if link is None:
            unplaced[weight.compressed].append((weight.name, reason))
            continue
        target = tensors[link.tensor]
        values = link.to_torch(weight.values)
        if weight.compressed:
            cosines.append(_cosine(values, target.detach().cpu().numpy()))
            if cosines[-1] < _MIN_MATCH_COSINE:
                raise ValidationFailedError(
                    f"compressed weight {weight.name} does not match torch tensor {link.tensor} "
                    f"(cosine {cosines[-1]:.3f}); cannot check the package's numerics"
                )
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.ascontiguousarray(values)).to(target.dtype))
        filled[link.tensor] = weight.name
        loaded[weight.compressed].append(weight.name)
        if link.by == "value":
            by_value.append(weight.name)
        if link.rescaled:
            rescaled.append(weight.name)
    if unplaced[True]:
        listing = "; ".join(f"{name} ({reason})" for name, reason in unplaced[True][:3])
        raise ValidationFailedError(
            f"{len(unplaced[True])} compressed weight(s) of the package match no tensor of the torch intermediate, "
            f"so the package's numerics cannot be checked here: {listing}; use --precision fp16, or report the model"
        )
    return LoadReport(
        compressed_loaded=tuple(loaded[True]),
        plain_loaded=tuple(loaded[False]),
        min_compressed_cosine=min(cosines) if cosines else None,
        plain_unmatched=tuple(name for name, _ in unplaced[False]),
        by_value=tuple(by_value),
        rescaled=tuple(rescaled),
    )


def _place(
    weight: PackageWeight,
    source: Mapping[tuple[str, str], str],
    links: Mapping[str, TorchLink],
    why: Mapping[str, str],
    filled: Mapping[str, str],
) -> tuple[TorchLink | None, str]:
    """The torch tensor ``weight`` goes into, or ``None`` and the reason."""
    refs = sorted({source[key] for key in weight.consumers if key in source})
    if len(refs) != 1:
        return None, f"feeds the inputs of {len(refs)} constants of the uncompressed program, not one"
    link = links.get(refs[0])
    if link is None:
        return None, f"uncompressed as {refs[0]}, which {why[refs[0]]}"
    if link.tensor in filled:
        return None, f"its torch tensor {link.tensor} already holds {filled[link.tensor]}"
    return link, ""


def _mil_name(torch_name: str) -> str:
    """A torch parameter path as coremltools' name sanitizer writes it (``2/Conv.weight`` -> ``2_Conv_weight``)."""
    return re.sub("[^a-zA-Z0-9_]", "_", torch_name)


def _lookup(tensors: Mapping[str, Any], base_name: str) -> str | None:
    # The sanitizer also prefixes names that do not start with a letter (``op_2_Conv_weight``).
    for candidate in (base_name, *(base_name[len(p) :] for p in _PREFIXES if base_name.startswith(p))):
        if candidate in tensors:
            return candidate
    return None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / denom) if denom else 1.0


__all__ = [
    "COMPRESSION_OPS",
    "LoadReport",
    "PackageWeight",
    "TorchLink",
    "compute_ops",
    "link_weights",
    "load_into_torch",
    "load_program",
    "package_weights",
]
