"""Cut points of an ONNX graph and the head/tail sub-models on either side of one.

A cut after position ``k`` of the graph's topological order puts nodes ``[0, k)`` on the device
(the head) and the rest on the server (the tail). The tensors that cross it are the live set at
``k``: produced before ``k`` (or graph inputs) and read at or after ``k``. Constants (outputs of
nodes without inputs, e.g. ``Constant``) never cross: the tail re-creates them. A cut is kept
when at most ``max_tensors`` tensors cross, the head computes something, the tail produces every
graph output (no graph output is made in the head), no graph input crosses (that cut sends the raw input anyway)
and its set differs from the previous cut's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgekit.errors import ModelFormatError

if TYPE_CHECKING:
    import onnx


@dataclass(frozen=True)
class CutPoint:
    """One place to cut: ``id`` is ``cut<k>`` with ``k`` the number of nodes in the head (stable
    for one model file); ``tensors`` cross it (head outputs = tail inputs, in graph order)."""

    id: str
    position: int
    tensors: tuple[str, ...]
    nodes: int  # nodes in the whole graph


def load_model(path: Path, input_shapes: dict[str, tuple[int, ...]] | None = None) -> onnx.ModelProto:
    """The model with shapes inferred (every cut tensor needs a type for the tail's inputs); input
    dimensions named in ``input_shapes`` are fixed first."""
    import onnx

    try:
        model = onnx.load(str(path))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{path} is not a readable ONNX model ({exc})") from exc
    except Exception as exc:  # protobuf's DecodeError has no common base with the above
        raise ModelFormatError(f"{path} is not a readable ONNX model ({type(exc).__name__}: {exc})") from exc
    if input_shapes:
        inputs = {i.name: i for i in model.graph.input}
        for name, shape in input_shapes.items():
            if name not in inputs:
                raise ModelFormatError(
                    f"--input-shape {name}: the model has no input {name!r} (it has {sorted(inputs)})"
                )
            dims = inputs[name].type.tensor_type.shape.dim
            if len(dims) != len(shape):
                raise ModelFormatError(
                    f"--input-shape {name}: {len(shape)} dimensions given, the input has {len(dims)}"
                )
            for dim, size in zip(dims, shape, strict=True):
                dim.Clear()
                dim.dim_value = size
    try:
        return onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    except Exception as exc:  # onnx raises its C++ InferenceError, which has no Python base of its own
        raise ModelFormatError(
            f"{path}: ONNX shape inference failed ({exc}); fix the input shapes with --input-shape"
        ) from exc


def graph_inputs(model: onnx.ModelProto) -> list[str]:
    initializers = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in initializers]


def enumerate_cuts(model: onnx.ModelProto, max_tensors: int = 1) -> list[CutPoint]:
    """Every cut where at most ``max_tensors`` tensors cross (see the module docstring)."""
    graph = model.graph
    nodes = list(graph.node)
    n = len(nodes)
    constant = {o for node in nodes if not [i for i in node.input if i] for o in node.output}
    constant |= {i.name for i in graph.initializer}
    producer: dict[str, int] = {name: -1 for name in graph_inputs(model)}
    last_use: dict[str, int] = {}
    for k, node in enumerate(nodes):
        for name in node.input:
            if name and name not in constant:
                if name not in producer:
                    raise ModelFormatError(
                        f"node {node.name or node.op_type!r} reads {name!r} before it is produced: "
                        "the graph is not topologically sorted (re-save it with onnx or onnxslim)"
                    )
                last_use[name] = k
        for name in node.output:
            if name:
                producer[name] = k
    outputs = {o.name for o in graph.output}
    first_output = min((producer.get(o, n) for o in outputs), default=n)
    compute = [k for k, node in enumerate(nodes) if node.output and not set(node.output) <= constant]
    cuts: list[CutPoint] = []
    previous: tuple[str, ...] | None = None
    for k in range(1, n):
        if k > first_output:  # a graph output would be made in the head
            break
        if not compute or compute[0] >= k or compute[-1] < k:
            continue
        live = tuple(
            name for name, made in producer.items() if made < k and name not in constant and last_use.get(name, -1) >= k
        )
        if not live or len(live) > max_tensors or live == previous or any(producer[t] < 0 for t in live):
            continue
        previous = live
        cuts.append(CutPoint(id=f"cut{k}", position=k, tensors=live, nodes=n))
    return cuts


def tensor_bytes(model: onnx.ModelProto, name: str) -> int | None:
    """Bytes per sample of tensor ``name`` from the inferred shapes (a symbolic leading axis is the
    batch: 1); None when another axis is not known."""
    from onnx import helper

    infos = {v.name: v for v in (*model.graph.value_info, *model.graph.input, *model.graph.output)}
    info = infos.get(name)
    if info is None or not info.type.HasField("tensor_type"):
        return None
    size = helper.tensor_dtype_to_np_dtype(info.type.tensor_type.elem_type).itemsize
    for k, dim in enumerate(info.type.tensor_type.shape.dim):
        if dim.HasField("dim_value"):
            size *= dim.dim_value
        elif k != 0:
            return None
    return int(size)


def undominated(model: onnx.ModelProto, cuts: Sequence[CutPoint]) -> list[CutPoint]:
    """The cuts that send fewer bytes than the input and than every earlier cut. A later cut that
    sends no fewer bytes does more on the device and sends no less: it cannot win while the server
    is at least as fast as the device (pass every cut, ``--all-cuts``, when it is not). Cuts whose
    size is not known from the shapes are kept."""
    inputs = [tensor_bytes(model, i) for i in graph_inputs(model)]
    least = sum(b for b in inputs if b is not None) if all(b is not None for b in inputs) else None
    kept = []
    for cut in cuts:
        sizes = [tensor_bytes(model, t) for t in cut.tensors]
        if any(b is None for b in sizes):
            kept.append(cut)
            continue
        size = sum(b for b in sizes if b is not None)
        if least is None or size < least:
            kept.append(cut)
            least = size
    return kept


def extract(model: onnx.ModelProto, cut: CutPoint) -> tuple[onnx.ModelProto, onnx.ModelProto]:
    """(head, tail) sub-models for ``cut``: head takes the graph inputs and returns the cut's
    tensors; tail takes the cut's tensors and returns the graph outputs."""
    import onnx.utils

    extractor = onnx.utils.Extractor(model)
    inputs = graph_inputs(model)
    outputs = [o.name for o in model.graph.output]
    missing = [t for t in cut.tensors if t not in extractor.value_infos]
    if missing:
        raise ModelFormatError(
            f"{cut.id}: ONNX shape inference gave no type for {missing}; fix the input shapes with --input-shape"
        )
    head = extractor.extract_model(inputs, list(cut.tensors))
    head = _prune_inputs(head)
    tail = extractor.extract_model(list(cut.tensors), outputs)
    tail = _prune_inputs(tail)
    return head, tail


def _prune_inputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """Drop graph inputs no node reads (the extractor keeps every input it was given)."""
    used = {i for node in model.graph.node for i in node.input} | {o.name for o in model.graph.output}
    keep = [i for i in model.graph.input if i.name in used]
    if len(keep) != len(model.graph.input):
        del model.graph.input[:]
        model.graph.input.extend(keep)
    return model


def save(model: onnx.ModelProto, path: Path) -> Path:
    import onnx

    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def describe(cuts: Sequence[CutPoint]) -> list[str]:
    return [f"{c.id}: {', '.join(c.tensors)} (after {c.position}/{c.nodes} nodes)" for c in cuts]
