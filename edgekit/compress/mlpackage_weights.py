"""The weights an ``.mlpackage`` really holds, read back from the saved package.

Core ML prediction does not run on Linux, so the apple target checks its artifact's numerics by
loading these weights into the torch graph it converted from: palettized weights are the LUT
looked up by the stored indices, int8 weights the stored integers times their scales
(``materialized_val_inference`` of the MIL ``constexpr_*`` ops), plain weights the stored FP16 or
FP32 values. Weights are matched to torch tensors by name (the PyTorch frontend names a weight
``<module>_<param>`` and compression appends ``_to_fp16``, ``_palettized``, ``_quantized``).
"""

from __future__ import annotations

import math
import re
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
_PREFIXES = ("op_", "var_", "_")
_MIN_MATCH_COSINE = 0.9  # a compressed weight far from its torch tensor means a wrong match


@dataclass(frozen=True)
class PackageWeight:
    name: str  # MIL value name, e.g. conv1_weight_to_fp16_palettized
    values: np.ndarray  # float32, as the model computes with it
    compression: str  # fp16, fp32, int8, uint8, palettized-4bit, ...
    op_type: str  # const or the constexpr op that decompresses it

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
class LoadReport:
    compressed_loaded: tuple[str, ...]
    plain_loaded: tuple[str, ...]
    min_compressed_cosine: float | None  # worst cosine of a loaded compressed weight to the FP32 one
    plain_unmatched: tuple[str, ...] = ()  # uncompressed package constants with no torch tensor (left as they were)


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
    """Every float weight tensor the compute ops read (size > 1), decompressed to float32."""
    ops = main_operations(program)
    read_by_compute = {v.name for op in ops if not _is_weight_op(op) for v in _input_vars(op)}
    found = []
    for op in ops:
        if not _is_weight_op(op) or op.outputs[0].name not in read_by_compute:
            continue
        if op.op_type == "const":
            value = op.outputs[0].val
            if not isinstance(value, np.ndarray) or value.dtype.kind != "f" or value.size <= 1:
                continue
            found.append(PackageWeight(op.outputs[0].name, value.astype(np.float32), value.dtype.name, "const"))
        else:
            value = np.asarray(op.materialized_val_inference())
            found.append(PackageWeight(op.outputs[0].name, value.astype(np.float32), _compression(op), op.op_type))
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


def _input_vars(op: Any) -> list[Any]:
    out: list[Any] = []
    for value in op.inputs.values():
        out.extend(value if isinstance(value, (list, tuple)) else [value])
    return out


def load_into_torch(module: Any, weights: list[PackageWeight]) -> LoadReport:
    """Copy ``weights`` into the matching parameters/buffers of ``module`` (in place).

    Raises ``ValidationFailedError`` when a compressed weight has no matching torch tensor: the
    intermediate would then not compute with the artifact's weights.
    """
    import torch

    tensors = {_mil_name(name): t for name, t in (*module.named_parameters(), *module.named_buffers())}
    compressed: list[str] = []
    plain: list[str] = []
    cosines: list[float] = []
    unmatched: list[str] = []
    plain_unmatched: list[str] = []
    for weight in weights:
        target = _lookup(tensors, weight.base_name)
        values = _fit(weight.values, target.detach().cpu().numpy()) if target is not None else None
        if target is None or values is None:
            (unmatched if weight.compressed else plain_unmatched).append(weight.name)
            continue
        if weight.compressed:
            cosines.append(_cosine(values, target.detach().cpu().numpy()))
            if cosines[-1] < _MIN_MATCH_COSINE:
                raise ValidationFailedError(
                    f"compressed weight {weight.name} does not match torch tensor {weight.base_name} "
                    f"(cosine {cosines[-1]:.3f}); cannot check the package's numerics"
                )
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.ascontiguousarray(values)).to(target.dtype))
        (compressed if weight.compressed else plain).append(weight.name)
    if unmatched:
        raise ValidationFailedError(
            f"{len(unmatched)} compressed weight(s) of the package ({', '.join(unmatched[:3])}) match no tensor of "
            "the torch intermediate, so the package's numerics cannot be checked here; use --precision fp16"
        )
    return LoadReport(tuple(compressed), tuple(plain), min(cosines) if cosines else None, tuple(plain_unmatched))


def _mil_name(torch_name: str) -> str:
    """A torch parameter path as coremltools' name sanitizer writes it (``2/Conv.weight`` -> ``2_Conv_weight``)."""
    return re.sub("[^a-zA-Z0-9_]", "_", torch_name)


def _lookup(tensors: dict[str, Any], base_name: str) -> Any:
    # The sanitizer also prefixes names that do not start with a letter (``op_2_Conv_weight``).
    for candidate in (base_name, *(base_name[len(p) :] for p in _PREFIXES if base_name.startswith(p))):
        if candidate in tensors:
            return tensors[candidate]
    return None


def _fit(values: np.ndarray, current: np.ndarray) -> np.ndarray | None:
    """``values`` laid out like the torch tensor ``current``, or ``None`` if they cannot be.
    A MatMul weight (in, out) becomes a Core ML linear weight (out, in); for a square one the
    orientation closer to the torch tensor wins."""
    options = [values, values.T] if values.ndim == 2 else [values]
    fitting = [v for v in options if v.shape == current.shape]
    return max(fitting, key=lambda v: _cosine(v, current)) if fitting else None


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    denom = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b / denom) if denom else 1.0


__all__ = [
    "COMPRESSION_OPS",
    "LoadReport",
    "PackageWeight",
    "compute_ops",
    "load_into_torch",
    "load_program",
    "package_weights",
]
