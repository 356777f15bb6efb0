"""Latency profiles recorded elsewhere: on the device (the head's side) or on the tail server.

A profile is JSON written by ``edgekit split plan --save-profile`` run on that machine (or by any
tool that writes the same keys)::

    {"format": "edgekit-split-profile/1", "machine": "...", "runtime": "onnxruntime 1.32.0",
     "full_ms": 12.5,
     "cuts": {"cut7": {"tensors": ["r2"], "head_ms": 3.1, "tail_ms": 9.6}},
     "device_power_w": 4.2, "power_source": "measured: rapl (package-0)"}

``edgekit-agent profile BUNDLE`` writes one on the device with the agent's own runtime (the full
model and the bundle's heads; ``device_power_w`` where the device has an energy meter).
Milliseconds are per sample; ``device_power_w`` (optional) is the power drawn while computing.
Unknown keys are errors naming their path; a cut whose tensors
differ from the model's cut of that id is an error (the profile is of another model).
"""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgekit.errors import ConfigError
from edgekit.split.graph import CutPoint

FORMAT = "edgekit-split-profile/1"


@dataclass(frozen=True)
class SegmentTimes:
    tensors: tuple[str, ...]
    head_ms: float | None
    tail_ms: float | None


@dataclass(frozen=True)
class Profile:
    source: str  # the file it came from, or "measured here"
    full_ms: float
    cuts: Mapping[str, SegmentTimes]
    machine: str = ""
    runtime: str = ""
    device_power_w: float | None = None  # watts while computing (energy objective)
    power_source: str = ""

    def head_ms(self, cut: CutPoint) -> float | None:
        return self._times(cut).head_ms

    def tail_ms(self, cut: CutPoint) -> float | None:
        return self._times(cut).tail_ms

    def _times(self, cut: CutPoint) -> SegmentTimes:
        times = self.cuts.get(cut.id)
        if times is None:
            return SegmentTimes(cut.tensors, None, None)
        if times.tensors != cut.tensors:
            raise ConfigError(
                f"{self.source}: cuts.{cut.id}.tensors is {list(times.tensors)}, the model's {cut.id} is "
                f"{list(cut.tensors)}: the profile was recorded on another model; record it again"
            )
        return times


def read(path: Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{path}: not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    _known(data, {"format", "machine", "runtime", "full_ms", "cuts", "device_power_w", "power_source"}, str(path))
    if data.get("format") != FORMAT:
        raise ConfigError(f"{path}: format is {data.get('format')!r}, expected {FORMAT!r}")
    cuts: dict[str, SegmentTimes] = {}
    raw_cuts = data.get("cuts", {})
    if not isinstance(raw_cuts, dict):
        raise ConfigError(f"{path}: cuts must be an object of cut id -> times")
    for cut_id, entry in raw_cuts.items():
        where = f"{path}: cuts.{cut_id}"
        if not isinstance(entry, dict):
            raise ConfigError(f"{where} must be an object")
        _known(entry, {"tensors", "head_ms", "tail_ms"}, where)
        tensors = entry.get("tensors")
        if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
            raise ConfigError(f"{where}.tensors must be a list of tensor names")
        cuts[cut_id] = SegmentTimes(
            tuple(tensors), _ms(entry.get("head_ms"), f"{where}.head_ms"), _ms(entry.get("tail_ms"), f"{where}.tail_ms")
        )
    full_ms = _ms(data.get("full_ms"), f"{path}: full_ms")
    if full_ms is None:
        raise ConfigError(f"{path}: full_ms (the whole model's milliseconds per sample) is missing")
    power = _ms(data.get("device_power_w"), f"{path}: device_power_w")
    return Profile(
        str(path),
        full_ms,
        cuts,
        str(data.get("machine", "")),
        str(data.get("runtime", "")),
        power,
        str(data.get("power_source", "")),
    )


def write(path: Path, profile: Profile) -> Path:
    data: dict[str, Any] = {
        "format": FORMAT,
        "machine": profile.machine,
        "runtime": profile.runtime,
        "full_ms": round(profile.full_ms, 4),
        "cuts": {
            cut_id: {"tensors": list(t.tensors), "head_ms": _round(t.head_ms), "tail_ms": _round(t.tail_ms)}
            for cut_id, t in profile.cuts.items()
        },
    }
    if profile.device_power_w is not None:
        data["device_power_w"], data["power_source"] = profile.device_power_w, profile.power_source
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
    return Path(path)


def this_machine() -> str:
    return f"{platform.node()} {platform.machine()} {platform.processor() or platform.system()}".strip()


def _known(data: Mapping[str, Any], keys: set[str], where: str) -> None:
    unknown = sorted(set(data) - keys)
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r} (known: {', '.join(sorted(keys))})")


def _ms(value: object, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
        raise ConfigError(f"{where} must be a non-negative number, got {value!r}")
    return float(value)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)
