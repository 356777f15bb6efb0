"""``PackageRequest``: what one packaging run is asked to do, the one type the Python API
(``edgekit.package``) and the command line (``edgekit package``) both build.

Frozen; every setting but the model is keyword-only; every default comes from
``edgekit.package_defaults``. Arguments are checked when the request runs
(``edgekit.packaging.orchestrate.package``), before any conversion: the request only holds them.
``takes_request_fields`` gives a function of a request the request's own signature, so
``edgekit.package("m.onnx", targets=["cpu"])`` is typed by these fields, written once here.
Imports nothing heavy, so ``import edgekit`` stays light.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import KW_ONLY, dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar

from edgekit.package_defaults import (
    DEFAULT_API_OUT_DIR,
    DEFAULT_CALIB_SAMPLES,
    DEFAULT_EXPIRES,
    DEFAULT_FALSE_HIT_BUDGET,
    DEFAULT_OBJECTIVE,
    DEFAULT_PRECISION,
    DEFAULT_TARGETS,
    DEFAULT_VERSION,
)

if TYPE_CHECKING:
    import numpy as np

    from edgekit.bundle.manifest import Tolerance
    from edgekit.validate.postprocess import Postprocess
    from edgekit.validate.preprocess import Preprocess

    # what ``calib`` / ``eval`` / ``train`` take (``edgekit.validate.calib.ArraysLike``)
    Arrays = str | Path | Mapping[str, Any]
    Labels = str | Path | np.ndarray | Sequence[int]


@dataclass(frozen=True)
class PackageRequest:
    """Package ``model`` (ONNX) for ``targets`` and write one signed bundle per target.

    ``calib``: an ``.npz`` (one array per input name, samples on axis 0), an ``.npy`` (one-input
    models), a folder or glob of images (read with ``preprocess``), or a mapping input name ->
    array; optional for fp32/fp16 everywhere (then ``eval`` is the data, or none is used).
    ``eval``: the same kinds, held-out data; an ``.npz`` may hold a ``labels`` array; without
    ``eval`` every 5th calibration sample is held out. ``labels``: class indices of the evaluation
    samples (``.npy`` or array). ``tolerance``: overrides of ``Tolerance`` fields; a key for the
    other output kind (``min_cosine`` on a classifier) is an error. ``precision``: one name for
    every target, or a mapping target -> name (key ``"*"``: the default for targets not named;
    without it ``int8``), each checked against what its target builds. ``options``: target ->
    that target's ``Options`` (or a mapping of its fields). ``expires``: a time, a time from now,
    or an ISO 8601 string; ``DEFAULT_EXPIRES`` (365 days) unless given, ``None`` for a bundle that
    never expires. ``overwrite``: replace existing bundles of the same name and version.
    ``allow_failed``: write the bundles of targets that miss the gate too (marked failed; check
    ``PackageResult.passed``); without it such a target raises ``PackageValidationError``.
    ``log_dir``: keep each target's converter output as ``LOG_DIR/<target>.log``.
    ``compress``: compression steps (``prune-channels=0.5``, ``low-rank=0.5``, ``distill=width=0.5``,
    ``sparsity=0.8``, ``share-weights=16``; ``edgekit.compress.steps``) applied to ``model`` first,
    fine-tuned on ``train`` (+ ``train_labels``) where given; the result is packaged and every gate
    compares with the ORIGINAL model. ``reference``: the original model to gate against when ``model``
    is already compressed (the same inputs and outputs). ``cache``: the result-cache policy the
    manifest declares for the agent (``exact`` or ``approximate``); ``approximate`` calibrates its
    distance threshold on the evaluation data with the FP32 source so that the false-hit rate's
    one-sided 95% bound is within ``false_hit_budget`` (``edgekit.validate.cache_calibration``).

    Every target goes through the optimisation engine (``edgekit.optimize``): ``objective``
    (``latency`` or ``size``) orders the candidates within the gate, ``mixed_precision`` lets an
    explicit ``int8`` keep its most sensitive layers in float (``auto`` always may), ``threads``
    is the device runtime's thread count latency is measured at (0: the runtime's default),
    ``calib_samples`` bounds the stratified calibration subset. ``max_memory_gb``: the run's memory
    bound (None: 3/4 of the memory the machine or its container allows; ``math.inf``: no bound); a
    candidate estimated to need more to build and measure (``edgekit.optimize.memory``) is skipped
    with its reason in the report. ``max_drop``: the accuracy budget
    as a top-1 drop (``Tolerance.max_top1_drop``) for classifiers; dense outputs keep their default
    gate (cosine, relative error). Every candidate is recorded in the manifest and in
    ``OUTDIR/<name>-<target>-v<version>.report.{md,json,png}``. ``keep_candidates``: a folder (new
    or empty) to write every candidate that met the budget into, for ``edgekit bench --profile``
    on the device; ``device_profile``: the ``profile.json`` that wrote, whose latencies the engine
    then chooses by (``edgekit.optimize.profile``). ``preprocess`` / ``postprocess``
    (``--preprocess`` / ``--postprocess``) are recorded in the manifest for the agent to apply
    (images in; boxes, or classes and scores, out), checked against the model's input and output
    shapes first; ``labels_file``: one class name per line, carried in the bundle for the
    post-processing's ``labels`` output. ``task``: how outputs are judged (``classify``,
    ``regress``, ``embed``, ``detect``, ``segment``, or ``{output: task}``).
    A gate decided on fewer than 50 held-out samples is an ``EdgekitWarning`` naming the number; on
    fewer than 10 a ``CalibrationDataError`` unless ``allow_small_eval`` (``edgekit.validate.eval_size``).
    ``model`` may also be a ``torch.nn.Module``: it is exported to ``OUT_DIR/NAME.onnx`` first, called
    on ``example_inputs`` (``edgekit.export.export_for_package``).
    """

    model: str | Path | Any  # Any: a torch.nn.Module, exported first
    _: KW_ONLY
    targets: str | Sequence[str] = DEFAULT_TARGETS
    precision: str | Mapping[str, str] = DEFAULT_PRECISION
    calib: Arrays | None = None
    eval: Arrays | None = None
    labels: Labels | None = None
    key: str | Path | None = None
    name: str | None = None
    version: int = DEFAULT_VERSION
    out_dir: str | Path = DEFAULT_API_OUT_DIR
    tolerance: Tolerance | Mapping[str, float | str | None] | None = None
    overwrite: bool = False
    allow_failed: bool = False
    input_shapes: Mapping[str, Sequence[int]] | None = None
    expires: datetime | timedelta | str | None = DEFAULT_EXPIRES
    progress: Callable[[str], None] | None = None
    options: Mapping[str, Any] | None = None
    preprocess: Preprocess | str | None = None
    log_dir: str | Path | None = None
    objective: str = DEFAULT_OBJECTIVE
    mixed_precision: bool = False
    threads: int = 0
    calib_samples: int = DEFAULT_CALIB_SAMPLES
    max_memory_gb: float | None = None
    max_drop: float | None = None
    keep_candidates: str | Path | None = None
    device_profile: str | Path | None = None
    postprocess: Postprocess | str | None = None
    labels_file: str | Path | None = None
    task: str | Mapping[str, str] | None = None
    compress: Sequence[str] = ()
    reference: str | Path | None = None
    train: Arrays | None = None
    train_labels: Labels | None = None
    cache: str | None = None
    false_hit_budget: float = DEFAULT_FALSE_HIT_BUDGET
    allow_small_eval: bool = False
    example_inputs: Any = None  # a torch model's example inputs, for its export


P = ParamSpec("P")
R = TypeVar("R")


def _with_arguments_of(cls: Callable[P, PackageRequest]) -> Callable[[Callable[[PackageRequest], R]], Callable[P, R]]:
    def wrap(run: Callable[[PackageRequest], R]) -> Callable[P, R]:
        @functools.wraps(run)
        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return run(cls(*args, **kwargs))

        del call.__wrapped__  # help() and inspect show the request's fields, not ``request``
        call.__signature__ = inspect.signature(cls).replace(  # type: ignore[attr-defined]  # read by inspect
            return_annotation=inspect.signature(run).return_annotation
        )
        return call

    return wrap


takes_request_fields = _with_arguments_of(PackageRequest)
"""Decorator: ``run(request) -> R`` becomes ``f(model, *, targets=..., ...) -> R``, called with
``PackageRequest``'s own arguments (a misspelt one is a type error, and a ``TypeError`` at run time)."""


__all__ = ["PackageRequest", "takes_request_fields"]
