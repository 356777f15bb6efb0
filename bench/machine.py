"""What the benchmarks ran on: CPU model, cores, OS and runtime versions (read, never imported)."""

from __future__ import annotations

import os
import platform
from importlib import metadata

RUNTIMES = ("onnxruntime", "openvino", "ai-edge-litert", "tensorrt", "coremltools", "numpy")
# The CPU features the runtimes' kernels choose between (x86: SIMD width, int8 and bf16 dot products,
# AMX; Arm: NEON dot products, SVE, i8mm): what makes a latency from one machine differ on another.
CPU_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
    "avx512_bf16", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16",
    "asimd", "asimddp", "asimdhp", "sve", "sve2", "i8mm", "bf16",
)  # fmt: skip


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | None = None) -> list[str]:
    """The ``CPU_FLAGS`` this CPU has, in ``CPU_FLAGS`` order (``flags`` on x86, ``Features`` on Arm
    in ``/proc/cpuinfo``); empty where that file is absent."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return []
    have: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            have.update(value.split())
    return [flag for flag in CPU_FLAGS if flag in have]


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
        "cpu_flags": cpu_flags(),
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
