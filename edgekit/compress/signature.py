"""The served interface of an ONNX model as the bundle contract writes it (``Signature``): what the
preparation step records and what the shape folding must keep unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from edgekit.bundle.manifest import DTYPES, Dim, Signature, TensorSpec
from edgekit.errors import ModelFormatError


def served_signature(model: Any) -> Signature:
    """The source model's interface; unnamed dynamic dims get the name ``<tensor>_dim<axis>``."""
    initializers = {i.name for i in model.graph.initializer}
    inputs = tuple(_spec(vi) for vi in model.graph.input if vi.name not in initializers)
    outputs = tuple(_spec(vi) for vi in model.graph.output)
    if not inputs:
        raise ModelFormatError("model has no graph inputs (every input is an initializer)")
    return Signature(inputs=inputs, outputs=outputs)


def _spec(vi: Any) -> TensorSpec:
    from onnx import helper

    if not vi.type.HasField("tensor_type"):
        raise ModelFormatError(f"tensor {vi.name!r} is not a tensor (sequence/map types are not served)")
    tt = vi.type.tensor_type
    try:
        dtype = np.dtype(helper.tensor_dtype_to_np_dtype(tt.elem_type)).name
    except KeyError as exc:
        raise ModelFormatError(f"tensor {vi.name!r} has ONNX element type {tt.elem_type}, which is unknown") from exc
    if dtype not in DTYPES:
        raise ModelFormatError(f"tensor {vi.name!r} is {dtype}; served tensors must be one of {', '.join(DTYPES)}")
    shape: list[Dim] = []
    for axis, d in enumerate(tt.shape.dim):
        # paddle2onnx writes dynamic axes as dim_value -1 and dim_param "?" (the same name for
        # every axis, which would tie them together): both mean "dynamic, unnamed" here
        if d.HasField("dim_value") and d.dim_value > 0:
            shape.append(int(d.dim_value))
        elif d.dim_param and d.dim_param != "?":
            shape.append(d.dim_param)
        else:
            shape.append(f"{vi.name}_dim{axis}")
    return TensorSpec(vi.name, dtype, tuple(shape), layout=_guess_layout(shape))


def _guess_layout(shape: Sequence[Dim]) -> str | None:
    # Image-like 4-D inputs only; recorded so the device adapters keep NCHW served as NCHW.
    if len(shape) != 4:
        return None
    if shape[1] in (1, 3, 4):
        return "NCHW"
    if shape[3] in (1, 3, 4):
        return "NHWC"
    return None
