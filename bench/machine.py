"""What the benchmarks ran on: CPU model, cores, OS and runtime versions (read, never imported)."""

from __future__ import annotations

import os
import platform
from importlib import metadata

RUNTIMES = ("onnxruntime", "openvino", "ai-edge-litert", "tensorrt", "coremltools", "numpy")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def describe() -> dict[str, object]:
    versions = {}
    for dist in RUNTIMES:
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": usable,
        "machine": platform.machine(),
        "os": f"{platform.system()} {platform.release()}",
        "python": platform.python_version(),
        "versions": versions,
    }


def one_line(info: dict[str, object]) -> str:
    versions = info.get("versions")
    ver = ", ".join(f"{k} {v}" for k, v in versions.items()) if isinstance(versions, dict) else ""
    return (
        f"{info['cpu']}, {info['cores']} cores ({info['cores_usable']} usable), {info['machine']}, "
        f"{info['os']}, Python {info['python']}; {ver}"
    )


def short_line(info: dict[str, object]) -> str:
    """CPU, cores and the ONNX Runtime version: fits a plot title."""
    versions = info.get("versions")
    ort = versions.get("onnxruntime", "absent") if isinstance(versions, dict) else "absent"
    return f"{info['cpu']}, {info['cores']} cores, {info['machine']}, onnxruntime {ort}"
