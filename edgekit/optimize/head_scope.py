"""A detector's or segmenter's head decode kept in float: the nodes, and the candidate that does it.

INT8 of a YOLO-style detector most often fails in its decode, not its convolutions: the class
scores' Sigmoid, the DFL's Softmax and the box arithmetic (anchor offsets, strides) share one
scale with values that span orders of magnitude. Ultralytics exports YOLO for OpenVINO INT8 with
NNCF's ``IgnoredScope`` over the Detect head's decode (its ``Add`` / ``Sub`` / ``Mul`` / ``Div``,
the ``dfl`` and ``Sigmoid``); ``head_scope`` finds the same nodes on any ONNX graph, without
relying on module names, and ``head_in_float`` makes a candidate of an INT8 candidate that can
keep layers in float (``Candidate.exclude``) with them kept in float.

The walk goes back from each head output through decode ops (``DECODE_OPS``) and stops at the
last compute layers (Conv, ConvTranspose, MatMul, Gemm) and anything else (pooling, Resize,
shape arithmetic). Reshape, Slice, Split and the like are followed along their data input only,
so the run-time shape sub-graphs that feed their shape inputs are left alone. The one compute layer
taken in is the DFL projection: a 1x1 Conv to one channel whose weights are ``0, 1, ..., R-1``
(the expected value of the Softmax over ``R`` box bins), fixed arithmetic rather than a learned layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.optimize.candidates import Candidate

# followed along every input
ELEMENTWISE = frozenset({"Sigmoid", "Softmax", "Mul", "Add", "Sub", "Div", "Concat", "Exp", "Pow", "Identity"})
# followed along their data input (input 0) only: the others are shapes, indices, axes
DATA_ONLY = frozenset({"Reshape", "Transpose", "Split", "Slice", "Unsqueeze", "Squeeze", "Flatten"})
DECODE_OPS = ELEMENTWISE | DATA_ONLY
# at most this share of the graph's nodes may be a head's decode: more is not a head any more
MAX_SHARE = 0.25


@dataclass(frozen=True)
class HeadScope:
    """``nodes``: the decode node names in graph order (empty: none kept, ``why`` says why);
    ``what``: the head's task (``detect``, ``segment``, ``detect+segment``) for the report."""

    nodes: tuple[str, ...]
    what: str
    why: str


def head_scope(model: Any, heads: Mapping[str, str]) -> HeadScope:
    """The decode nodes of the head outputs ``heads`` (output name -> task, e.g.
    ``{"output0": "detect:yolo"}``) of ``model`` (an ONNX path or ``ModelProto``), bounded by
    ``MAX_SHARE`` of the graph's nodes."""
    import onnx

    graph = (onnx.load(str(model)) if isinstance(model, (str, Path)) else model).graph
    what = _what(heads)
    producer = {o: n for n in graph.node for o in n.output if o}
    weights = _constants(graph)
    found: set[str] = set()
    nameless = 0
    for output in heads:
        named, unnamed = _walk(producer.get(output), producer, weights)
        found, nameless = found | named, nameless + unnamed
    if nameless:  # part of the decode would stay quantized: not the recipe this candidate stands for
        return HeadScope(
            (), what, f"{nameless} decode node(s) of the {what} head have no name, and nodes are kept in float by name"
        )
    if not found:
        return HeadScope((), what, f"no decode ops between the {what} outputs and their last compute layers")
    bound = int(MAX_SHARE * len(graph.node))
    if len(found) > bound:
        return HeadScope(
            (),
            what,
            f"{len(found)} nodes between the {what} outputs and their last compute layers, more than "
            f"{MAX_SHARE:.0%} of the graph's {len(graph.node)}: not a head's decode",
        )
    nodes = tuple(n.name for n in graph.node if n.name in found)
    return HeadScope(nodes, what, f"{len(nodes)} decode nodes of the {what} head kept in float")


