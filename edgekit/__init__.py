"""edgekit: package models for edge targets and sign them into bundles.

``import edgekit`` loads no ML SDK; ``edgekit.package`` imports what a target needs when called.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from edgekit.errors import EdgekitError

__version__ = "0.1.0"

if TYPE_CHECKING:
    import numpy as np

    from edgekit.bundle.manifest import Tolerance
    from edgekit.packager import PackageResult
    from edgekit.validate.preprocess import Preprocess


def package(
    model: str | Path | Any,
    targets: str | Sequence[str] = ("cpu",),
    precision: str | Mapping[str, str] = "int8",
    calib: str | Path | Mapping[str, Any] | None = None,
    eval: str | Path | Mapping[str, Any] | None = None,
    labels: str | Path | np.ndarray | Sequence[int] | None = None,
    key: str | Path | None = None,
    name: str | None = None,
    version: int = 1,
    out_dir: str | Path = ".",
    tolerance: Tolerance | Mapping[str, float | str | None] | None = None,
    overwrite: bool = False,
    allow_failed: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    expires: datetime | timedelta | str | None = timedelta(days=365),  # = packager.DEFAULT_EXPIRES (tested)
    progress: Callable[[str], None] | None = None,
    options: Mapping[str, Any] | None = None,
    preprocess: Preprocess | str | None = None,
    log_dir: str | Path | None = None,
    *,
    objective: str = "latency",
    mixed_precision: bool = False,
    threads: int = 0,
    calib_samples: int = 128,  # = edgekit.optimize.data.DEFAULT_CALIB_SAMPLES (tested)
    max_drop: float | None = None,
    keep_candidates: str | Path | None = None,
    device_profile: str | Path | None = None,
    postprocess: str | None = None,
    labels_file: str | Path | None = None,
    task: str | Mapping[str, str] | None = None,
    compress: Sequence[str] = (),
    reference: str | Path | None = None,
    train: str | Path | Mapping[str, Any] | None = None,
    train_labels: str | Path | np.ndarray | Sequence[int] | None = None,
    cache: str | None = None,
    false_hit_budget: float = 0.01,
    allow_small_eval: bool = False,
    example_inputs: Any = None,
) -> PackageResult:
    """Convert, quantize and validate ``model`` (ONNX) for each of ``targets`` and write one signed
    bundle per target into ``out_dir`` (``NAME-TARGET-vVERSION.ekb``).

    ``precision``: one name for every target (``fp32``, ``fp16``, ``int8``, ``int8-weights``,
    ``int4-weights``, ``palettize6``, ``palettize4``) or a mapping target -> name (``"*"``: the
    default). ``calib`` / ``eval``: ``.npz``, ``.npy`` (one input), a folder or glob of images
    (with ``preprocess``, e.g. ``"size=224x224,mean=0.485/0.456/0.406,std=0.229/0.224/0.225"``)
    or a mapping input name -> array; ``calib`` may be left out when every target builds fp32/fp16.
    ``key``: the private signing key (``edgekit keygen``). ``tolerance``: gate overrides such as
    ``{"min_top1_agreement": 0.97}``. ``overwrite``: replace existing bundles; ``allow_failed``:
    also write bundles that miss the gate (marked failed; ``result.passed`` is false).
    ``precision="auto"`` (cpu, intel, jetson, coral, apple): the optimisation engine chooses among
    every candidate by ``objective`` (``latency`` or ``size``) within the gate (``max_drop``: the allowed top-1 drop
    for classifiers), never slower than FP32; ``mixed_precision`` lets an explicit ``int8`` keep
    its most sensitive layers in float; ``threads``: the device runtime's thread count candidates
    are timed at; ``calib_samples``: the stratified calibration subset's size. ``keep_candidates``:
    a new folder to write every candidate that met the gate into, for ``edgekit bench --profile``
    on the device; ``device_profile``: the profile that wrote, to choose by device latency.
    ``preprocess`` / ``postprocess`` (``"boxes=yolo,score=0.25,iou=0.45"`` or ``"topk=5"``) and
    ``labels_file`` are recorded in the manifest for the agent: it then takes an encoded image and
    answers boxes or classes, scores and labels. ``task``: how outputs are judged (``classify``,
    ``regress``, ``embed``, ``detect``, ``segment``, or ``{output: task}``). ``compress``: steps
    such as ``"prune-channels=0.5"`` applied first (fine-tuned on ``train``/``train_labels``), gated
    against the original; ``reference``: the original when ``model`` is already compressed.
    ``cache``: the result cache the manifest declares (``exact``, or ``approximate`` with a distance
    threshold calibrated on the evaluation data to hold ``false_hit_budget``).

    Returns a ``PackageResult``: ``bundles`` (target -> path), ``rows`` (the validation table),
    ``passed``, ``table()``, ``to_dict()``. Raises ``edgekit.errors.ConfigError`` and friends for
    bad arguments before any conversion, ``PackageValidationError`` when a target misses its gate.
    See ``edgekit.packager.package`` for every detail.
    """
    if not isinstance(model, (str, Path)):  # a torch.nn.Module: exported to OUT_DIR/NAME.onnx first
        from edgekit.export import export_for_package

        model, name = export_for_package(model, example_inputs, Path(out_dir), name)
    from edgekit.packager import package as _package

    return _package(
        model,
        targets=targets,
        precision=precision,
        calib=calib,
        eval=eval,
        labels=labels,
        key=key,
        name=name,
        version=version,
        out_dir=out_dir,
        tolerance=tolerance,
        overwrite=overwrite,
        allow_failed=allow_failed,
        input_shapes=input_shapes,
        expires=expires,
        progress=progress,
        options=options,
        preprocess=preprocess,
        log_dir=log_dir,
        objective=objective,
        mixed_precision=mixed_precision,
        threads=threads,
        calib_samples=calib_samples,
        max_drop=max_drop,
        keep_candidates=keep_candidates,
        device_profile=device_profile,
        postprocess=postprocess,
        labels_file=labels_file,
        task=task,
        compress=compress,
        reference=reference,
        train=train,
        train_labels=train_labels,
        cache=cache,
        false_hit_budget=false_hit_budget,
        allow_small_eval=allow_small_eval,
    )


__all__ = ["EdgekitError", "__version__", "package"]
