"""What the ``apple`` path adds to coremltools' torch frontend, and how it reports what it cannot take.

onnx2torch writes every two-input ``Min`` / ``Max`` as ``broadcast_to`` + ``stack`` + ``amin`` /
``amax`` (``OnnxMinMax``), and coremltools 9 has a converter for ``aten::expand`` but none for
``aten::broadcast_to``: Keras exports with an elementwise ``Max(x, constant)`` failed with
"PyTorch convert function for op 'broadcast_to' not implemented". ``broadcast_to(x, shape)`` is
``expand(x, shape)`` (the same broadcasting rule, no ``-1`` entries), so it is registered as
coremltools' own ``expand`` converter.

A torch op coremltools has no converter for ends the conversion with a ``NotImplementedError``
whose message names the torch op only; ``converter_refusal`` turns it into one line that also
names the ONNX node the op came from (onnx2torch names each module after its ONNX node).
"""

from __future__ import annotations

import re
from typing import Any

from edgekit.errors import UnsupportedOpError

_MISSING_OP = re.compile(r"convert function for op '([^']+)' not implemented")


def register_torch_ops() -> None:
    """Register ``broadcast_to`` with coremltools' torch frontend, once (no-op if it has one)."""
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY, register_torch_op

    if _TORCH_OPS_REGISTRY.get_func("broadcast_to") is not None:
        return
    expand = _TORCH_OPS_REGISTRY.get_func("expand")

    def broadcast_to(context: Any, node: Any) -> None:
        expand(context, node)

    register_torch_op(broadcast_to)


def converter_refusal(exc: BaseException, traced: Any, version: str) -> UnsupportedOpError | None:
    """The one-line error for a torch op coremltools cannot convert, or ``None`` for any other failure."""
    found = _MISSING_OP.search(str(exc))
    if found is None:
        return None
    op = found.group(1)
    nodes = sorted(
        {
            node.scopeName().split("/")[-1].removeprefix("__module.")
            for node in traced.inlined_graph.nodes()
            if node.kind().split("::")[-1] == op and node.scopeName()
        }
    )
    where = f" (from ONNX node {', '.join(nodes[:5])}{', ...' if len(nodes) > 5 else ''})" if nodes else ""
    return UnsupportedOpError(
        f"apple: coremltools {version} has no converter for the torch op '{op}'{where} that onnx2torch wrote for "
        "this model; the other targets are not affected: drop apple from --target, or replace that op in the model"
    )


__all__ = ["converter_refusal", "register_torch_ops"]