def head_in_float(cand: Candidate, scope: HeadScope, also: Sequence[str] = ()) -> Candidate:
    """``cand`` rebuilt with ``scope``'s nodes (and ``also``) kept in float, named for the report.
    Its own ``exclude`` (mixed precision on top of it) keeps the head in float too."""
    if cand.exclude is None or not scope.nodes:
        raise ValueError(f"{cand.name}: cannot keep a head in float (no node exclusion, or no head nodes)")
    kept = tuple(dict.fromkeys((*scope.nodes, *also)))
    inner = cand.exclude(kept)
    more = len(kept) - len(scope.nodes)
    name = f"{cand.name}, {scope.what} head in float" + (f" + {more} layer(s)" if more else "")
    return replace(
        inner,
        name=name,
        settings={**inner.settings, "head_in_float": list(scope.nodes)},
        exclude=lambda nodes: head_in_float(cand, scope, nodes),
    )


def _what(heads: Mapping[str, str]) -> str:
    from edgekit.validate.heads import base_task

    return "+".join(sorted({base_task(t) for t in heads.values()})) or "head"


def _walk(start: Any, producer: Mapping[str, Any], weights: Mapping[str, np.ndarray]) -> tuple[set[str], int]:
    """(named decode nodes, how many decode nodes had no name) from ``start`` back."""
    found: set[str] = set()
    seen: set[int] = set()
    nameless = 0
    todo = [start] if start is not None else []
    while todo:
        node = todo.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.op_type in ELEMENTWISE:
            inputs = list(node.input)
        elif node.op_type in DATA_ONLY or _is_dfl(node, weights):
            inputs = list(node.input[:1])
        else:
            continue  # a compute layer or another op: the head's decode stops here
        if node.name:
            found.add(node.name)
        else:
            nameless += 1  # ORT's nodes_to_exclude and NNCF's scope go by name: it cannot be kept in float
        todo.extend(producer[i] for i in inputs if i in producer)
    return found, nameless


def _is_dfl(node: Any, weights: Mapping[str, np.ndarray]) -> bool:
    """A 1x1 Conv to one channel whose weights are 0, 1, ..., R-1: the DFL projection."""
    if node.op_type != "Conv" or len(node.input) < 2 or node.input[1] not in weights:
        return False
    w = weights[node.input[1]]
    if w.ndim != 4 or w.shape[0] != 1 or w.shape[2:] != (1, 1) or w.shape[1] < 2:
        return False
    bias = weights.get(node.input[2]) if len(node.input) > 2 and node.input[2] else None
    if bias is not None and np.any(bias != 0):
        return False
    return bool(np.array_equal(w.reshape(-1), np.arange(w.shape[1], dtype=w.dtype)))


def _constants(graph: Any) -> dict[str, np.ndarray]:
    """Initializers and Constant-node values (small ones: the DFL's weights are a handful)."""
    from onnx import numpy_helper

    from edgekit.compress.onnx_nodes import constant_nodes

    out = {t.name: numpy_helper.to_array(t) for t in graph.initializer if _small(t.dims)}
    out.update((n.output[0], numpy_helper.to_array(t)) for n, t in constant_nodes(graph) if _small(t.dims))
    return out


def _small(dims: Sequence[int]) -> bool:
    return int(np.prod(dims)) <= 4096 if len(dims) else True


def head_offer(
    cand: Candidate | None, graph: Path, heads: Mapping[str, str]
) -> tuple[tuple[Candidate, ...], tuple[tuple[str, str], ...]]:
    """What a target adds to its first wave for the head outputs ``heads`` (``BuildContext.heads``):
    ``cand`` (an INT8 candidate that can keep layers in float, or None where none of the target's
    can) with the head's decode of ``graph`` (the graph ``cand`` quantizes) in float, or the
    record of why not. Nothing where there is no head."""
    if not heads:
        return (), ()
    what = _what(heads)
    if cand is None or cand.exclude is None:
        return (), ((f"int8, {what} head in float", "no int8 candidate of this target keeps layers in float"),)
    scope = head_scope(graph, heads)
    if not scope.nodes:
        return (), ((f"{cand.name}, {what} head in float", scope.why),)
    return (head_in_float(cand, scope),), ()


