"""Freeze an ONNX graph for converters that need static shapes: fix the input shapes, fold
constants and simplify the graph (onnxslim), give every node a TensorFlow-valid scope name, and
check the result numerically against the graph it came from.

Why: onnx2tf failed on a YOLOv8 graph
exported with dynamic H/W (``slice index 3 of dimension 0 out of bounds`` in a Shape->Slice chain)
and onnx2torch failed on a real classifier until its shapes were fixed and constants folded;
Ultralytics' own TFLite path fixes shapes and simplifies first. With static inputs, onnxslim folds
the Shape->Gather->Range chains that compute anchors and reshape targets into constants, so the
converters see a plain static graph. onnxslim names some nodes ``Softmax@0``, which TensorFlow
refuses as scope names, hence the renaming after it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import CompressionStep
from edgekit.errors import MissingSDKError, ModelFormatError

# The frozen graph computes the same function: anything below this is an onnxslim bug, not rounding.
MIN_FROZEN_COSINE = 0.9999
_INVALID_SCOPE_CHARS = re.compile(r"[^A-Za-z0-9_.\\/>-]")
_SHAPE_OPS = frozenset({"Shape", "Size", "ConstantOfShape", "Range", "NonZero"})


@dataclass(frozen=True)
class FrozenGraph:
    """A frozen copy of a model and what freezing did (``steps`` go into the manifest provenance)."""

    path: Path
    static_shapes: dict[str, tuple[int, ...]]
    nodes_before: int
    nodes_after: int
    shape_ops_left: int  # Shape/Range/... nodes still computing shapes at run time after folding
    renamed_nodes: int  # node names changed to valid TensorFlow scope names
    min_cosine: float | None  # worst output cosine, frozen vs source graph on the check sample
    tool: str = "onnxslim"  # the simplifier and its version, e.g. "onnxslim 0.1.98"
    erf_as_tanh: int = 0  # Erf nodes rewritten in their tanh form (``erf_as_tanh``)
    explicit_pads: int = 0  # nodes whose auto_pad SAME_* became explicit pads (``explicit_pads``)

    @property
    def steps(self) -> tuple[str, ...]:
        shapes = ", ".join(f"{n}={'x'.join(map(str, s))}" for n, s in self.static_shapes.items())
        out = [
            f"static input shapes {shapes}",
            f"onnxslim constant folding and simplification: {self.nodes_before} -> {self.nodes_after} nodes"
            + (f", {self.shape_ops_left} shape op(s) left" if self.shape_ops_left else ""),
        ]
        if self.renamed_nodes:
            out.append(f"{self.renamed_nodes} node name(s) made valid TensorFlow scope names")
        if self.erf_as_tanh:
            out.append(f"{self.erf_as_tanh} Erf node(s) (GELU) in their tanh form: {ERF_TANH_FORM}")
        if self.explicit_pads:
            out.append(f"{self.explicit_pads} node(s) with auto_pad SAME_* given explicit pads (static shapes)")
        if self.min_cosine is not None:
            out.append(f"frozen graph vs source on a calibration sample: worst output cosine {self.min_cosine:.6f}")
        return tuple(out)

    def provenance(self) -> tuple[CompressionStep, ...]:
        """The manifest's provenance steps for freezing, in order."""
        shapes = {n: "x".join(map(str, s)) for n, s in self.static_shapes.items()}
        steps = [
            CompressionStep(kind="fix_shapes", tool="edgekit", settings=shapes),
            CompressionStep(
                kind="simplify",
                tool=self.tool,
                settings={
                    "constant_folding": "true",
                    "nodes_before": str(self.nodes_before),
                    "nodes_after": str(self.nodes_after),
                    "shape_ops_left": str(self.shape_ops_left),
                },
                metric="worst output cosine vs the graph before freezing" if self.min_cosine is not None else "",
                after=self.min_cosine,
            ),
        ]
        if self.erf_as_tanh:
            steps.append(
                CompressionStep(
                    kind="rewrite_ops",
                    tool="edgekit",
                    settings={"Erf": str(self.erf_as_tanh)},
                    notes=f"Erf in its tanh form ({ERF_TANH_FORM}): TFLite has no Erf builtin",
                )
            )
        if self.explicit_pads:
            steps.append(
                CompressionStep(
                    kind="rewrite_ops",
                    tool="edgekit",
                    settings={"auto_pad": str(self.explicit_pads)},
                    notes="auto_pad SAME_UPPER / SAME_LOWER as explicit pads, computed from the static shapes",
                )
            )
        if self.renamed_nodes:
            steps.append(
                CompressionStep(
                    kind="rename_nodes",
                    tool="edgekit",
                    settings={"renamed": str(self.renamed_nodes)},
                    notes="node names made valid TensorFlow scope names",
                )
            )
        return tuple(steps)


def scope_name(name: str, index: int, taken: set[str]) -> str:
    """A TensorFlow-valid, unique version of an ONNX node name."""
    clean = _INVALID_SCOPE_CHARS.sub("_", name) or f"node_{index}"
    if not (clean[0].isalnum() or clean[0] == "."):
        clean = f"n{clean}"
    candidate, n = clean, 1
    while candidate in taken:
        candidate, n = f"{clean}_{n}", n + 1
    taken.add(candidate)
    return candidate


