"""Inputs drawn within a model's declared shapes, for fp32/fp16 packaging without any data.

A float build (fp32, fp16) needs no calibration; its gate and golden vectors still need inputs.
Without ``--calib`` / ``--eval`` they are drawn here, seeded, within the declared shapes: float
inputs from a standard normal, integer inputs within the range the graph can take (the row count
of the table an input indexes through ``Gather``, 0/1 for an input named like a mask, else 0..9),
bool inputs half true. The gate then says the artifact computes what the source model computes on
these inputs; it says nothing about accuracy on real data, and the packager warns so.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from edgekit.bundle.manifest import Signature, TensorSpec
from edgekit.errors import CalibrationDataError

DRAWN_SAMPLES = 50  # enough for the gate not to be a small-sample one (edgekit.validate.eval_size)
SMALL_INT_RANGE = 10  # an integer input whose range the graph does not tell
SEED = 0


def draw_inputs(
    model_path: Path,
    served: Signature,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    count: int = DRAWN_SAMPLES,
    seed: int = SEED,
) -> tuple[dict[str, np.ndarray], str]:
    """(input name -> ``count`` samples on axis 0, one line saying how each input was drawn).

    A dynamic axis other than the batch axis (0) takes its size from ``input_shapes``; without it
    the input cannot be drawn: ``CalibrationDataError`` names the flag to give. A fixed batch B
    rounds ``count`` up to a multiple of B."""
    ranges = _index_ranges(model_path)
    rng = np.random.default_rng(seed)
    batch = next((s.shape[0] for s in served.inputs if isinstance(s.shape[0], int) and s.shape[0] > 1), 1)
    count = math.ceil(count / int(batch)) * int(batch)
    arrays: dict[str, np.ndarray] = {}
    said: list[str] = []
    for spec in served.inputs:
        dims = _sample_dims(spec, input_shapes)
        shape = (count, *dims)
        if spec.dtype.startswith("float"):
            arrays[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
            how = "standard normal"
        elif spec.dtype == "bool":
            arrays[spec.name] = rng.random(shape) < 0.5
            how = "true or false"
        else:
            high, why = _int_range(spec, ranges)
            arrays[spec.name] = rng.integers(0, high, shape).astype(spec.dtype)
            how = f"integers in [0, {high}) ({why})"
        said.append(f"{spec.name!r} {spec.dtype} [N, {', '.join(str(d) for d in dims)}] {how}")
    return arrays, f"{count} inputs drawn within the declared shapes (seed {seed}): " + "; ".join(said)


def _sample_dims(spec: TensorSpec, input_shapes: Mapping[str, Sequence[int]] | None) -> tuple[int, ...]:
    given = (input_shapes or {}).get(spec.name)
    dims = []
    for axis, dim in enumerate(spec.shape[1:], start=1):
        if isinstance(dim, int):
            dims.append(dim)
        elif given is not None:
            dims.append(int(given[axis]))
        else:
            example = "x".join(
                "1" if i == 0 else (str(d) if isinstance(d, int) else "128") for i, d in enumerate(spec.shape)
            )
            raise CalibrationDataError(
                f"no data to draw inputs from: input {spec.name!r} {list(spec.shape)} has the dynamic axis {axis} "
                f"({dim!r}); give its size with --input-shape {spec.name}={example}, or give --eval data"
            )
    return tuple(dims)


def _int_range(spec: TensorSpec, ranges: Mapping[str, int]) -> tuple[int, str]:
    if spec.name in ranges:
        return ranges[spec.name], "the rows of the table it indexes"
    if "mask" in spec.name.lower():
        return 2, "a mask"
    low = np.iinfo(np.dtype(spec.dtype))
    return min(SMALL_INT_RANGE, int(low.max) + 1), "no range in the graph"


def _index_ranges(model_path: Path) -> dict[str, int]:
    """Graph input name -> the row count of the initializer table a ``Gather`` indexes with it."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    graph = model.graph
    tables = {t.name: tuple(t.dims) for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    found: dict[str, int] = {}
    for node in graph.node:
        if node.op_type != "Gather" or len(node.input) < 2 or node.input[1] not in inputs:
            continue
        table = tables.get(node.input[0])
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        if table and -len(table) <= axis < len(table):
            rows = int(table[axis])
            found[node.input[1]] = min(found.get(node.input[1], rows), rows)
    return found


def drawn_for_validation(
    model_path: Path, served: Signature, input_shapes: Mapping[str, Sequence[int]] | None = None
) -> tuple[dict[str, np.ndarray], str]:
    """``draw_inputs`` for a package call given no data: warns (``EdgekitWarning``) what was drawn
    and what the gate then means; returns the arrays and the note the manifest's validation keeps."""
    import warnings

    from edgekit.errors import EdgekitWarning

    arrays, how = draw_inputs(model_path, served, input_shapes)
    note = f"validated and golden vectors on {how}"
    warnings.warn(
        f"no --calib or --eval data: {note}; the gate shows the artifact computes what the source model does on "
        "these, not its accuracy on your data",
        EdgekitWarning,
        stacklevel=3,
    )
    return arrays, note
