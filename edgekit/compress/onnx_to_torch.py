"""ONNX -> PyTorch (onnx2torch), for converters that start from a torch graph (Core ML).

onnx2torch failed on a real graph until constants were folded and the input shapes
fixed with onnxslim, so the graph is frozen first (``edgekit.compress.freeze.freeze_graph``).
``unconvertible_nodes`` asks onnx2torch's own converter registry which nodes it cannot take.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path
from typing import Any

from edgekit.errors import MissingSDKError
from edgekit.targets.op_support import UnsupportedNode

# onnx2torch converters that call torchvision kernels.
_TORCHVISION_OPS = frozenset({"NonMaxSuppression", "RoiAlign"})


def import_onnx2torch() -> tuple[Any, bool]:
    """(onnx2torch module, whether torchvision works).

    onnx2torch imports torchvision at import time for its NonMaxSuppression and RoiAlign
    converters. PyPI's torchvision wheels link against CUDA builds of torch; next to a CPU build
    (``torch==2.13.0+cpu``) their extension does not load and ``import torchvision`` raises
    ``RuntimeError: operator torchvision::nms does not exist``. Then onnx2torch is imported with
    a placeholder torchvision whose kernels refuse to run, the placeholder is removed again, and
    ``unconvertible_nodes`` reports those two ops as not convertible here.
    """
    if "onnx2torch" in sys.modules:
        return sys.modules["onnx2torch"], _torchvision_works()
    try:
        import torch  # noqa: F401  # onnx2torch needs it; a missing torch is reported as the coreml extra
    except ImportError as exc:
        raise MissingSDKError("torch", "coreml", "the ONNX -> PyTorch step of the apple target") from exc
    works = _torchvision_works()
    if works:
        return _import_or_missing(), True
    placeholder, ops = types.ModuleType("torchvision"), types.ModuleType("torchvision.ops")

    def unavailable(*_args: Any, **_kwargs: Any) -> Any:
        raise RuntimeError("torchvision does not load next to this torch build; NMS/RoiAlign cannot run")

    ops.nms = ops.roi_align = ops.box_convert = unavailable  # type: ignore[attr-defined]  # placeholder module
    placeholder.ops = ops  # type: ignore[attr-defined]  # placeholder module
    saved = {k: sys.modules.get(k) for k in ("torchvision", "torchvision.ops")}
    sys.modules["torchvision"], sys.modules["torchvision.ops"] = placeholder, ops
    try:
        return _import_or_missing(), False
    finally:
        for key, value in saved.items():
            if value is None:
                sys.modules.pop(key, None)
            else:
                sys.modules[key] = value


def _torchvision_works() -> bool:
    try:
        importlib.import_module("torchvision")
    except (ImportError, RuntimeError, OSError):
        return False
    return True


def _import_or_missing() -> Any:
    try:
        return importlib.import_module("onnx2torch")
    except ImportError as exc:
        raise MissingSDKError("onnx2torch", "coreml", "the ONNX -> PyTorch step of the apple target") from exc


def unconvertible_nodes(model: Any) -> list[UnsupportedNode]:
    """Nodes of an ``onnx.ModelProto`` that onnx2torch's converter registry has no entry for."""
    _, torchvision_works = import_onnx2torch()
    registry = importlib.import_module("onnx2torch.node_converters.registry")
    opsets = {imp.domain or "": imp.version for imp in model.opset_import}
    found = []
    for node in model.graph.node:
        domain = node.domain or ""
        version = opsets.get(domain, opsets.get("ai.onnx", 1) if domain == "" else 1)
        try:
            registry.get_converter(node.op_type, version, domain or "")
        except NotImplementedError:
            found.append(UnsupportedNode(node.op_type, domain, node.name or node.output[0]))
            continue
        if node.op_type in _TORCHVISION_OPS and not torchvision_works:
            found.append(UnsupportedNode(node.op_type, domain, node.name or node.output[0]))
    return found


def onnx_to_torch(model_path: Path) -> Any:
    """The ONNX model as an evaluating ``torch.fx.GraphModule``."""
    onnx2torch, _ = import_onnx2torch()
    return onnx2torch.convert(str(model_path)).eval()


__all__ = ["import_onnx2torch", "onnx_to_torch", "unconvertible_nodes"]
