"""Host targets: one module each, listed in ``TARGETS`` (imported only when used)."""

from __future__ import annotations

import difflib
import importlib

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


def parse_targets(text: str) -> list[str]:
    """``"cpu,intel"`` -> ``["cpu", "intel"]``; unknown names fail with the nearest valid one."""
    names = [t.strip() for t in text.split(",") if t.strip()]
    if not names:
        raise ConfigError(f"--target: give one or more of {', '.join(TARGETS)}")
    for n in names:
        if n not in TARGETS:
            near = difflib.get_close_matches(n, TARGETS, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"--target: unknown target {n!r} (choose from {', '.join(TARGETS)}){hint}")
    return list(dict.fromkeys(names))


def get_target(name: str) -> Target:
    module, cls = TARGETS[name].split(":")
    target: Target = getattr(importlib.import_module(module), cls)()
    return target


__all__ = ["PRECISIONS", "TARGETS", "BuildContext", "BuildResult", "Target", "get_target", "parse_targets"]