def freeze_graph(
    src: Path,
    dst: Path,
    static_shapes: Mapping[str, tuple[int, ...]],
    *,
    check: Mapping[str, np.ndarray] | None = None,
    input_names: Mapping[str, str] | None = None,
    tf_scope_names: bool = False,
    erf_tanh: bool = False,
    pads: bool = False,
) -> FrozenGraph:
    """Write to ``dst`` a copy of ``src`` with inputs fixed to ``static_shapes``, constants folded,
    node names made valid TensorFlow scope names (``tf_scope_names``) and inputs renamed per
    ``input_names`` (served -> new name).

    ``erf_tanh``: every Erf node rewritten in its tanh form (``erf_as_tanh``), for converters
    without an Erf kernel (TFLite: a BERT-class encoder's GELU). ``pads``: every auto_pad SAME_*
    made explicit pads (``explicit_pads``), for converters without it (onnx2torch, on Keras exports).

    ``check``: one input batch of the static shapes; the frozen graph's outputs on it must match
    the source graph's (``MIN_FROZEN_COSINE``), else ``ModelFormatError``.
    """
    import onnx

    try:
        import onnxslim
    except ImportError as exc:
        raise MissingSDKError("onnxslim", "host", "freezing the graph before conversion") from exc
    model = onnx.load(str(src))
    before = len(model.graph.node)
    _fix_inputs(model, static_shapes)
    shapes = [f"{name}:{','.join(str(d) for d in shape)}" for name, shape in static_shapes.items()]
    try:
        model = onnxslim.slim(model, input_shapes=shapes or None)
    except Exception as exc:  # onnxslim raises whatever its passes raise; it is a named conversion step
        raise ModelFormatError(f"onnxslim {onnxslim.__version__} could not simplify the model: {exc}") from exc
    if model is None:  # onnxslim returns None when it gives up (it logs why)
        raise ModelFormatError(f"onnxslim {onnxslim.__version__} could not simplify the model (see its log)")
    graph = model.graph
    taken: set[str] = set()
    renamed = 0
    for i, node in enumerate(graph.node if tf_scope_names else ()):
        new = scope_name(node.name, i, taken)
        renamed += new != node.name
        node.name = new
    rename = dict(input_names or {})
    if rename:
        for vi in graph.input:
            vi.name = rename.get(vi.name, vi.name)
        for node in graph.node:
            node.input[:] = [rename.get(i, i) for i in node.input]
    erf = erf_as_tanh(model) if erf_tanh else 0
    model = onnx.shape_inference.infer_shapes(model)
    padded = explicit_pads(model) if pads else 0
    onnx.save(model, str(dst))
    cosine = None
    if check is not None:
        cosine = _compare(src, dst, check, rename)
        if cosine < MIN_FROZEN_COSINE:
            raise ModelFormatError(
                f"the frozen graph (static shapes, onnxslim {onnxslim.__version__}) differs from the model "
                f"(worst output cosine {cosine:.5f} < {MIN_FROZEN_COSINE}); report the model to onnxslim"
            )
    return FrozenGraph(
        path=dst,
        static_shapes={k: tuple(int(d) for d in v) for k, v in static_shapes.items()},
        nodes_before=before,
        nodes_after=len(graph.node),
        shape_ops_left=sum(1 for n in graph.node if n.op_type in _SHAPE_OPS),
        renamed_nodes=renamed,
        min_cosine=cosine,
        tool=f"onnxslim {onnxslim.__version__}",
        erf_as_tanh=erf,
        explicit_pads=padded,
    )


_PADDED_OPS = frozenset({"Conv", "MaxPool", "AveragePool", "LpPool"})


def explicit_pads(model: Any) -> int:
    """Replace ``auto_pad`` SAME_UPPER / SAME_LOWER of Conv and pooling nodes of ``model`` (an
    ``onnx.ModelProto`` with inferred static shapes, in place) by the ``pads`` it stands for:
    per spatial axis, output ceil(in / stride), total padding max((out - 1) stride + (k - 1)
    dilation + 1 - in, 0), the odd one at the end (UPPER) or the beginning (LOWER). A node whose
    input shape is not static keeps its auto_pad. Returns how many nodes changed."""
    from onnx import helper

    graph = model.graph
    shapes: dict[str, list[int | None]] = {}
    for vi in (*graph.input, *graph.value_info, *graph.output):
        dims = vi.type.tensor_type.shape.dim
        shapes[vi.name] = [d.dim_value if d.HasField("dim_value") else None for d in dims]
    weights = {t.name: list(t.dims) for t in graph.initializer}
    changed = 0
    for node in graph.node:
        if node.op_type not in _PADDED_OPS or node.domain not in ("", "ai.onnx"):
            continue
        attrs = {a.name: a for a in node.attribute}
        mode = attrs["auto_pad"].s.decode() if "auto_pad" in attrs else "NOTSET"
        if mode not in ("SAME_UPPER", "SAME_LOWER"):
            continue
        shape = shapes.get(node.input[0])
        kernel = list(attrs["kernel_shape"].ints) if "kernel_shape" in attrs else weights.get(node.input[1], [])[2:]
        if not shape or len(shape) < 3 or any(d is None for d in shape[2:]) or len(kernel) != len(shape) - 2:
            continue
        spatial = [int(d) for d in shape[2:] if d is not None]
        strides = list(attrs["strides"].ints) if "strides" in attrs else [1] * len(spatial)
        dilations = list(attrs["dilations"].ints) if "dilations" in attrs else [1] * len(spatial)
        begins, ends = [], []
        for size, k, stride, dilation in zip(spatial, kernel, strides, dilations, strict=True):
            out = -(-size // stride)
            total = max((out - 1) * stride + (k - 1) * dilation + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begins.append(small if mode == "SAME_UPPER" else large)
            ends.append(large if mode == "SAME_UPPER" else small)
        kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("pads", begins + ends)])
        changed += 1
    return changed