# -- the same walk on a float TFLite graph (the coral target quantizes onnx2tf's conversion) -------
# ONNX node names do not survive onnx2tf, and the MLIR quantizer keeps ops in float by their first
# output tensor's name (``tflite_quant.QuantVariant.denylisted``): the walk is done again on the
# TFLite graph, with TFLite's builtin op names. Followed along every input that an op computes
# (constant operands, the anchors and strides, are not ops):
TFLITE_ELEMENTWISE = frozenset({"LOGISTIC", "SOFTMAX", "MUL", "ADD", "SUB", "DIV", "CONCATENATION", "EXP", "POW"})
# followed along their data input only (the index of that input); the others are shapes, axes, indices
TFLITE_DATA_ONLY: Mapping[str, int] = {
    "RESHAPE": 0,
    "TRANSPOSE": 0,
    "SPLIT": 1,  # SPLIT(axis, input)
    "SPLIT_V": 0,
    "SLICE": 0,
    "STRIDED_SLICE": 0,
    "SQUEEZE": 0,
    "EXPAND_DIMS": 0,
    "GATHER": 0,
}


def tflite_head_scope(model: bytes, outputs: Sequence[str], heads: Mapping[str, str]) -> HeadScope:
    """The decode ops of a float TFLite ``model`` between its signature outputs ``outputs`` (the
    head outputs, e.g. onnx2tf's names for the served ``heads``) and their last compute layers:
    ``HeadScope.nodes`` are the ops' first output tensor names in execution order (what the MLIR
    quantizer's ``denylisted_nodes`` takes), bounded by ``MAX_SHARE`` of the graph's ops. Stops at
    CONV_2D, DEPTHWISE_CONV_2D, FULLY_CONNECTED, pooling, resizing and every op not listed above;
    takes in the DFL projection (a CONV_2D to one channel whose weights are 0, 1, ..., R-1)."""
    from ai_edge_litert.interpreter import Interpreter, OpResolverType

    what = _what(heads)
    it = Interpreter(
        model_content=model, experimental_op_resolver_type=OpResolverType.BUILTIN_WITHOUT_DEFAULT_DELEGATES
    )
    it.allocate_tensors()  # constants (the DFL's weights) are readable once allocated
    details = it.get_signature_runner().get_output_details()
    missing = [o for o in outputs if o not in details]
    if missing:
        raise ValueError(f"no output {missing[0]!r} in the TFLite signature (outputs: {', '.join(details)})")
    ops = it._get_ops_details()  # the interpreter's only op listing (private API), in execution order
    producer = {int(t): op for op in ops for t in op["outputs"]}
    found: set[int] = set()
    todo = [producer[int(details[o]["index"])] for o in outputs if int(details[o]["index"]) in producer]
    while todo:
        op = todo.pop()
        if op["index"] in found:
            continue
        kind, ins = str(op["op_name"]), [int(i) for i in op["inputs"]]
        if kind in TFLITE_ELEMENTWISE:
            follow = ins
        elif kind in TFLITE_DATA_ONLY:
            follow = ins[TFLITE_DATA_ONLY[kind] : TFLITE_DATA_ONLY[kind] + 1]
        elif _is_tflite_dfl(it, kind, ins):
            follow = ins[:1]
        else:
            continue  # a compute layer or another op: the head's decode stops here
        found.add(op["index"])
        todo.extend(producer[i] for i in follow if i in producer)
    if not found:
        return HeadScope((), what, f"no decode ops between the {what} outputs and their last compute layers")
    bound = int(MAX_SHARE * len(ops))
    if len(found) > bound:
        return HeadScope(
            (),
            what,
            f"{len(found)} ops between the {what} outputs and their last compute layers, more than "
            f"{MAX_SHARE:.0%} of the graph's {len(ops)}: not a head's decode",
        )
    names = tuple(str(it._get_tensor_details(int(op["outputs"][0]), 0)["name"]) for op in ops if op["index"] in found)
    return HeadScope(names, what, f"{len(names)} decode ops of the {what} head kept in float")


def _is_tflite_dfl(it: Any, kind: str, ins: Sequence[int]) -> bool:
    """A CONV_2D to one channel (filter [1, 1, 1, R]) whose weights are 0, 1, ..., R-1, no bias."""
    if kind != "CONV_2D" or len(ins) < 2 or ins[1] < 0:
        return False
    try:
        w = np.asarray(it.get_tensor(ins[1]))
        bias = np.asarray(it.get_tensor(ins[2])) if len(ins) > 2 and ins[2] >= 0 else None
    except ValueError:  # not a constant with data
        return False
    if w.ndim != 4 or w.shape[:3] != (1, 1, 1) or w.shape[3] < 2 or (bias is not None and np.any(bias != 0)):
        return False
    return bool(np.array_equal(w.reshape(-1), np.arange(w.shape[3], dtype=w.dtype)))
