"""Shapes a static-shape target takes: TensorRT optimization profiles, and the axes a target froze.

TensorRT builds an engine for a range of input shapes, the optimization profile: per input a
minimum, an optimum (what its kernels are tuned for) and a maximum shape, as ``trtexec
--minShapes/--optShapes/--maxShapes`` take them. ``--batch 1,4,8`` (``jetson.batch``) ranges
axis 0 of every input whose batch axis is dynamic; ``jetson.profile_shapes`` ranges any dynamic
axis (``images=1x3x320x320:4x3x480x480:8x3x640x640``, min:opt:max). An axis no range covers
keeps its static shape (``--input-shape`` or the calibration data), min = opt = max. The profile
is recorded in the manifest (``target_options.optimization_profile``: input -> min/opt/max) and
the device's TensorRT runtime builds the engine with it; axes it varies stay dynamic in the
served signature, so the agent can batch requests.

Targets without profiles (coral, apple) freeze every dynamic axis; ``frozen_axes`` says which
to what, for the table and the manifest's validation notes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from edgekit.bundle.manifest import Signature, TensorSpec
from edgekit.errors import ConfigError

PROFILE_KEY = "optimization_profile"  # in the manifest's target_options


@dataclass(frozen=True)
class ShapeRange:
    """One input's optimization profile: the smallest, the tuned-for and the largest shape."""

    min: tuple[int, ...]
    opt: tuple[int, ...]
    max: tuple[int, ...]

    def to_data(self) -> dict[str, list[int]]:
        return {"min": list(self.min), "opt": list(self.opt), "max": list(self.max)}

    def text(self) -> str:
        return " / ".join("x".join(map(str, s)) for s in (self.min, self.opt, self.max))


