"""One line saying what a loaded model runs on: its runtime, and the delegate, execution provider
or device that does the work (``ArtifactRunner.describe()`` read back). The agent logs it at
install and at start, so a model that fell back to the CPU (no Edge TPU, no CUDA provider) shows
in the log, not only in its latency."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def runs_on(described: Mapping[str, Any]) -> str:
    """``onnxruntime 1.32 on CPUExecutionProvider``, ``litert 2.3 with the edgetpu delegate``,
    ``tensorrt 10.3 on Orin (compute capability 8.7), builder flags int8, fp16``, ..."""
    runtime = str(described.get("runtime", "unknown runtime"))
    version = described.get("version")
    head = f"{runtime} {version}" if version else runtime
    if described.get("fallback"):  # tensorrt through ONNX Runtime's TensorRT / CUDA provider
        providers = described.get("providers") or []
        return f"{head} (fallback {described['fallback']}) on {_chain(providers)}"
    if runtime == "onnxruntime":
        return f"{head} on {_chain(described.get('providers') or [])}"
    if runtime == "openvino":
        devices = ", ".join(described.get("execution_devices") or []) or "?"
        note = f"; {described['precision_note']}" if described.get("precision_note") else ""
        return f"{head} on {described.get('device', '?')} (execution devices: {devices}){note}"
    if runtime == "litert":
        return f"{head} with the {described.get('delegate', '?')} delegate"
    if runtime == "tensorrt":
        flags = ", ".join(described.get("builder_flags") or []) or "none (fp32)"
        where = f"{described.get('device', '?')} (compute capability {described.get('compute_capability', '?')})"
        return f"{head} on {where}, builder flags {flags}"
    if runtime == "coreml":
        return f"{head} with compute units {described.get('compute_units', '?')}"
    rest = ", ".join(f"{k} {v}" for k, v in described.items() if k not in ("runtime", "version"))
    return f"{head} ({rest})" if rest else head


def _chain(providers: list[str]) -> str:
    """The first provider does the work; the rest take what it cannot."""
    if not providers:
        return "?"
    return providers[0] + (f" (then {', '.join(providers[1:])})" if len(providers) > 1 else "")
