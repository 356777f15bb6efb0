"""What the ``apple`` path adds to coremltools' torch frontend, and how it reports what it cannot take.

onnx2torch writes every two-input ``Min`` / ``Max`` as ``broadcast_to`` + ``stack`` + ``amin`` /
``amax`` (``OnnxMinMax``), and coremltools 9 has a converter for ``aten::expand`` but none for
``aten::broadcast_to``: Keras exports with an elementwise ``Max(x, constant)`` failed with
"PyTorch convert function for op 'broadcast_to' not implemented". ``broadcast_to(x, shape)`` is
``expand(x, shape)`` (the same broadcasting rule, no ``-1`` entries), so it is registered as
coremltools' own ``expand`` converter.

onnx2torch runs a PRelu whose slope is not per channel on axis 1 (Keras' NHWC slope ``[1, 1, C]``)
as a boolean-mask assignment, which coremltools converts to ``non_zero`` / ``gather_nd`` /
``scatter_nd``: shapes that depend on the data, which the Neural Engine does not run.
``prelu_as_relu`` writes such a PRelu as ``Relu(x) + slope * (x - Relu(x))`` first (exact: ``x -
Relu(x)`` is ``min(x, 0)``); a per-channel PRelu stays (it converts to Core ML's own ``prelu``).

A torch op coremltools has no converter for ends the conversion with a ``NotImplementedError``
whose message names the torch op only; ``converter_refusal`` turns it into one line that also
names the ONNX node the op came from (onnx2torch names each module after its ONNX node).

``convert_module`` converts the onnx2torch module by ``torch.jit.trace`` first (what every build
used before, unchanged where it works) and, where tracing raises or coremltools refuses the traced
graph, by ``torch.export`` lowered to the core ATen op set (``run_decompositions()`` with PyTorch's
default table), which coremltools 8+ converts as an ``ExportedProgram``. The two graphs differ:
onnx2torch writes ONNX ``Greater`` / ``Less`` / ``GreaterOrEqual`` / ``LessOrEqual`` as
``torch.greater`` etc., which TorchScript records as ``aten::greater`` (coremltools 9 has converters for
``gt`` / ``lt`` / ``ge`` / ``le`` only) and which export's decompositions write as ``aten.gt`` and its
kin; ``Celu`` likewise becomes ``expm1`` / ``where``. Where both fail the refusal is one line with
both paths' reasons.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.errors import UnsupportedOpError

_MISSING_OP = re.compile(r"convert function for op '([^']+)' not implemented")
_MISSING_FX_NODE = re.compile(r"Unsupported fx node (\S+), kind (\S+)")  # coremltools' ExportedProgram frontend
TRACE, EXPORT = "torch.jit.trace", "torch.export"
_REFUSAL_TAIL = "the other targets are not affected: drop apple from --target"


@dataclass(frozen=True)
class Conversion:
    """An ML program and the path that built it (``TRACE`` or ``EXPORT``); ``trace_failure``: why the
    traced path did not (one line, ``EXPORT`` only)."""

    model: Any
    path: str
    trace_failure: str = ""


@dataclass(frozen=True)
class _Failure:
    """Why one path did not build the program: one line, and the torch op coremltools has no converter
    for with the ONNX nodes it came from, where that was the reason."""

    reason: str
    op: str | None = None
    nodes: tuple[str, ...] = ()


def convert_module(
    torch: Any, module: Any, example: tuple[Any, ...], convert: Callable[[Any], Any], version: str, source: Path | None
) -> Conversion:
    """``module`` converted by ``convert`` (``ct.convert`` with the build's inputs and outputs): traced
    first, exported where tracing raises or coremltools refuses the traced graph; where both fail,
    an ``UnsupportedOpError`` of one line naming the op (if one was missing) and both paths' reasons."""
    register_torch_ops()
    try:
        with torch.no_grad():
            traced = torch.jit.trace(module, example, check_trace=False)
    # onnx2torch modules run Python on the example (``.item()``, ``.tolist()``); any error means no graph
    except Exception as exc:
        traced_failure = _Failure(f"tracing failed ({_first_line(exc)})")
    else:
        try:
            return Conversion(convert(traced), TRACE)
        # coremltools raises NotImplementedError for a missing converter and ValueError / RuntimeError /
        # AssertionError / TypeError from converters that do not take a graph: all are tried on export
        except Exception as exc:
            traced_failure = _traced_failure(exc, traced, source)
    try:
        exported = torch.export.export(module, example).run_decompositions()
    except Exception as exc:
        exported_failure = _Failure(f"export failed ({_first_line(exc)})")
    else:
        try:
            return Conversion(convert(exported), EXPORT, traced_failure.reason)
        except Exception as exc:
            exported_failure = _exported_failure(exc, exported, source)
    raise _both_failed(traced_failure, exported_failure, version) from None


def _traced_failure(exc: BaseException, traced: Any, source: Path | None) -> _Failure:
    found = _MISSING_OP.search(str(exc))
    if found is None:
        return _Failure(f"coremltools failed ({_first_line(exc)})")
    op = found.group(1)
    modules = {  # the top-level module the op ran in: onnx2torch's module for one ONNX node
        node.scopeName().removeprefix("__module.").split("/__module.")[0]
        for node in traced.inlined_graph.nodes()
        if node.kind().split("::")[-1] == op and node.scopeName()
    }
    return _Failure(f"no converter for '{op}'", op, _onnx_nodes(modules, source))


def _exported_failure(exc: BaseException, exported: Any, source: Path | None) -> _Failure:
    found = _MISSING_FX_NODE.search(str(exc))
    if found is None:
        found = _MISSING_OP.search(str(exc))
        if found is None:
            return _Failure(f"coremltools failed ({_first_line(exc)})")
        return _Failure(f"no converter for '{found.group(1)}'", found.group(1))
    name, kind = found.groups()
    nodes = [n for n in exported.graph.nodes if n.name == name]
    target = nodes[0].target if nodes else None
    op = str(getattr(target, "_opname", kind.split(".")[0]))
    stack = nodes[0].meta.get("nn_module_stack", {}) if nodes else {}
    # the first named entry is the root's child: onnx2torch's module for one ONNX node
    modules = {next((path for path, _ in stack.values() if path), "")} - {""}
    return _Failure(f"no converter for '{target or kind}'", op, _onnx_nodes(modules, source))


def _onnx_nodes(modules: set[str], source: Path | None) -> tuple[str, ...]:
    onnx_nodes = _nodes_by_module(source) if source is not None else {}
    return tuple(sorted(onnx_nodes.get(m, m) for m in modules))


def _both_failed(traced: _Failure, exported: _Failure, version: str) -> UnsupportedOpError:
    why = f"{TRACE}: {traced.reason}; {EXPORT}: {exported.reason}"
    named = traced if traced.op is not None else exported
    if named.op is None:
        return UnsupportedOpError(
            f"apple: coremltools {version} could not convert the torch graph onnx2torch wrote for this model "
            f"({why}); {_REFUSAL_TAIL}"
        )
    return UnsupportedOpError(
        f"apple: coremltools {version} has no converter for the torch op '{named.op}'{_where(named.nodes)} that "
        f"onnx2torch wrote for this model ({why}); {_REFUSAL_TAIL}, or replace that op in the model"
    )


def _where(nodes: tuple[str, ...]) -> str:
    return f" (from ONNX node {', '.join(nodes[:5])}{', ...' if len(nodes) > 5 else ''})" if nodes else ""


def _first_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split("\n")[0].split())
    text = text if len(text) <= 200 else text[:197] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def register_torch_ops() -> None:
    """Register ``broadcast_to`` with coremltools' torch frontend, once (no-op if it has one)."""
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY, register_torch_op

    if _TORCH_OPS_REGISTRY.get_func("broadcast_to") is not None:
        return
    expand = _TORCH_OPS_REGISTRY.get_func("expand")

    def broadcast_to(context: Any, node: Any) -> None:
        expand(context, node)

    register_torch_op(broadcast_to)


