"""Whether a model's rows are independent: what dynamic batching on the device relies on.

The agent's batcher concatenates different clients' requests on axis 0 and splits the outputs
back by rows. That is right only if each row's outputs depend on that row alone. A dynamic
batch axis does not say so: a model may normalise over the batch, attend across it, or sort
it. So the packager runs two golden input rows as one batch of 2 and each row alone, with
the same runtime it validated with, and compares row by row within the golden vectors'
tolerance (what the device's self-test accepts as the same answer). The result goes into the
manifest (``rows_independent``); an agent refuses to batch a model recorded as ``false``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.bundle.manifest import Golden, Signature

RunFn = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass(frozen=True)
class RowCheck:
    """``independent``: True / False, or None when not checked (a static batch axis: the agent
    never batches it; golden inputs without two rows). ``reason`` says why, in one line."""

    independent: bool | None
    reason: str

    def line(self) -> str:
        """One progress line: what was found, and what the agent will do with it."""
        if self.independent is None:
            return f"rows not checked: {self.reason}"
        if self.independent:
            return f"rows independent: {self.reason}"
        return f"rows NOT independent: {self.reason}; agents will refuse to batch this model"


def check_rows(fn: RunFn, inputs: Mapping[str, np.ndarray], served: Signature, golden: Golden) -> RowCheck:
    """Run ``inputs``' first two rows as one batch of 2 and each alone with ``fn``; compare."""
    for spec in served.inputs:
        if not spec.shape or isinstance(spec.shape[0], int):
            return RowCheck(None, f"input {spec.name!r} has a static batch axis: never batched on a device")
        if spec.name not in inputs or np.asarray(inputs[spec.name]).ndim != len(spec.shape):
            return RowCheck(None, f"no golden rows of input {spec.name!r} to check with")
    pair = {spec.name: _two_rows(np.asarray(inputs[spec.name])) for spec in served.inputs}
    try:
        together = {k: np.asarray(v) for k, v in fn(pair).items()}
        alone = [{k: np.asarray(v) for k, v in fn({n: a[i : i + 1] for n, a in pair.items()}).items()} for i in (0, 1)]
    except Exception as exc:  # runtime SDK errors have no common base: a batch of 2 does not run
        return RowCheck(False, f"a batch of 2 golden rows does not run: {type(exc).__name__}: {exc}")
    for name, value in together.items():
        if value.ndim == 0 or value.shape[0] != 2:
            return RowCheck(False, f"output {name!r} of shape {list(value.shape)} has no batch axis of 2")
        for i in (0, 1):
            one = alone[i].get(name)
            if one is None or one.shape[1:] != value.shape[1:]:
                return RowCheck(False, f"output {name!r}: row {i} alone has another shape")
            if not _same(value[i : i + 1], one, golden):
                worst = float(np.max(np.abs(value[i : i + 1].astype(np.float64) - one.astype(np.float64))))
                return RowCheck(
                    False,
                    f"output {name!r} of row {i} changes by up to {worst:.3g} when another row shares its batch "
                    f"(over atol {golden.atol:g} + rtol {golden.rtol:g})",
                )
    return RowCheck(True, "each of 2 golden rows gives the same outputs alone and in a batch of 2")


def check_golden_rows(fn: RunFn, golden_file: Path, served: Signature, golden: Golden) -> RowCheck:
    """``check_rows`` on the inputs stored in a golden vectors file (``in_<name>`` arrays)."""
    with np.load(golden_file) as data:
        inputs = {spec.name: data[f"in_{spec.name}"] for spec in served.inputs if f"in_{spec.name}" in data}
    return check_rows(fn, inputs, served, golden)


def _two_rows(x: np.ndarray) -> np.ndarray:
    """Two different rows from ``x``: its first two, or its first and that row's values rolled
    by one (identical rows would hide a model that mixes them)."""
    first = x[:1]
    second = (
        x[1:2] if len(x) > 1 and not np.array_equal(x[0], x[1]) else np.roll(first.reshape(-1), 1).reshape(first.shape)
    )
    return np.concatenate([first, second])


def _same(a: np.ndarray, b: np.ndarray, golden: Golden) -> bool:
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        return bool(np.allclose(a, b, rtol=golden.rtol, atol=golden.atol, equal_nan=True))
    return bool(np.array_equal(a, b))
