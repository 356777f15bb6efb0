"""What every target of one packaging run shares (``SharedRun``: data, FP32 reference, gate),
and the names the packager owns inside a bundle."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import CompressionStep, Signature, Tolerance
from edgekit.validate.calib import fixed_batch
from edgekit.validate.metrics import Kind, RunFn

GOLDEN_FILE = "golden.npz"


EVAL_BATCH = 16


@dataclass(frozen=True)
class SharedRun:
    """What every target of one ``package`` call shares: data, FP32 reference, gate."""

    served: Signature
    kind: Kind
    tolerance: Tolerance
    calib: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]
    labels: np.ndarray | None
    reference: dict[str, np.ndarray]
    fp32: RunFn
    source_size: int
    steps: tuple[str, ...]
    say: Callable[[str], None]
    # manifest fields from the data: ``preprocess`` (images read with --preprocess), ``calibration``
    manifest_extras: dict[str, Any] = dataclasses.field(default_factory=dict)
    # files every bundle carries beside the artifact: path in the bundle -> (source file, role)
    bundle_files: dict[str, tuple[Path, str]] = dataclasses.field(default_factory=dict)
    # each output's task (``validate.metrics.output_tasks``) and the notes naming the gate used
    tasks: Mapping[str, str] | None = None
    gate_notes: tuple[str, ...] = ()
    # the post-processing (``device_agents.processing.post.Postprocessor``): a boxes one judges detections
    post: Any = None
    # an encoded image whose whole-pipeline answer the golden vectors carry (with pre/post-processing)
    golden_image: bytes | None = None
    # the compression steps (``--compress``) that made the packaged model from the original, measured
    compression: tuple[CompressionStep, ...] = ()


def eval_batch(served: Signature, static: bool) -> int:
    return fixed_batch(served) or (1 if static else EVAL_BATCH)
