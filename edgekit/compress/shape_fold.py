"""Fold shape sub-graphs out of an ONNX model once, before any target's converter sees it.

PyTorch's TorchScript exporter (and Keras' tf2onnx) compute sizes at run time even where the
spatial dims are fixed: ``F.interpolate(x, size=skip.shape[-2:])`` becomes
``Shape -> Gather -> Unsqueeze -> Concat -> Resize(sizes=...)``, ``y.reshape(y.shape[0], ...)``
becomes ``Shape -> Gather -> Concat -> Reshape``. Converters keep those sub-graphs (OpenVINO's IR
keeps ``ShapeOf`` chains) or mishandle them; folding them once here gives every target the
folded graph.

The folding is onnxslim's (constant folding with onnx-graphsurgeon's partial ``Shape`` folding,
shape inference, repeated to a fixed point). Measured on a U-Net-like torch export with a dynamic
batch (64 nodes, 8 ``Shape``): ONNX Runtime's offline ``ORT_ENABLE_BASIC`` optimisation, which
preparation already runs, left 34 nodes and 4 ``Shape``; onnx-graphsurgeon's ``fold_constants``
and onnxslim both left 22 nodes and 2 ``Shape``, onnxslim also turning the ``Reshape`` target's
``Shape(y)[0]`` into ``0`` (copy the dim). onnxslim is taken because it iterates folding and shape
inference to convergence and is already the tool ``edgekit.compress.freeze`` uses. Its fusion
patterns (Conv+BN, Conv+Add, Gemm, Pad+Conv, ...) are skipped: this graph also goes to NNCF,
which quantizes the graph as exported better than a fused one (``openvino_candidates``).

What neither library folds is a ``Resize`` whose ``sizes`` are ``Concat(Shape(x)[0:2], [H, W])``:
with a dynamic batch, ``sizes`` must read the batch at run time. Where every axis of ``sizes`` is
either the same axis of ``x``'s own shape or a constant over a static dim of ``x``, and the
constant scales ``sizes / x.shape`` reproduce ``sizes`` exactly (``floor(dim * scale) == size``
in float32 and float64), the ``Resize`` takes those ``scales`` instead: the ONNX spec derives the
coordinate scale from ``sizes`` as ``size / dim``, the same float32 value, so the output is the
same, and the ``Shape`` chain goes.

The folded graph must serve the same signature (input and output names, dtypes, fixed dims, dynamic
axes still dynamic) and compute the same outputs (ONNX Runtime, two drawn samples: max abs diff
within ``ATOL``/``RTOL``); otherwise, or when onnxslim raises, the unfolded model is kept and
``FoldedGraph.refused`` says why in one line.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import Signature

# The folded graph computes the same function: a larger difference is a folding bug, not rounding.
ATOL = 1e-5
RTOL = 1e-5
CHECK_SAMPLES = 2  # a batch of 2: a batch folded to 1 fails the check
_SHAPE_OPS = frozenset({"Shape", "Size"})
# onnxslim's patterns that fuse compute ops; the elimination patterns and the Concat->Reshape
# one (a target dim read from Shape becomes 0, "copy this dim") only simplify shapes.
_COMPUTE_FUSIONS = (
    "FusionConvAdd",
    "FusionConvTransposeAdd",
    "FusionConvBN",
    "FusionConvTransposeBN",
    "FusionConvMul",
    "FusionConvTransposeMul",
    "FusionGemm",
    "FusionGemmMul",
    "FusionGemmAdd",
    "FusionPadConv",
    "FusionReduce",
)


@dataclass(frozen=True)
class FoldedGraph:
    """The graph targets build from after folding, and what folding did (one line for the notes)."""

    path: Path  # the folded model; the unfolded one when folding was refused
    tool: str  # e.g. "onnxslim 0.1.98"
    nodes_before: int
    nodes_after: int
    shape_ops_before: int  # Shape/Size nodes
    shape_ops_after: int
    resize_scales: int = 0  # Resize nodes whose run-time sizes became constant scales
    max_abs_diff: float | None = None  # folded vs unfolded outputs on the check samples
    refused: str = ""  # why the unfolded model is kept; "" when folded

    @property
    def folded(self) -> bool:
        return not self.refused

    @property
    def note(self) -> str:
        """One line for the preparation steps; "" when the model has no shape sub-graph."""
        if not self.shape_ops_before:
            return ""
        if self.refused:
            return f"shape sub-graphs not folded ({self.tool}): {self.refused}; the unfolded model is used"
        resize = f", {self.resize_scales} Resize sizes as constant scales" if self.resize_scales else ""
        diff = f"; outputs vs unfolded max abs diff {self.max_abs_diff:.2g}" if self.max_abs_diff is not None else ""
        return (
            f"shape sub-graphs folded ({self.tool}): {self.nodes_before - self.nodes_after} nodes removed "
            f"({self.nodes_before} -> {self.nodes_after}), Shape ops {self.shape_ops_before} -> "
            f"{self.shape_ops_after}{resize}{diff}"
        )


def fold_shapes(
    src: Path,
    dst: Path,
    served: Signature,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
) -> FoldedGraph:
    """Write to ``dst`` ``src`` with its shape sub-graphs folded, checked against ``src``.

    ``served``: ``src``'s signature, which the folded graph must keep. ``input_shapes``
    (``--input-shape``) sizes the dynamic axes other than the batch for the numerical check; a
    model with such an axis and no size is not folded (it cannot be checked). Never raises for a
    model the folder cannot handle: ``refused`` says why and ``path`` is ``src``."""
    import onnx

    from edgekit.compress.signature import served_signature

    model = onnx.load(str(src))
    before = len(model.graph.node)
    shape_before = _shape_ops(model)

    def refuse(tool: str, why: str) -> FoldedGraph:
        return FoldedGraph(src, tool, before, before, shape_before, shape_before, refused=why)

    if not shape_before:  # nothing computes a size at run time: nothing to fold
        return FoldedGraph(src, "", before, before, 0, 0, refused="no Shape or Size node")

    try:
        import onnxslim
    except ImportError:
        return refuse("onnxslim", "onnxslim is not installed (pip install onnxslim)")
    tool = f"onnxslim {onnxslim.__version__}"
    try:
        folded = _slim(onnxslim, model)
        rewritten = resize_sizes_as_scales(folded)
        if rewritten:  # the Shape -> Slice -> Concat chains that fed the sizes are dead now
            folded = _slim(onnxslim, folded)
    except Exception as exc:  # onnxslim raises whatever its passes raise; the unfolded model still works
        return refuse(tool, f"it raised {type(exc).__name__}: {_first_line(exc)}")
    changed = signature_change(served, served_signature(folded))
    if changed:
        return refuse(tool, changed)
    try:
        onnx.save(folded, str(dst))
    except (OSError, ValueError) as exc:  # a graph over protobuf's 2 GB, a full disk: convert unfolded
        dst.unlink(missing_ok=True)
        return refuse(tool, f"the folded graph could not be written: {_first_line(exc)}")
    try:
        diff = _max_abs_diff(src, dst, served, input_shapes)
    except _Unchecked as exc:
        dst.unlink()
        return refuse(tool, str(exc))
    if diff is None or not np.isfinite(diff[0]) or diff[0] > ATOL + RTOL * diff[1]:
        dst.unlink()
        shown = "non-finite" if diff is None or not np.isfinite(diff[0]) else f"{diff[0]:.3g}"
        return refuse(tool, f"its outputs differ from the unfolded model's (max abs diff {shown})")
    return FoldedGraph(
        dst,
        tool,
        before,
        len(folded.graph.node),
        shape_before,
        _shape_ops(folded),
        resize_scales=rewritten,
        max_abs_diff=diff[0],
    )


def _slim(onnxslim: Any, model: Any) -> Any:
    slimmed = onnxslim.slim(model, skip_fusion_patterns=list(_COMPUTE_FUSIONS))
    if slimmed is None:  # onnxslim returns None when it gives up (it logs why)
        raise ValueError("onnxslim gave up on the model")
    return slimmed


def signature_change(before: Signature, after: Signature) -> str:
    """One line naming the first way ``after`` serves differently from ``before``; "" if none.

    Dim names may differ (shape inference renames them); a fixed dim must stay that size and a
    dynamic input axis must stay dynamic. An output axis the exporter left unknown may become fixed
    where folding shows it is (YOLO heads' ``4 + classes`` rows): the numerical check then runs
    the folded graph at a batch other than the export's."""
    for kind, old, new in (("input", before.inputs, after.inputs), ("output", before.outputs, after.outputs)):
        if [t.name for t in old] != [t.name for t in new]:
            return f"it changed the {kind}s {[t.name for t in old]} -> {[t.name for t in new]}"
        for a, b in zip(old, new, strict=True):
            if a.dtype != b.dtype:
                return f"it changed {kind} {a.name!r} from {a.dtype} to {b.dtype}"
            fixed_a = [d if isinstance(d, int) else None for d in a.shape]
            fixed_b = [d if isinstance(d, int) else None for d in b.shape]
            if kind == "output" and len(fixed_a) == len(fixed_b):
                fixed_b = [None if x is None else y for x, y in zip(fixed_a, fixed_b, strict=True)]
            if fixed_a != fixed_b:
                return f"it changed {kind} {a.name!r} from {list(a.shape)} to {list(b.shape)}"
    return ""


def resize_sizes_as_scales(model: Any) -> int:
    """Give every ``Resize`` whose ``sizes`` are ``Concat`` of slices of its input's own shape
    (same axes) and constants over static dims the equivalent constant ``scales`` (module
    docstring); returns how many were rewritten. The model is changed in place."""
    from onnx import numpy_helper

    from edgekit.compress.onnx_nodes import constant_nodes

    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    consts.update((node.output[0], numpy_helper.to_array(t)) for node, t in constant_nodes(graph))
    producer = {out: node for node in graph.node for out in node.output}
    dims = {
        vi.name: [d.dim_value if d.HasField("dim_value") else None for d in vi.type.tensor_type.shape.dim]
        for vi in (*graph.input, *graph.value_info, *graph.output)
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
    }
    names = {t.name for t in graph.initializer} | {o for n in graph.node for o in n.output}
    rewritten = 0
    for node in graph.node:
        if node.op_type != "Resize" or len(node.input) < 4 or not node.input[3] or node.input[3] in consts:
            continue
        if any(a.name == "axes" for a in node.attribute):  # sizes of some axes only: left as is
            continue
        x_dims = dims.get(node.input[0])
        if x_dims is None:
            continue
        sources = _sizes_sources(node.input[0], node.input[3], len(x_dims), producer, consts)
        scales = None if sources is None else _exact_scales(x_dims, sources)
        if scales is None:
            continue
        name = _unique(f"{node.name or node.output[0]}_scales", names)
        graph.initializer.append(numpy_helper.from_array(np.asarray(scales, dtype=np.float32), name))
        roi = node.input[1]
        node.input[:] = [node.input[0], roi, name]
        rewritten += 1
    return rewritten


def empty_resize_inputs_as_float32(model: Any) -> int:
    """Point every ``Resize`` input ``roi``/``scales`` that a float16 converter routed through a
    ``Cast`` from an empty constant at one empty float32 initializer; returns how many. Exporters
    write an empty ``scales`` next to ``sizes`` (opset 11 requires the input); after the float16
    converter casts it, ONNX Runtime's shape inference can no longer see it is empty and refuses
    the node ("Either `sizes` or `scales` must be provided, but not both"). In place."""
    from onnx import numpy_helper

    from edgekit.compress.onnx_nodes import constant_nodes

    graph = model.graph
    empty = {t.name for t in graph.initializer if 0 in t.dims}
    empty.update(node.output[0] for node, t in constant_nodes(graph) if 0 in t.dims)
    producer = {out: node for node in graph.node for out in node.output}
    name = ""
    pointed = 0
    for node in graph.node:
        if node.op_type != "Resize":
            continue
        for i in (1, 2):
            if i >= len(node.input) or not node.input[i] or node.input[i] in empty:
                continue
            source = producer.get(node.input[i])
            while source is not None and source.op_type == "Cast" and source.input[0] not in empty:
                source = producer.get(source.input[0])
            if source is None or source.op_type != "Cast":
                continue
            if not name:
                name = _unique("edgekit_empty_float32", {t.name for t in graph.initializer} | set(producer))
                graph.initializer.append(numpy_helper.from_array(np.zeros(0, np.float32), name))
            node.input[i] = name
            pointed += 1
    return pointed


def _sizes_sources(
    x: str, sizes: str, rank: int, producer: Mapping[str, Any], consts: Mapping[str, np.ndarray]
) -> list[tuple[str, int]] | None:
    """Per output axis: ``("dim", i)`` (axis ``i`` of ``x`` read at run time) or ``("const", n)``;
    ``None`` when ``sizes`` is built any other way."""
    concat = producer.get(sizes)
    if concat is None or concat.op_type != "Concat":
        return None
    out: list[tuple[str, int]] = []
    for part in concat.input:
        if part in consts:
            out.extend(("const", int(v)) for v in np.asarray(consts[part]).reshape(-1))
            continue
        axes = _shape_slice_axes(x, rank, producer.get(part), producer, consts)
        if axes is None:
            return None
        out.extend(("dim", i) for i in axes)
    return out


def _shape_slice_axes(
    x: str, rank: int, node: Any, producer: Mapping[str, Any], consts: Mapping[str, np.ndarray]
) -> list[int] | None:
    """The axes of ``x`` that ``Slice(Shape(x), start, end)`` (step 1, constant bounds) reads."""
    if node is None or node.op_type != "Slice" or len(node.input) < 3:
        return None
    shape = producer.get(node.input[0])
    if shape is None or shape.op_type != "Shape" or shape.input[0] != x or shape.attribute:
        return None  # Shape's start/end attributes: left as is
    optional = [i for i in node.input[3:] if i]
    if any(i not in consts for i in (*node.input[1:3], *optional)):
        return None
    if len(node.input) > 4 and node.input[4] and int(np.asarray(consts[node.input[4]]).reshape(-1)[0]) != 1:
        return None
    if len(node.input) > 3 and node.input[3] and int(np.asarray(consts[node.input[3]]).reshape(-1)[0]) not in (0, -1):
        return None  # a slice along the shape vector's only axis is axis 0 (or -1)
    start = int(np.asarray(consts[node.input[1]]).reshape(-1)[0])
    end = int(np.asarray(consts[node.input[2]]).reshape(-1)[0])
    return list(range(rank)[start:end])


def _exact_scales(x_dims: Sequence[int | None], sources: Sequence[tuple[str, int]]) -> list[np.float32] | None:
    if len(sources) != len(x_dims):
        return None
    scales: list[np.float32] = []
    for axis, (kind, value) in enumerate(sources):
        if kind == "dim":
            if value != axis:
                return None
            scales.append(np.float32(1.0))
            continue
        dim = x_dims[axis]
        if not dim or value < 1:
            return None
        scale = np.float32(value) / np.float32(dim)
        if int(np.floor(np.float64(scale) * dim)) != value or int(np.floor(scale * np.float32(dim))) != value:
            return None
        scales.append(scale)
    return scales


class _Unchecked(Exception):
    """The folded graph could not be checked against the unfolded one (the message says why)."""


def _max_abs_diff(
    src: Path, dst: Path, served: Signature, input_shapes: Mapping[str, Sequence[int]] | None
) -> tuple[float, float] | None:
    """(max abs diff folded vs unfolded, max abs unfolded output) on drawn inputs; ``None`` when
    the two disagree on which outputs are finite."""
    import onnxruntime as ort

    from edgekit.errors import CalibrationDataError
    from edgekit.validate.drawn_inputs import draw_inputs

    try:
        feed, _ = draw_inputs(src, served, input_shapes, count=CHECK_SAMPLES)
    except CalibrationDataError as exc:
        axes = [f"{s.name}[{i}]" for s in served.inputs for i, d in enumerate(s.shape) if i and not isinstance(d, int)]
        raise _Unchecked(
            f"no size for the dynamic {'axis' if len(axes) == 1 else 'axes'} {', '.join(axes)} to check the folded "
            "graph with (--input-shape gives one)"
        ) from exc
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # each graph as written
    options.log_severity_level = 3
    # a model with a fixed batch axis takes its samples that many at a time
    fixed = {s.shape[0] for s in served.inputs if s.shape and isinstance(s.shape[0], int)}
    step = min(fixed) if fixed and min(fixed) > 0 else len(next(iter(feed.values())))
    total = len(next(iter(feed.values())))
    try:
        sessions = [ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"]) for path in (src, dst)]
        ref, got = (
            [
                parts[0] if len(parts) == 1 else np.concatenate(parts)
                for parts in zip(
                    *(s.run(None, {k: v[i : i + step] for k, v in feed.items()}) for i in range(0, total, step)),
                    strict=True,
                )
            ]
            for s in sessions
        )
    except Exception as exc:  # ORT's exception types are not exported; either graph failing means unchecked
        raise _Unchecked(f"ONNX Runtime could not run it on drawn inputs ({_first_line(exc)})") from exc
    worst, scale = 0.0, 0.0
    for a, b in zip(ref, got, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if a.shape != b.shape:
            raise _Unchecked(f"an output's shape changed from {list(a.shape)} to {list(b.shape)}")
        if a.dtype.kind == "b" or a.dtype.kind in "iu":
            a, b = a.astype(np.float64), b.astype(np.float64)
        if not np.array_equal(np.isfinite(a), np.isfinite(b)):
            return None
        finite = np.isfinite(a)
        if finite.any():
            worst = max(worst, float(np.max(np.abs(a[finite].astype(np.float64) - b[finite]))))
            scale = max(scale, float(np.max(np.abs(a[finite]))))
    return worst, scale


def _shape_ops(model: Any) -> int:
    return sum(1 for n in model.graph.node if n.op_type in _SHAPE_OPS)


def _unique(name: str, taken: set[str]) -> str:
    candidate, n = name, 1
    while candidate in taken:
        candidate, n = f"{name}_{n}", n + 1
    taken.add(candidate)
    return candidate


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


__all__ = ["ATOL", "RTOL", "FoldedGraph", "fold_shapes", "resize_sizes_as_scales", "signature_change"]
