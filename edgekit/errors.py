"""Errors raised by edgekit (host side): the shared ones from ``edgekit.bundle.errors``, which the
device agent raises too, and those only packaging raises (a model, its data or an artifact).
"""

from __future__ import annotations

from edgekit.bundle.errors import *  # noqa: F403  # re-export: one set of error classes for host and device
from edgekit.bundle.errors import EdgekitError
from edgekit.bundle.errors import __all__ as _shared

__all__ = [
    *_shared,
    "AcceleratorMissingError",
    "CalibrationDataError",
    "EdgekitWarning",
    "ModelFormatError",
    "UnsupportedOpError",
    "ValidationFailedError",
]


class ModelFormatError(EdgekitError):
    """The input model cannot be read (not ONNX, corrupt, unsupported op)."""

    exit_code = 2


class CalibrationDataError(EdgekitError):
    """Calibration / evaluation data do not match the model's inputs."""

    exit_code = 2


class ValidationFailedError(EdgekitError):
    """A converted artifact is outside the tolerance against the FP32 source model."""

    exit_code = 3


class AcceleratorMissingError(EdgekitError):
    """``--require-accelerator``: a bundle would run on the CPU only (its accelerator's compiler is missing)."""

    exit_code = 3


class UnsupportedOpError(EdgekitError):
    """A target cannot take an op of the model."""

    exit_code = 2


class EdgekitWarning(UserWarning):
    """Something the user should know that does not stop the work (a gate on few samples, drawn
    inputs); the CLI prints it as ``warning: ...`` on stderr."""