def prelu_as_relu(src: Path, dst: Path) -> tuple[Path, int]:
    """(the graph to convert, how many PRelu were rewritten): ``src`` itself when none was, else
    ``dst`` with each PRelu onnx2torch would run as a mask written as Relu / Sub / Mul / Add."""
    import onnx
    from onnx import helper, numpy_helper

    model = onnx.load(str(src))
    graph = model.graph
    consts = {t.name: numpy_helper.to_array(t) for t in graph.initializer}
    shapes = {
        v.name: [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
        for v in (*onnx.shape_inference.infer_shapes(model).graph.value_info, *graph.input)
    }
    nodes: list[Any] = []
    rewritten = 0
    for node in graph.node:
        if node.op_type != "PRelu" or not _masked_prelu(shapes.get(node.input[0]), consts.get(node.input[1])):
            nodes.append(node)
            continue
        x, slope, y = node.input[0], node.input[1], node.output[0]
        base = node.name or y
        relu, neg, scaled = f"{base}/relu", f"{base}/negative_part", f"{base}/scaled"
        nodes += [
            helper.make_node("Relu", [x], [relu], name=relu),
            helper.make_node("Sub", [x, relu], [neg], name=neg),
            helper.make_node("Mul", [neg, slope], [scaled], name=scaled),
            helper.make_node("Add", [relu, scaled], [y], name=base),
        ]
        rewritten += 1
    if not rewritten:
        return src, 0
    del graph.node[:]
    graph.node.extend(nodes)
    onnx.save(model, str(dst))
    return dst, rewritten


def _masked_prelu(shape: list[int] | None, slope: Any) -> bool:
    """Whether onnx2torch's PRelu takes its mask path (``OnnxPReLU``: not a single slope, and not
    one slope per channel of axis 1); an unknown shape or a computed slope counts as masked."""
    if slope is None or shape is None or len(shape) < 2:
        return True
    if slope.size == 1:
        return False
    return not (slope.ndim >= 1 and slope.shape[0] == shape[1] and all(d == 1 for d in slope.shape[1:]))


def converter_refusal(
    exc: BaseException, traced: Any, version: str, source: Path | None = None
) -> UnsupportedOpError | None:
    """The one-line error for a torch op coremltools cannot convert in the traced graph ``traced``, or
    ``None`` for any other failure; ``source``: the ONNX graph onnx2torch converted, to name the nodes
    the op came from."""
    failure = _traced_failure(exc, traced, source)
    if failure.op is None:
        return None
    return UnsupportedOpError(
        f"apple: coremltools {version} has no converter for the torch op '{failure.op}'{_where(failure.nodes)} "
        f"that onnx2torch wrote for this model; {_REFUSAL_TAIL}, or replace that op in the model"
    )


def _nodes_by_module(source: Path) -> dict[str, str]:
    """onnx2torch's module name (``OnnxGraph.generate_node_name``: dots as slashes, no leading slash)
    -> ``"<op_type> <ONNX node name>"``."""
    import onnx

    found: dict[str, str] = {}
    for node in onnx.load(str(source), load_external_data=False).graph.node:
        module = (f"{node.domain}/" + (node.name.replace(".", "/") or node.op_type)).lstrip("/")
        found.setdefault(module, f"{node.name or node.output[0]} ({node.op_type})")
    return found


__all__ = [
    "EXPORT",
    "TRACE",
    "Conversion",
    "convert_module",
    "converter_refusal",
    "prelu_as_relu",
    "register_torch_ops",
]
