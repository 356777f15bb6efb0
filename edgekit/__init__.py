"""edgekit: package models for edge targets and sign them into bundles.

``import edgekit`` loads no ML SDK; ``edgekit.package`` imports what a target needs when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgekit.errors import EdgekitError
from edgekit.packaging.request import PackageRequest, takes_request_fields

__version__ = "0.1.0"

if TYPE_CHECKING:
    from edgekit.packaging.result import PackageResult


@takes_request_fields
def package(request: PackageRequest) -> PackageResult:
    """Convert, quantize and validate ``model`` (ONNX) for each of ``targets`` and write one signed
    bundle per target into ``out_dir`` (``NAME-TARGET-vVERSION.ekb``).

    Called as ``edgekit.package(model, targets=..., ...)``: the arguments are ``edgekit.PackageRequest``'s
    (the model, then keywords only; defaults in ``edgekit.package_defaults``), written once there.

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
    See ``edgekit.PackageRequest`` for every setting.
    """
    from edgekit.packaging.orchestrate import package as run

    return run(request)


__all__ = ["EdgekitError", "PackageRequest", "__version__", "package"]
