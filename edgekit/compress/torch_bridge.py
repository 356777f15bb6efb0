"""An ONNX model as a trainable torch module, and back to ONNX with the original's interface.

Compression steps that change weights or architecture (pruning, distillation, low-rank) work on
a torch module: ``load_module`` converts the ONNX graph with onnx2torch; ``export_like`` writes
the module back with the SAME input/output names, element types and dynamic axes as the source
model, so the compressed model is a drop-in replacement that enters the optimisation engine and
the gate like any other candidate.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import ModelFormatError


@dataclass(frozen=True)
class OnnxInterface:
    """What a compressed model must keep: inputs (name, dims with None where dynamic, dtype),
    output names in order, the dynamic axes by tensor, and the opset."""

    inputs: tuple[tuple[str, tuple[int | None, ...], str], ...]
    outputs: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    opset: int

    def example(self, samples: Mapping[str, np.ndarray] | None = None, batch: int = 1) -> tuple[Any, ...]:
        """Example inputs for tracing: the first ``batch`` samples where given, else zeros with
        dynamic dims set to 1 (``batch`` on axis 0)."""
        import torch

        out = []
        for name, dims, dtype in self.inputs:
            if samples is not None and name in samples:
                out.append(torch.from_numpy(np.ascontiguousarray(samples[name][:batch])))
                continue
            if any(d is None for d in dims[1:]):
                raise ModelFormatError(
                    f"input {name!r} has dynamic dimensions {list(dims)} beyond the batch: give data "
                    "(--train or --eval) so the model can be traced at a real shape"
                )
            shape = [batch if i == 0 and d is None else (d or 1) for i, d in enumerate(dims)]
            out.append(torch.zeros(shape, dtype=getattr(torch, dtype)))
        return tuple(out)


def interface(path: Path) -> OnnxInterface:
    """The source model's interface, read from its graph."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    initializers = {i.name for i in model.graph.initializer}
    inputs = []
    dynamic: dict[str, dict[int, str]] = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        tt = vi.type.tensor_type
        dims: list[int | None] = []
        for axis, d in enumerate(tt.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                dims.append(int(d.dim_value))
            else:
                dims.append(None)
                dynamic.setdefault(vi.name, {})[axis] = d.dim_param or f"{vi.name}_dim{axis}"
        inputs.append((vi.name, tuple(dims), np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name))
    for vo in model.graph.output:
        for axis, d in enumerate(vo.type.tensor_type.shape.dim):
            if not (d.HasField("dim_value") and d.dim_value > 0):
                dynamic.setdefault(vo.name, {})[axis] = d.dim_param or f"{vo.name}_dim{axis}"
    opset = next((int(i.version) for i in model.opset_import if i.domain in ("", "ai.onnx")), 17)
    return OnnxInterface(tuple(inputs), tuple(o.name for o in model.graph.output), dynamic, opset)


def load_module(path: Path) -> Any:
    """The ONNX model as a torch module (onnx2torch), in training-ready float32.

    Graphs onnx2torch cannot read as they are (old opsets, initializers listed as graph inputs,
    as paddle2onnx writes them) are read after the packager's own preparation (opset upgrade,
    shape inference, ONNX Runtime's basic optimisation: the same function, checked there)."""
    import tempfile

    from edgekit.compress.onnx_prep import prepare_model
    from edgekit.compress.onnx_to_torch import onnx_to_torch

    try:
        return onnx_to_torch(path).float()
    except Exception as first:  # onnx2torch raises bare exceptions (KeyError, ...) on graphs it cannot read
        with tempfile.TemporaryDirectory(prefix="edgekit-torch-") as tmp:
            try:
                prepared = prepare_model(path, Path(tmp))
                return onnx_to_torch(prepared.path).float()
            except Exception as exc:  # the same
                raise ModelFormatError(
                    f"{path.name}: cannot be turned into a trainable torch module for compression ({first!r}; after "
                    f"preparation: {exc!r}); compress the PyTorch model before exporting it, or use quantization only"
                ) from exc


def export_like(module: Any, reference: OnnxInterface, out: Path, example: tuple[Any, ...]) -> Path:
    """Write ``module`` as ONNX with ``reference``'s input/output names and dynamic axes."""
    import torch

    module = module.eval()
    out.parent.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():
        torch.onnx.export(
            module,
            example,
            str(out),
            input_names=[name for name, _, _ in reference.inputs],
            output_names=list(reference.outputs),
            dynamic_axes={k: dict(v) for k, v in reference.dynamic_axes.items()} or None,
            opset_version=max(13, reference.opset),
            dynamo=False,  # the TorchScript exporter: the dynamo one needs onnxscript
        )
    return out


def parameter_count(module: Any) -> int:
    return int(sum(p.numel() for p in module.parameters()))


__all__ = ["OnnxInterface", "export_like", "interface", "load_module", "parameter_count"]
