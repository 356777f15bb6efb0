"""Which targets can take an op, asked of the targets' own checkers (never a hand-written op list).

A target's ``check_model`` finds the nodes its converter cannot take (from the tool itself:
OpenVINO's ONNX frontend, onnx2tf's op table, ...) and raises ``raise_unsupported``'s error,
which names the op, the node and the other targets whose own checkers accept that op. While
those other checkers run, they do not look for alternatives in turn (no recursion).
"""

from __future__ import annotations

import contextvars
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from edgekit.errors import EdgekitError, UnsupportedOpError

_ASKING_OTHERS: contextvars.ContextVar[bool] = contextvars.ContextVar("edgekit_asking_other_targets", default=False)


@dataclass(frozen=True)
class UnsupportedNode:
    op_type: str
    domain: str  # "" for the default ONNX domain
    node: str  # the ONNX node name (or its first output when the node has no name)

    @property
    def qualified_op(self) -> str:
        return f"{self.domain}.{self.op_type}" if self.domain not in ("", "ai.onnx") else self.op_type


class TargetOpError(UnsupportedOpError):
    """A target cannot take one or more ops; ``nodes`` lists them, ``alternatives`` the targets that can."""

    def __init__(self, message: str, target: str, nodes: tuple[UnsupportedNode, ...], alternatives: tuple[str, ...]):
        super().__init__(message)
        self.target = target
        self.nodes = nodes
        self.alternatives = alternatives


def onnx_nodes_by_name(model_path: Path) -> dict[str, UnsupportedNode]:
    """Every node of the ONNX graph, keyed by its name and by each of its outputs."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    found: dict[str, UnsupportedNode] = {}
    for node in model.graph.node:
        entry = UnsupportedNode(node.op_type, node.domain, node.name or (node.output[0] if node.output else ""))
        for key in (node.name, *node.output):
            if key:
                found.setdefault(key, entry)
    return found


def targets_taking(model_path: Path, op: UnsupportedNode, exclude: str) -> tuple[str, ...]:
    """Targets (other than ``exclude``) whose own ``check_model`` accepts ``op`` in this model.

    A target whose module or SDK is not installed here cannot be asked and is left out.
    """
    from edgekit.targets import TARGETS, get_target

    takers = []
    token = _ASKING_OTHERS.set(True)
    try:
        for name in TARGETS:
            if name == exclude:
                continue
            try:
                get_target(name).check_model(model_path)
            except TargetOpError as exc:
                if all(n.qualified_op != op.qualified_op for n in exc.nodes):
                    takers.append(name)  # it refuses other ops of this model, not this one
            except (ImportError, EdgekitError):
                continue  # not installed here, or refuses without saying which op: cannot tell
            else:
                takers.append(name)
    finally:
        _ASKING_OTHERS.reset(token)
    return tuple(takers)


def raise_unsupported(target: str, tool: str, model_path: Path, nodes: Sequence[UnsupportedNode]) -> NoReturn:
    """Raise ``TargetOpError`` for ``nodes`` (non-empty), naming the targets that can take the first."""
    first = nodes[0]
    alternatives = () if _ASKING_OTHERS.get() else targets_taking(model_path, first, exclude=target)
    more = ""
    if len(nodes) > 1:
        rest = ", ".join(f"{n.qualified_op} ({n.node!r})" for n in nodes[1:6])
        more = f"; also {rest}" + (f" and {len(nodes) - 6} more" if len(nodes) > 6 else "")
    if alternatives:
        what_to_do = f"targets that can take it: {', '.join(alternatives)}; package for one of them or replace the op"
    else:
        what_to_do = "no other target installed here takes it either; replace it with standard ONNX ops"
    raise TargetOpError(
        f"target {target!r} cannot take op {first.qualified_op} (node {first.node!r}): {tool} has no conversion "
        f"for it{more}. {what_to_do[0].upper()}{what_to_do[1:]}.",
        target,
        tuple(nodes),
        alternatives,
    )
