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


def parse_targets(text: str, note: Callable[[str], None] | None = None) -> list[str]:
    """``"cpu,intel"`` -> ``["cpu", "intel"]``; unknown names fail with the nearest valid one.

    Runtime and format names (``openvino``, ``tensorrt``, ``tflite``, ``edgetpu``, ``coreml``)
    stand for their target; ``note`` is told each such reading."""
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
        else:
            near = difflib.get_close_matches(low, [*TARGETS, *TARGET_ALIASES], n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"--target: unknown target {n!r} (choose from {', '.join(TARGETS)}){hint}")
    return list(dict.fromkeys(out))


def get_target(name: str) -> Target:
    module, cls = TARGETS[name].split(":")
    target: Target = getattr(importlib.import_module(module), cls)()
    return target


__all__ = [
    "PRECISIONS",
    "TARGETS",
    "TARGET_ALIASES",
    "BuildContext",
    "BuildResult",
    "Target",
    "get_target",
    "parse_targets",
]
