"""Host targets: one module each, listed in ``TARGETS`` (imported only when used)."""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable

from edgekit.errors import ConfigError
from edgekit.targets.base import PRECISIONS, BuildContext, BuildResult, Target

# target name -> "module:Class"
TARGETS: dict[str, str] = {
    "cpu": "edgekit.targets.cpu:CpuTarget",
    "intel": "edgekit.targets.intel:IntelTarget",
    "coral": "edgekit.targets.coral:CoralTarget",
    "jetson": "edgekit.targets.jetson:JetsonTarget",
    "apple": "edgekit.targets.apple:AppleTarget",
}


# runtime / format names people type for a target -> the target (accepted with a note)
TARGET_ALIASES: dict[str, str] = {
    "onnxruntime": "cpu",
    "ort": "cpu",
    "openvino": "intel",
    "tensorrt": "jetson",
    "trt": "jetson",
    "tflite": "coral",
    "litert": "coral",
    "edgetpu": "coral",
    "coreml": "apple",
}

# device names people type -> (the target, why: what that device runs the model on)
DEVICE_ALIASES: dict[str, tuple[str, str]] = {
    **dict.fromkeys(
        ("raspberrypi", "raspberry-pi", "rpi", "pi", "arm64", "aarch64", "armv8", "x86", "x86_64", "amd64"),
        ("cpu", "ONNX Runtime on its CPU"),
    ),
    **dict.fromkeys(
        ("jetson-orin", "orin", "jetson-nano", "jetson-xavier", "xavier"),
        ("jetson", "TensorRT on its GPU"),
    ),
    **dict.fromkeys(
        ("coral-usb", "coral-dev", "coral-devboard", "coral-pcie", "coral-m2", "tpu"),
        ("coral", "LiteRT with the Edge TPU delegate"),
    ),
    **dict.fromkeys(("intel-npu", "intel-gpu", "npu"), ("intel", "OpenVINO on the Intel CPU, GPU or NPU")),
    **dict.fromkeys(
        ("mac", "macos", "iphone", "ios", "ane", "neural-engine", "apple-silicon"),
        ("apple", "Core ML on the Neural Engine, GPU or CPU"),
    ),
}


def parse_targets(text: str, note: Callable[[str], None] | None = None) -> list[str]:
    """``"cpu,intel"`` -> ``["cpu", "intel"]``; unknown names fail with the nearest valid one.

    Runtime and format names (``openvino``, ``tensorrt``, ``tflite``, ``edgetpu``, ``coreml``)
    and device names (``raspberrypi``, ``jetson-orin``, ``coral-usb``, ``mac``, ...) stand for their
    target; ``note`` is told each such reading."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"--target: give one or more of {', '.join(TARGETS)}")
    out = []
    for n in names:
        low = n.lower()
        if low in TARGETS:
            out.append(low)
        elif low in TARGET_ALIASES:
            out.append(TARGET_ALIASES[low])
            if note is not None:
                note(f"--target {n} is the {TARGET_ALIASES[low]} target")
        elif low in DEVICE_ALIASES:
            target, runs_on = DEVICE_ALIASES[low]
            out.append(target)
            if note is not None:
                note(f"--target {n} is the {target} target ({runs_on})")
        else:
            near = difflib.get_close_matches(low, [*TARGETS, *TARGET_ALIASES, *DEVICE_ALIASES], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"--target: unknown target {n!r} (choose from {', '.join(TARGETS)}){hint}")
    return list(dict.fromkeys(out))


def get_target(name: str) -> Target:
    module, cls = TARGETS[name].split(":")
    target: Target = getattr(importlib.import_module(module), cls)()
    return target


__all__ = [
    "DEVICE_ALIASES",
    "PRECISIONS",
    "TARGETS",
    "TARGET_ALIASES",
    "BuildContext",
    "BuildResult",
    "Target",
    "get_target",
    "parse_targets",
]