def parse_batch(text: str) -> tuple[int, int, int]:
    """``--batch MIN,OPT,MAX`` (``1,4,8``), or ``--batch MAX`` for 1,MAX,MAX."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) == 1:
        values = (1, values[0], values[0])
    if len(values) != 3 or not 1 <= values[0] <= values[1] <= values[2]:
        raise ConfigError(f"--batch {text}: expected MIN,OPT,MAX with 1 <= MIN <= OPT <= MAX, such as 1,4,8")
    return values[0], values[1], values[2]


def batch_option(text: str, targets: Sequence[str]) -> str:
    """``--batch MIN,OPT,MAX`` as the ``--option`` it stands for (``jetson.batch=[1,4,8]``)."""
    values = parse_batch(text)
    if "jetson" not in targets:
        raise ConfigError(
            f"--batch {text}: ranges the jetson target's TensorRT optimization profile, and jetson is not being "
            f"packaged (packaging: {', '.join(targets)}); cpu and intel keep the model's dynamic batch axis, coral "
            "and apple take one static shape (--input-shape NAME=8x3x224x224)"
        )
    return f"jetson.batch=[{values[0]},{values[1]},{values[2]}]"


def profile_shapes_option(items: Sequence[str], targets: Sequence[str]) -> str:
    """``--profile-shape NAME=MIN:OPT:MAX`` (repeated) as the ``--option`` it stands for."""
    import json

    if "jetson" not in targets:
        raise ConfigError(
            f"--profile-shape {items[0]}: ranges the jetson target's TensorRT optimization profile, and jetson is "
            f"not being packaged (packaging: {', '.join(targets)})"
        )
    for item in items:
        _parse_profile_shape(item, f"--profile-shape {item}")
    return f"jetson.profile_shapes={json.dumps(list(items))}"


def optimization_profile(
    served: Signature,
    static_shapes: Mapping[str, Sequence[int]],
    batch: Sequence[int] = (),
    profile_shapes: Sequence[str] = (),
    where: str = "targets.jetson",
) -> dict[str, ShapeRange] | None:
    """The profile ``batch`` and ``profile_shapes`` ask for, checked against the model (``None``
    when neither is given). The static shape the data is validated at must lie inside it."""
    if not batch and not profile_shapes:
        return None
    specs = {s.name: s for s in served.inputs}
    ranges = {s.name: _fixed(tuple(int(d) for d in static_shapes[s.name])) for s in served.inputs}
    if batch:
        lo, opt, hi = _batch_values(batch, where)
        dynamic = [s for s in served.inputs if s.shape and not isinstance(s.shape[0], int)]
        if not dynamic:
            shapes = ", ".join(f"{s.name!r} {list(s.shape)}" for s in served.inputs)
            raise ConfigError(
                f"{where}.batch {lo},{opt},{hi}: the model's batch axis is fixed ({shapes}); export it with a "
                "dynamic batch axis (edgekit export without --static-batch) to range it"
            )
        for s in dynamic:
            r = ranges[s.name]
            ranges[s.name] = ShapeRange((lo, *r.min[1:]), (opt, *r.opt[1:]), (hi, *r.max[1:]))
    for item in profile_shapes:
        name, r = _parse_profile_shape(item, f"{where}.profile_shapes {item}")
        spec = specs.get(name)
        if spec is None:
            raise ConfigError(
                f"{where}.profile_shapes {item}: the model has no input {name!r} (inputs: {', '.join(specs)})"
            )
        _check_range(spec, r, f"{where}.profile_shapes {item}")
        ranges[name] = r
    for name, r in ranges.items():
        static = tuple(int(d) for d in static_shapes[name])
        if not all(a <= s <= b for a, s, b in zip(r.min, static, r.max, strict=True)):
            raise ConfigError(
                f"{where}: input {name!r} is validated at {'x'.join(map(str, static))} (--input-shape or the "
                f"calibration data), outside its profile {r.text()}; widen the range to include it"
            )
    return ranges


def profile_data(profile: Mapping[str, ShapeRange]) -> dict[str, dict[str, list[int]]]:
    return {name: r.to_data() for name, r in profile.items()}


def profiled_signature(served: Signature, target_options: Mapping[str, Any]) -> Signature:
    """``served`` (the source model's dynamic signature) with the input axes the recorded profile
    does not vary fixed to their one size; unchanged without a profile."""
    profile = target_options.get(PROFILE_KEY)
    if not profile:
        return served
    inputs = []
    for spec in served.inputs:
        r = profile.get(spec.name)
        if r is not None:
            spec = dataclasses.replace(
                spec,
                shape=tuple(lo if lo == hi else d for d, lo, hi in zip(spec.shape, r["min"], r["max"], strict=True)),
            )
        inputs.append(spec)
    return dataclasses.replace(served, inputs=tuple(inputs))


def frozen_axes(source: Signature, static_shapes: Mapping[str, Sequence[int]]) -> tuple[str, ...]:
    """Each dynamic input axis of ``source`` a static-shape artifact froze, and to what:
    ``input 'images' axis 0 (batch) frozen to 1``."""
    said = []
    for spec in source.inputs:
        shape = static_shapes.get(spec.name)
        if shape is None:
            continue
        for axis, (dim, size) in enumerate(zip(spec.shape, shape, strict=True)):
            if isinstance(dim, str):
                said.append(f"input {spec.name!r} axis {axis} ({dim}) frozen to {int(size)}")
    return tuple(said)


def shapes_line(
    target: str,
    source: Signature,
    static_shapes: Mapping[str, Sequence[int]],
    static: bool,
    target_options: Mapping[str, Any],
) -> str:
    """The table's line on shapes: the TensorRT profile recorded, or the axes a static artifact froze
    ("" when the artifact keeps the source's dynamic axes)."""
    profile = target_options.get(PROFILE_KEY)
    if profile:
        ranges = "; ".join(
            f"{name!r} " + " / ".join("x".join(map(str, r[k])) for k in ("min", "opt", "max"))
            for name, r in profile.items()
        )
        return f"TensorRT optimization profile (min / opt / max): {ranges}"
    frozen = frozen_axes(source, static_shapes) if static else ()
    if not frozen:
        return ""
    hint = " (--batch MIN,OPT,MAX gives a TensorRT profile instead)" if target == "jetson" else ""
    return "static shapes: " + ", ".join(frozen) + hint


def _fixed(shape: tuple[int, ...]) -> ShapeRange:
    return ShapeRange(shape, shape, shape)


def _batch_values(batch: Sequence[int], where: str) -> tuple[int, int, int]:
    values = tuple(int(v) for v in batch)
    if len(values) != 3 or not 1 <= values[0] <= values[1] <= values[2]:
        raise ConfigError(f"{where}.batch {list(values)}: expected [MIN, OPT, MAX] with 1 <= MIN <= OPT <= MAX")
    return values[0], values[1], values[2]


def _parse_profile_shape(item: str, what: str) -> tuple[str, ShapeRange]:
    name, sep, rest = item.partition("=")
    parts = rest.split(":")
    try:
        shapes = [tuple(int(d) for d in p.lower().split("x")) for p in parts]
    except ValueError:
        shapes = []
    if not sep or not name or len(shapes) != 3 or len({len(s) for s in shapes}) != 1:
        raise ConfigError(f"{what}: expected NAME=MIN:OPT:MAX such as images=1x3x320x320:4x3x480x480:8x3x640x640")
    return name.strip(), ShapeRange(shapes[0], shapes[1], shapes[2])


def _check_range(spec: TensorSpec, r: ShapeRange, what: str) -> None:
    if len(r.min) != len(spec.shape):
        raise ConfigError(
            f"{what}: {len(r.min)} dims, but input {spec.name!r} {list(spec.shape)} has {len(spec.shape)}"
        )
    for axis, (dim, lo, opt, hi) in enumerate(zip(spec.shape, r.min, r.opt, r.max, strict=True)):
        if isinstance(dim, int) and not lo == opt == hi == dim:
            raise ConfigError(f"{what}: axis {axis} is fixed to {dim} by the model; give {dim} in min, opt and max")
        if not 1 <= lo <= opt <= hi:
            raise ConfigError(f"{what}: axis {axis} needs 1 <= min <= opt <= max, got {lo}, {opt}, {hi}")
