"""Small readers of an ONNX graph that several passes share (kept apart so that no pass imports
another for them)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any


def constant_nodes(graph: Any) -> Iterator[tuple[Any, Any]]:
    """``(node, tensor)`` for each ``Constant`` node of ``graph`` whose one attribute is a tensor
    ``value`` (the ``TensorProto``, not a copy: changing it changes the node)."""
    for node in graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            yield node, node.attribute[0].t