# erf(z) from the tanh form of GELU, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), at x = sqrt(2) z:
# within 4e-4 of erf everywhere (the GELU approximation's error), built from ops every converter has
ERF_TANH_Z = 1.1283791670955126  # 2 / sqrt(pi)
ERF_TANH_Z3 = 0.1009107  # 2 / sqrt(pi) * 0.044715 * 2
ERF_TANH_FORM = f"erf(z) = tanh({ERF_TANH_Z:.6f} z + {ERF_TANH_Z3:.6f} z^3)"


def erf_as_tanh(model: Any) -> int:
    """Rewrite every Erf node of ``model`` (an ``onnx.ModelProto``, in place) as
    ``tanh(z * (a + b z^2))`` (``ERF_TANH_FORM``); returns how many."""
    from onnx import TensorProto, helper

    graph = model.graph
    nodes = list(graph.node)
    count = 0
    new_nodes = []
    consts_added = False
    for node in nodes:
        if node.op_type != "Erf" or node.domain not in ("", "ai.onnx"):
            new_nodes.append(node)
            continue
        count += 1
        z, out, tag = node.input[0], node.output[0], f"erf_tanh_{count}"
        new_nodes += [
            helper.make_node("Mul", [z, z], [f"{tag}_z2"], name=f"{tag}_square"),
            helper.make_node("Mul", [f"{tag}_z2", "erf_tanh_b"], [f"{tag}_bz2"], name=f"{tag}_cubic"),
            helper.make_node("Add", [f"{tag}_bz2", "erf_tanh_a"], [f"{tag}_k"], name=f"{tag}_slope"),
            helper.make_node("Mul", [z, f"{tag}_k"], [f"{tag}_arg"], name=f"{tag}_arg"),
            helper.make_node("Tanh", [f"{tag}_arg"], [out], name=f"{tag}_tanh"),
        ]
        if not consts_added:
            graph.initializer.extend(
                [
                    helper.make_tensor("erf_tanh_a", TensorProto.FLOAT, [], [ERF_TANH_Z]),
                    helper.make_tensor("erf_tanh_b", TensorProto.FLOAT, [], [ERF_TANH_Z3]),
                ]
            )
            consts_added = True
    if count:
        del graph.node[:]
        graph.node.extend(new_nodes)
    return count


def _fix_inputs(model: Any, static_shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Inputs get the static dims; every other declared dynamic dim is dropped (re-inferred)."""
    graph = model.graph
    for vi in graph.input:
        shape = static_shapes.get(vi.name)
        if shape is None:
            continue
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise ModelFormatError(
                f"input {vi.name!r}: static shape {list(shape)} has rank {len(shape)}, not {len(dims)}"
            )
        for dim, size in zip(dims, shape, strict=True):
            dim.ClearField("dim_param")
            dim.dim_value = int(size)
    for vi in (*graph.output, *graph.value_info):
        for dim in vi.type.tensor_type.shape.dim:
            if dim.HasField("dim_param"):
                dim.ClearField("dim_param")
    del graph.value_info[:]


def _compare(src: Path, dst: Path, feed: Mapping[str, np.ndarray], rename: Mapping[str, str]) -> float:
    import onnxruntime as ort

    def run(path: Path, inputs: Mapping[str, np.ndarray]) -> list[np.ndarray]:
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        return list(session.run(None, dict(inputs)))

    want = run(src, feed)
    got = run(dst, {rename.get(k, k): v for k, v in feed.items()})
    return min((_cosine(a, b) for a, b in zip(want, got, strict=True)), default=1.0)


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a64, b64 = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    if a64.shape != b64.shape:
        return 0.0
    denom = float(np.linalg.norm(a64) * np.linalg.norm(b64))
    return float(a64 @ b64 / denom) if denom > 0 else float(np.array_equal(a64, b64))


__all__ = ["MIN_FROZEN_COSINE", "FrozenGraph", "freeze_graph", "scope_name"]
