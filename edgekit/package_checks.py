"""Checks of ``edgekit package`` arguments that run before any conversion, so that a bad
combination is refused before minutes of converting: the model path, the output folders, the data
sources for the chosen precisions, tolerance keys for the model's output kind, and
``--input-shape`` against the model.

Each raises ``ConfigError`` / ``ModelFormatError`` / ``CalibrationDataError`` with one line that
names the path or flag and says what to do.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from edgekit.bundle.command_line import os_error_parts
from edgekit.bundle.manifest import Signature
from edgekit.errors import CalibrationDataError, ConfigError, ModelFormatError

# Precisions built without calibration data (the evaluation data still validates them).
NO_CALIBRATION = ("fp32", "fp16", "bf16")
# Which tolerance keys gate which output kind (edgekit.validate.metrics.compare).
TOLERANCE_KINDS = {
    "min_top1_agreement": "classifier",
    "max_top1_drop": "classifier",
    "min_cosine": "dense",
    "max_relative_error": "dense",
    "min_channel_cosine": "dense",
}


def check_model_path(model: Path) -> None:
    """``model`` is an existing file; a folder is refused with the ``.onnx`` files it holds."""
    if model.is_dir():
        found = sorted(str(p) for p in model.rglob("*.onnx"))[:5]
        listing = f"; it holds {', '.join(found)}" if found else "; it holds no .onnx file"
        raise ModelFormatError(f"model {model} is a folder, not an ONNX file{listing}")
    if not model.exists():
        raise ModelFormatError(f"model {model} does not exist")


def check_out_dir(folder: Path, flag: str) -> None:
    """Create ``folder`` if needed and prove it writable (a file is made and removed in it)."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{flag} {folder}: is a file, not a folder; give a folder for the output")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".edgekit-write-check-", dir=folder)
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)
    except OSError as exc:
        reason, advice = os_error_parts(exc)
        raise ConfigError(f"{flag} {folder}: cannot create or write this folder ({reason}); {advice}") from exc


def check_data_sources(calib: Any, eval_data: Any, precisions: Mapping[str, str]) -> tuple[Any, Any]:
    """(calibration source, evaluation source): calibration may be left out when every target
    builds fp32/fp16, and then the evaluation data is the only data; with neither, (None, None):
    the packager draws inputs within the model's declared shapes (``edgekit.validate.drawn_inputs``)."""
    if calib is not None:
        return calib, eval_data
    needs = sorted({p for p in precisions.values() if p not in NO_CALIBRATION})
    if needs:
        raise CalibrationDataError(
            f"package: {', '.join(needs)} needs calibration data (--calib CALIB.npz, an .npy or a folder of images)"
        )
    if eval_data is None:
        return None, None  # fp32/fp16 without data: inputs drawn within the declared shapes
    return eval_data, eval_data


def check_tolerance_kind(tolerance: Mapping[str, Any], kind: str, served: Signature) -> None:
    """A tolerance key given for the other output kind would be ignored: refuse it."""
    for key in tolerance:
        applies = TOLERANCE_KINDS.get(key)
        if applies is not None and applies != kind:
            out = served.outputs[0]
            mine = sorted(k for k, v in TOLERANCE_KINDS.items() if v == kind)
            what = "a classifier (one score vector per sample)" if kind == "classifier" else "dense"
            raise ConfigError(
                f"tolerance.{key}: gates {applies} outputs, but the model's first output {out.name!r} "
                f"{list(out.shape)} is {what}; use {' or '.join(mine)}"
            )


def check_input_shapes(served: Signature, given: Mapping[str, Sequence[int]]) -> None:
    """``--input-shape`` names a model input, has its rank and keeps the dims the model fixes."""
    specs = {s.name: s for s in served.inputs}
    for name, shape in given.items():
        flag = f"--input-shape {name}={'x'.join(map(str, shape))}"
        spec = specs.get(name)
        if spec is None:
            raise ConfigError(f"{flag}: the model has no input {name!r} (inputs: {', '.join(specs)})")
        model_shape = "[" + ", ".join(str(d) for d in spec.shape) + "]"
        if len(shape) != len(spec.shape):
            raise ConfigError(f"{flag}: {len(shape)} dims, but input {name!r} {model_shape} has {len(spec.shape)}")
        for axis, (want, dim) in enumerate(zip(shape, spec.shape, strict=True)):
            if isinstance(dim, int) and want != dim:
                raise ConfigError(f"{flag}: axis {axis} is {want}, but the model fixes it to {dim} ({model_shape})")


def shape_flags(served: Signature, given: Mapping[str, Sequence[int]] | None) -> dict[str, tuple[str, Any]]:
    """For ``check_arrays(set_by=...)``: input name -> (its --input-shape flag, the model's spec)."""
    specs = {s.name: s for s in served.inputs}
    return {
        n: (f"--input-shape {n}={'x'.join(map(str, shape))}", specs[n])
        for n, shape in (given or {}).items()
        if n in specs
    }
