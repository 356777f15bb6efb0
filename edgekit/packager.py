"""The host packaging pipeline: one source model -> one signed ``.ekb`` bundle per target.

Order of work (bad combinations are rejected before any conversion starts):

1. check arguments: targets, precision per target, target options, signing key, version;
2. prepare the model once (``compress.onnx_prep``) and read the served signature;
3. check calibration / evaluation data and labels; hold out part of the calibration data
   for evaluation when no ``eval`` is given; compute FP32 reference outputs once;
4. per target: ``check_model``, ``build``, then validate the artifact through the *device*
   runtime (``device_agents.runtimes.load_model``) when it runs here, else through the target's
   intermediate; time it side by side with FP32; write golden vectors; fill and sign the
   manifest; write ``OUTDIR/<name>-<target>-v<version>.ekb``.

An artifact outside the tolerance produces no bundle and raises ``PackageValidationError`` once
every target was tried; with ``allow_failed`` its bundle is written, marked failed in the manifest
(``validation.passed`` false), and the result says so (``PackageResult.passed``; the CLI exits 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle import file_entries, key_id, load_private_key, write_bundle
from edgekit.bundle.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    SIGNATURE_NAME,
    CompressionStep,
    Estimates,
    FileEntry,
    Golden,
    Manifest,
    Signature,
    TensorSpec,
    Tolerance,
    Validation,
    utc_now,
)
from edgekit.errors import (
    CalibrationDataError,
    ConfigError,
    EdgekitError,
    UnsupportedOpError,
    ValidationFailedError,
)
from edgekit.optimize.data import DEFAULT_CALIB_SAMPLES
from edgekit.package_checks import (
    check_data_sources,
    check_input_shapes,
    check_model_path,
    check_out_dir,
    check_tolerance_kind,
    shape_flags,
)
from edgekit.targets import BuildContext, BuildResult, get_target, parse_targets
from edgekit.targets.base import static_signature
from edgekit.targets.options import check_option_targets, resolve_options
from edgekit.targets.precisions import DEFAULT_PRECISION, choose_precisions
from edgekit.targets.sdk_output import sdk_output_to
from edgekit.targets.shape_profile import frozen_axes, profiled_signature, shapes_line
from edgekit.validate.calib import (
    ArraysLike,
    check_arrays,
    data_manifest_fields,
    fixed_batch,
    load_data,
    load_labels,
    pad_samples,
    pop_labels,
    sample_count,
    split_holdout,
    take,
)
from edgekit.validate.detections import DETECTION_MIN_F1, MATCH_IOU, boxes_post
from edgekit.validate.drawn_inputs import drawn_for_validation
from edgekit.validate.eval_size import check_eval_size
from edgekit.validate.latency import LatencyStats, call_with, stats_side_by_side
from edgekit.validate.metrics import (
    MEASURES,
    Comparison,
    Kind,
    RunFn,
    compare,
    kind_of,
    output_kind,
    output_tasks,
    parse_tasks,
    run_all,
    tolerance_with,
)
from edgekit.validate.ort_runner import ort_cpu_runner
from edgekit.validate.postprocess import LABELS_FILE, Postprocess, read_labels_file
from edgekit.validate.preprocess import Preprocess, describe_steps, image_files
from edgekit.validate.table import cpu_only_reason, format_table, result_text

GOLDEN_FILE = "golden.npz"
FLOAT_PRECISIONS = ("fp32", "fp16")  # a target's float candidates: the last resort of its fallback chain
GOLDEN_COUNT = 4
SDK_LOG = "sdk-output.log"  # in each target's work folder: what the converters printed
EVAL_BATCH = 16

# Bundles expire by default (TUF: no metadata lives forever); `--expires-days 0` for none.
DEFAULT_EXPIRES_DAYS = 365
DEFAULT_EXPIRES = timedelta(days=DEFAULT_EXPIRES_DAYS)


@dataclass(frozen=True)
class Row:
    """One line of the validation table (one target): what the manifest records, and the bundle."""

    target: str
    precision: str  # CLI name (int8)
    label: str  # weights/activations (w8a8)
    method: str
    validation: Validation
    failures: tuple[str, ...] = ()
    bundle: Path | None = None
    # engine targets whose FP32 baseline is another measurement than the table's fp32 (another
    # runtime, or a ratio on the other side of 1): (baseline name, its p50 / the artifact's p50),
    # the same side-by-side round; this ratio decides "slower than fp32"
    own_fp32: tuple[str, float] | None = None
    shipped: str = ""  # the candidate shipped and its runtime ("nncf int8 on openvino"); "" without a search
    timed_on: str = ""  # where the latencies were measured ("this host: x86_64 AVX-512 VNNI", a device profile)
    cpu_only: str = ""  # an accelerator target whose artifact runs on the CPU only, and why
    shapes: str = ""  # a static-shape target: the axes it froze and to what, or its TensorRT profile

    @property
    def passed(self) -> bool:
        return self.validation.passed


@dataclass(frozen=True)
class PackageResult:
    bundles: dict[str, Path]  # target -> written .ekb
    rows: tuple[Row, ...]
    manifests: dict[str, Manifest]  # target -> signed manifest (also for failed targets under allow_failed)
    timings_s: dict[str, float] = dataclasses.field(default_factory=dict)  # "prepare", then one per target
    reports: dict[str, Path] = dataclasses.field(default_factory=dict)  # target -> candidate report.md by its bundle
    # target -> why it could not be validated at all (its build raised ValidationFailedError); no row, no bundle
    errors: dict[str, str] = dataclasses.field(default_factory=dict)

    @property
    def passed(self) -> bool:
        """Every target met its validation gate (false when ``allow_failed`` wrote a failed bundle)."""
        return all(r.passed for r in self.rows) and not self.errors

    def table(self) -> str:
        return format_table(self.rows)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: ``passed``, ``bundles`` (target -> path), ``rows`` (the validation table, with each
        target's manifest ``validation`` record) and ``timings_s``."""
        from edgekit.bundle.codec import to_data

        return {
            "passed": self.passed,
            "bundles": {t: str(p) for t, p in self.bundles.items()},
            "rows": [
                {
                    "target": r.target,
                    "precision": r.precision,
                    "label": r.label,
                    "method": r.method,
                    "passed": r.passed,
                    "failures": list(r.failures),
                    "bundle": None if r.bundle is None else str(r.bundle),
                    "shipped": r.shipped or None,
                    "timed_on": r.timed_on or None,
                    "shapes": r.shapes or None,
                    "result": result_text(r),
                    "validation": to_data(r.validation),
                }
                for r in self.rows
            ],
            "timings_s": {k: round(v, 3) for k, v in self.timings_s.items()},
            **({"errors": dict(self.errors)} if self.errors else {}),
        }


class PackageValidationError(ValidationFailedError):
    """One or more targets failed the validation gate; ``result`` holds what was done."""

    def __init__(self, message: str, result: PackageResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class _Run:
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


def package(
    model: str | Path,
    targets: str | Sequence[str] = ("cpu",),
    precision: str | Mapping[str, str] = DEFAULT_PRECISION,
    calib: ArraysLike | None = None,
    eval: ArraysLike | None = None,
    labels: str | Path | np.ndarray | Sequence[int] | None = None,
    key: str | Path | None = None,
    name: str | None = None,
    version: int = 1,
    out_dir: str | Path = ".",
    tolerance: Tolerance | Mapping[str, float | str | None] | None = None,
    overwrite: bool = False,
    allow_failed: bool = False,
    input_shapes: Mapping[str, Sequence[int]] | None = None,
    expires: datetime | timedelta | str | None = DEFAULT_EXPIRES,
    progress: Callable[[str], None] | None = None,
    options: Mapping[str, Any] | None = None,
    preprocess: Preprocess | str | None = None,
    log_dir: str | Path | None = None,
    *,
    objective: str = "latency",
    mixed_precision: bool = False,
    threads: int = 0,
    calib_samples: int = DEFAULT_CALIB_SAMPLES,
    max_drop: float | None = None,
    keep_candidates: str | Path | None = None,
    device_profile: str | Path | None = None,
    postprocess: Postprocess | str | None = None,
    labels_file: str | Path | None = None,
    task: str | Mapping[str, str] | None = None,
    compress: Sequence[str] = (),
    reference: str | Path | None = None,
    train: ArraysLike | None = None,
    train_labels: str | Path | np.ndarray | Sequence[int] | None = None,
    cache: str | None = None,
    false_hit_budget: float = 0.01,
    allow_small_eval: bool = False,
) -> PackageResult:
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
    A gate decided on fewer than 50 held-out samples is an ``EdgekitWarning`` naming the number; on
    fewer than 10 a ``CalibrationDataError`` unless ``allow_small_eval`` (``edgekit.validate.eval_size``).

    Targets with candidates (cpu, intel, jetson, coral, apple) go through the optimisation engine
    (``edgekit.optimize``): ``objective`` (``latency`` or ``size``) orders the candidates within the gate,
    ``mixed_precision`` lets an explicit ``int8`` keep its most sensitive layers in float (``auto``
    always may), ``threads`` is the device runtime's thread count latency is measured at (0: the
    runtime's default), ``calib_samples`` bounds the stratified calibration subset. ``max_drop``: the
    accuracy budget as a top-1 drop (``Tolerance.max_top1_drop``) for classifiers; dense outputs keep
    their default gate (cosine, relative error). Every candidate
    is recorded in the manifest and in ``OUTDIR/<name>-<target>-v<version>.report.{md,json,png}``.
    ``keep_candidates``: a folder (new or empty) to write every candidate that met the budget into,
    for ``edgekit bench --profile`` on the device; ``device_profile``: the ``profile.json`` that
    wrote, whose latencies the engine then chooses by (``edgekit.optimize.profile``).
    ``preprocess`` / ``postprocess`` (``--preprocess`` / ``--postprocess``) are recorded in the
    manifest for the agent to apply (images in; boxes, or classes and scores, out), checked against
    the model's input and output shapes first; ``labels_file``: one class name per line, carried
    in the bundle for the post-processing's ``labels`` output.

    Raises ``ConfigError`` (arguments, exit 2), ``ModelFormatError``, ``CalibrationDataError``,
    ``MissingSDKError`` (exit 4) before any conversion where it can, ``PackageValidationError``
    (exit 3) after every target was tried.
    """
    say = progress or (lambda _msg: None)
    started = time.perf_counter()
    names = parse_targets(targets) if isinstance(targets, str) else parse_targets(",".join(targets))
    chosen = {t: get_target(t) for t in names}
    precisions = choose_precisions(precision, chosen)
    options = dict(options or {})
    check_option_targets(options, names)
    target_options = {t: resolve_options(t, chosen[t].Options, options.get(t)) for t in names}
    tol = tolerance_with(tolerance)
    from edgekit.optimize.run import EngineSettings

    engine = EngineSettings(
        objective=objective,
        mixed_precision=mixed_precision,
        threads=threads,
        calib_samples=calib_samples,
        tolerance=tol,
    )
    profile = None
    if device_profile is not None:
        from edgekit.optimize.profile import DeviceProfile

        profile = DeviceProfile.load(device_profile)
        engine = dataclasses.replace(engine, device_profile=profile)
    keep_dir = None if keep_candidates is None else Path(keep_candidates)
    if keep_dir is not None and keep_dir.exists() and (not keep_dir.is_dir() or any(keep_dir.iterdir())):
        raise ConfigError(f"--keep-candidates {keep_dir}: give a new or empty folder")
    if key is None:
        raise ConfigError("package: a signing key is required (--signing-key); make one with `edgekit keygen`")
    private_key = load_private_key(Path(key))
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ConfigError(f"--version must be an integer >= 1, got {version!r}")
    if isinstance(preprocess, str):
        preprocess = Preprocess.parse(preprocess)
    if isinstance(postprocess, str):
        postprocess = Postprocess.parse(postprocess)
    labels_names = read_labels_file(labels_file) if labels_file is not None else None
    if labels_names is not None and postprocess is None:
        raise ConfigError("--labels-file names the classes of --postprocess topk=K or boxes=yolo; give one of them")
    calib, eval = check_data_sources(calib, eval, precisions)
    model = Path(model)
    check_model_path(model)
    original = Path(reference) if reference is not None else model
    if reference is not None:
        check_model_path(original)
    if (train is not None or train_labels is not None) and not compress:
        raise ConfigError("--train is the compression steps' training data: give --compress STEP with it")
    name = name or _name_from(model)
    _check_name(name)
    expires_at = _expires(expires)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, "-o")
    if log_dir is not None:
        check_out_dir(Path(log_dir), "--log-dir")
    for t in names:
        dest = out_dir / f"{name}-{t}-v{version}.ekb"
        if dest.exists() and not overwrite:
            raise ConfigError(f"{dest} already exists; publish a higher --version, remove it, or pass --overwrite")
    timings: dict[str, float] = {}

    from edgekit.compress.onnx_prep import model_size_bytes, prepare_model, resolve_static_shapes

    with tempfile.TemporaryDirectory(prefix="edgekit-package-") as tmp:
        work = Path(tmp)
        compression: tuple[CompressionStep, ...] = ()
        if compress:
            model, compression = _compress_first(
                model, compress, work, calib, eval, labels, train, train_labels, say, objective=objective, tolerance=tol
            )
        say(f"preparing {model.name}")
        prepared = prepare_model(model, work / "prepared", say)
        if original != model:
            _check_same_interface(original, prepared.served)
        if profile is not None:
            profile.check(prepared.source.sha256, model.name, names)
        given_tasks = parse_tasks(task, [o.name for o in prepared.served.outputs])
        first_output = prepared.served.outputs[0].name
        kind = kind_of(given_tasks, prepared.served) if first_output in given_tasks else output_kind(prepared.served)
        if max_drop is not None:
            if isinstance(max_drop, bool) or not isinstance(max_drop, (int, float)) or not 0 <= max_drop <= 1:
                raise ConfigError(
                    f"--max-drop must be a number in [0, 1] (0.01 = one point of top-1), got {max_drop!r}"
                )
            if kind == "classifier":
                tol = dataclasses.replace(tol, max_top1_drop=float(max_drop))
                engine = dataclasses.replace(engine, tolerance=tol)
            else:
                say(f"--max-drop {max_drop}: dense outputs keep their gate (cosine, relative error)")
        if tolerance is not None and not isinstance(tolerance, Tolerance):
            check_tolerance_kind(tolerance, kind, prepared.served)
        if input_shapes:
            check_input_shapes(prepared.served, input_shapes)
        drawn: tuple[str, ...] = ()
        if calib is None:  # fp32/fp16 without data: inputs drawn within the declared shapes
            calib, note = drawn_for_validation(prepared.path, prepared.served, input_shapes)
            eval, drawn = calib, (note,)
        calib_arrays, eval_arrays, eval_labels = _load_data(
            prepared.served, calib, eval, labels, input_shapes, say, preprocess
        )
        check_eval_size(sample_count(eval_arrays), held_out=eval is None, allow_small=allow_small_eval)
        fp32 = ort_cpu_runner(original)  # the FP32 source (the original), as the device runtime would open it
        say(f"fp32 reference on {sample_count(eval_arrays)} evaluation samples")
        run = _Run(
            served=prepared.served,
            kind=kind,
            tolerance=tol,
            calib=calib_arrays,
            eval=eval_arrays,
            labels=eval_labels,
            reference=run_all(fp32, eval_arrays, _batch(prepared.served, static=False)),
            fp32=fp32,
            source_size=model_size_bytes(original),
            steps=prepared.steps,
            say=say,
            manifest_extras=data_manifest_fields(calib_arrays, calib, prepared.served, preprocess),
            compression=compression,
        )
        if "preprocess" in run.manifest_extras:  # images: the steps they were read with
            say(f"images read with: {describe_steps(run.manifest_extras['preprocess'])}")
        # each output's gate: --task, else from its shape and the fp32 values (named in the validation notes)
        tasks, gate_notes = output_tasks(prepared.served, run.reference, given_tasks)
        run = dataclasses.replace(
            run, kind=kind_of(tasks, prepared.served), tasks=tasks, gate_notes=(*drawn, *gate_notes)
        )
        engine = dataclasses.replace(engine, tasks=tuple(tasks.items()))
        if cache is not None:
            from edgekit.validate.cache_calibration import cache_policy

            declared = cache_policy(
                cache, false_hit_budget, fp32, eval_arrays, run.reference, _batch(prepared.served, static=False), say
            )
            run = dataclasses.replace(run, manifest_extras={**run.manifest_extras, "cache": declared})
        if preprocess is not None or postprocess is not None:
            image = _first_image(eval if eval is not None else calib)
            run = _with_processing(run, preprocess, postprocess, labels_names, labels_file, image)
            engine = dataclasses.replace(engine, post=run.post)
        static_shapes = resolve_static_shapes(prepared.served, run.calib, input_shapes)
        errors: dict[str, str] = {}  # targets that failed: the other targets go on
        for t in names:
            if chosen[t].static_shapes:  # before any conversion: a mismatch found after one wastes it
                _check_static_fit(t, run.eval, static_shapes)
            try:
                chosen[t].check_model(prepared.path)
            except UnsupportedOpError as exc:  # this target's converter cannot take the model; the others can
                if len(names) == 1:
                    raise
                errors[t] = _one_line(exc)
                say(f"[{t}] failed: {errors[t]}")
        bundles: dict[str, Path] = {}
        manifests: dict[str, Manifest] = {}
        rows: list[Row] = []
        failed: list[tuple[str, Comparison, tuple[str, ...]]] = []
        reports: dict[str, Path] = {}
        kept_rows: list[dict[str, Any]] = []
        shared_builds: dict[Any, Any] = {}  # the engine's builds, reused across targets of this call
        timings["prepare"] = time.perf_counter() - started
        for t in names:
            if t in errors:  # refused by its converter's op check
                continue
            target_started = time.perf_counter()
            target_dir = work / t
            for folder in ("bundle", "work"):
                (target_dir / folder).mkdir(parents=True)
            # Converters print to stdout/stderr (C++ included); that goes to a log, our progress does not.
            with (
                _kept_log(target_dir / "work" / SDK_LOG, log_dir, t),
                sdk_output_to(target_dir / "work" / SDK_LOG, say) as target_say,
            ):
                ctx = BuildContext(
                    model_path=prepared.path,
                    served=prepared.served,
                    precision=precisions[t],
                    calib=run.calib,
                    static_shapes=static_shapes,
                    out_dir=target_dir / "bundle",
                    work_dir=target_dir / "work",
                    options=target_options[t],
                    progress=target_say,
                    evaluate=_evaluator(run, static_signature(prepared.served, static_shapes)),
                )
                target_say(f"[{t}] building {precisions[t]}")
                try:
                    built = _build_target(
                        t, chosen[t], ctx, model, engine, shared_builds, keep_dir, run, prepared.source, name, version,
                        private_key, static_shapes,
                    )  # fmt: skip
                    result, searched, ctx = built.result, built.searched, built.ctx
                    kept_rows += built.kept_rows
                    gate_failed: list[str] = []  # the fallback chain: chosen candidates the final gate failed
                    while True:
                        manifest, comparison, row = _validate_and_describe(
                            t,
                            precisions[t],
                            result,
                            ctx,
                            dataclasses.replace(run, say=target_say),
                            prepared.source,
                            name,
                            version,
                            expires_at,
                            private_key,
                            static_shapes,
                            searched,
                        )
                        if comparison.passed or built.optimised is None:
                            break
                        nxt = _fall_back(chosen[t], ctx, built, comparison, engine, target_say)
                        if nxt is None:
                            break
                        gate_failed.append(searched.chosen.name)
                        built = nxt
                        result, searched = built.result, built.searched
                # One target's failure never stops the others: a converter may raise anything (coremltools
                # on an op it lacks, LiteRT's converter on a select op); with one target, its own error.
                except Exception as exc:
                    if len(names) == 1 and not isinstance(exc, ValidationFailedError):
                        raise
                    errors[t] = _one_line(exc)
                    say(f"[{t}] failed: {errors[t]}")
                    timings[t] = time.perf_counter() - target_started
                    continue
            if not comparison.passed:
                tried = result.notes if searched is None else _tried_notes(searched, precisions[t])
                if searched is not None and (gate_failed or searched.chosen.precision in FLOAT_PRECISIONS):
                    tried += (_chain_note(gate_failed, searched.chosen),)
                failed.append((t, comparison, tried))
            if searched is not None:  # written whether or not the bundle is: it says why
                from edgekit.optimize.report import write_report

                images = describe_steps(run.manifest_extras.get("preprocess", ()))  # "" for arrays
                reports[t] = write_report(searched, out_dir / f"{name}-{t}-v{version}", t, comparison.passed, images)
                say(f"[{t}] candidate report {reports[t]}")
            if comparison.passed or allow_failed:
                dest = out_dir / f"{name}-{t}-v{version}.ekb"
                bundles[t] = write_bundle(manifest, ctx.out_dir, private_key, dest)
                manifests[t] = manifest
                say(f"[{t}] wrote {dest}" + ("" if comparison.passed else " (marked: failed validation)"))
            rows.append(dataclasses.replace(row, bundle=bundles.get(t)))
            timings[t] = time.perf_counter() - target_started
        if keep_dir is not None:
            from edgekit.optimize.profile import write_index

            index = write_index(keep_dir, name, prepared.source.sha256, kept_rows, utc_now())
            say(f"kept {len(kept_rows)} candidate(s) for on-device timing: {index}")
    result_all = PackageResult(
        bundles=bundles, rows=tuple(rows), manifests=manifests, timings_s=timings, reports=reports, errors=errors
    )
    if errors or (failed and not allow_failed):
        message = _failure_message(failed, precisions, reports) if failed else ""
        could_not = "\n".join(f"{t} {precisions[t]}: {why}" for t, why in errors.items())
        raise PackageValidationError("\n".join(m for m in (could_not, message) if m), result_all)
    return result_all


@dataclass(frozen=True)
class _Built:
    result: BuildResult
    searched: Any  # SearchResult for an engine target, else None
    ctx: BuildContext
    kept_rows: list[dict[str, Any]]
    optimised: Any = None  # edgekit.optimize.run.Optimised for an engine target: its fallback chain


def _fall_back(
    target: Any, ctx: BuildContext, built: _Built, comparison: Comparison, engine: Any, say: Callable[[str], None]
) -> _Built | None:
    """The next candidate of an engine target's fallback chain, finished into an emptied
    ``ctx.out_dir``, after the final gate failed ``built``'s; None when the chain is spent."""
    from edgekit.optimize.run import fall_back

    failure = "; ".join(comparison.failures)

    def empty() -> None:
        shutil.rmtree(ctx.out_dir)
        ctx.out_dir.mkdir(parents=True)

    nxt = fall_back(target, ctx, built.optimised, failure, engine, before_finish=empty)
    if nxt is None:
        return None
    say(
        f"[{target.name}] {built.searched.chosen.name} failed the final gate ({failure}); "
        f"next in the fallback chain: {nxt.search.chosen.name}"
    )
    return _Built(nxt.build, nxt.search, ctx, [], nxt)


def _one_line(exc: BaseException) -> str:
    """A target's failure in one line: our own errors by their message (it says what to do), any
    other by its type and message."""
    text = " ".join(str(exc).split())
    return text if isinstance(exc, EdgekitError) else f"{type(exc).__name__}: {text}"[:500]


def _chain_note(gate_failed: Sequence[str], last: Any) -> str:
    """What the failure message says of a fallback chain that ran out (``last``: what failed last)."""
    floats = last.precision in FLOAT_PRECISIONS
    what = "the target's float candidate" if floats else "the last candidate that met the budget"
    if not gate_failed:
        return f"fallback chain: {last.name}, {what}, failed the final gate"
    return f"fallback chain: {', '.join(gate_failed)} failed the final gate before {last.name}, {what}, failed it too"


def _build_target(
    t: str,
    target: Any,
    ctx: BuildContext,
    model: Path,
    engine: Any,
    shared_builds: dict[Any, Any],
    keep_dir: Path | None,
    run: _Run,
    source: Any,
    name: str,
    version: int,
    private_key: Any,
    static_shapes: Mapping[str, tuple[int, ...]],
) -> _Built:
    """Build target ``t``: through the optimisation engine when it describes candidates, else directly."""
    searched = optimised = None
    kept_rows: list[dict[str, Any]] = []
    if hasattr(target, "candidates"):  # an engine target: candidates searched side by side
        from edgekit.optimize.run import optimise

        ctx = dataclasses.replace(ctx, source_path=model)
        optimised = optimise(
            target, ctx, engine, reference_path=model, shared=shared_builds, holdout_reference=run.reference
        )
        result, searched = optimised.build, optimised.search
        if keep_dir is not None:
            kept_rows = _keep_candidates(
                keep_dir, t, target, ctx, searched, run, source, name, version, private_key, static_shapes
            )
    else:
        result = target.build(ctx)
    if result.static and not target.static_shapes:
        raise EdgekitError(f"target {t} built a static-shape artifact but does not declare static_shapes")
    return _Built(result, searched, ctx, kept_rows, optimised)


# -- compression first (--compress) ----------------------------------------------------------


def _compress_first(
    model: Path,
    steps: Sequence[str],
    work: Path,
    calib: ArraysLike | None,
    eval: ArraysLike | None,
    labels: str | Path | np.ndarray | Sequence[int] | None,
    train: ArraysLike | None,
    train_labels: str | Path | np.ndarray | Sequence[int] | None,
    say: Callable[[str], None],
    objective: str = "latency",
    tolerance: Tolerance | None = None,
) -> tuple[Path, tuple[CompressionStep, ...]]:
    """Run the ``--compress`` steps on ``model``; (the compressed model, its provenance).
    ``--compress auto``: the variant that beats the quantized original, or the original
    (``edgekit.compress.auto``)."""
    from edgekit.compress.auto import is_auto
    from edgekit.compress.steps import Data, compress, parse_step
    from edgekit.validate.calib import load_arrays, load_labels, sample_count

    auto = is_auto(steps)
    parsed = [] if auto else [parse_step(s) for s in steps]
    source = eval if eval is not None else calib
    if source is None or (isinstance(source, (str, Path)) and Path(source).is_dir()):
        raise CalibrationDataError(
            "--compress measures every step against the original on data: give --eval (or --calib) as an .npz"
        )
    evaluation = load_arrays(source, "--eval data" if eval is not None else "--calib data")
    evaluation.pop("labels", None)
    eval_labels = None
    if labels is not None and eval is not None:
        eval_labels = load_labels(labels, sample_count(evaluation), "--labels")
    training = None if train is None else load_arrays(train, "--train data")
    train_y = None
    if train_labels is not None and training is not None:
        train_y = load_labels(train_labels, sample_count(training), "--train-labels")
    if auto:
        from edgekit.compress.auto import choose

        usable = calib is not None and not (isinstance(calib, (str, Path)) and Path(calib).is_dir())
        calib_arrays = load_arrays(calib, "--calib data") if usable else dict(evaluation)  # type: ignore[arg-type]
        calib_arrays.pop("labels", None)
        data = Data(evaluation, eval_labels, training, train_y)
        chosen = choose(
            model, work / "auto", data, calib_arrays, objective=objective, tolerance=tolerance, progress=say
        )
        return chosen.model, chosen.provenance
    out = work / "compressed" / f"{model.stem}.onnx"
    result = compress(model, parsed, out, Data(evaluation, eval_labels, training, train_y), progress=say)
    for o in result.outcomes:
        say(f"{o.step}: {o.size_bytes:,} bytes, {o.speedup:.2f}x the original's speed here, {o.comparison.summary()}")
    return out, tuple(o.provenance for o in result.outcomes)


def _check_same_interface(original: Path, served: Signature) -> None:
    import onnx

    from edgekit.compress.onnx_prep import served_signature

    want = served_signature(onnx.load(str(original), load_external_data=False))
    names = ([s.name for s in want.inputs], [s.name for s in want.outputs])
    got = ([s.name for s in served.inputs], [s.name for s in served.outputs])
    if names != got:
        raise ConfigError(
            f"--reference {original.name} has inputs {names[0]} and outputs {names[1]}; the model has {got[0]} and "
            f"{got[1]}: the reference must be the model this one was compressed from"
        )


# -- arguments -----------------------------------------------------------------------------


def _name_from(model: Path) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in model.stem) or "model"


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise ConfigError(f"--name {name!r}: use letters, digits, '-', '_' or '.'")


def _expires(value: datetime | timedelta | str | None) -> str | None:
    if value is None:
        return None
    if isinstance(value, timedelta):
        value = datetime.now(timezone.utc) + value
    if isinstance(value, str):
        from edgekit.bundle.manifest import parse_time

        try:
            value = parse_time(value)
        except EdgekitError as exc:
            raise ConfigError(f"expires: {value!r} is not an ISO 8601 time") from exc
    if value.tzinfo is None:
        value = value.replace(tzinfo=timezone.utc)
    if value <= datetime.now(timezone.utc):
        raise ConfigError(f"expires: {value.isoformat()} is in the past")
    return value.astimezone(timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


# -- data ----------------------------------------------------------------------------------


def _load_data(
    served: Signature,
    calib: ArraysLike,
    eval_data: ArraysLike | None,
    labels: Any,
    input_shapes: Mapping[str, Sequence[int]] | None,
    say: Callable[[str], None],
    preprocess: Preprocess | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray | None]:
    """Checked calibration and evaluation arrays, and the evaluation labels (``labels``, else a
    ``labels`` array inside the evaluation data). ``eval_data is calib``: the same data does both
    (fp32/fp16 without calibration), nothing is held out.

    Calibration and evaluation files are read the same way (``load_data`` + ``pop_labels``): a
    ``labels`` array (``edgekit calib make --labels-from-folders``) is the samples' classes in
    either. In the calibration data it labels the samples held out for validation when no
    ``--eval`` is given, and is not needed (said so) when ``--eval`` is."""
    check_against = _with_static_inputs(served, input_shapes) if input_shapes else served
    set_by = shape_flags(served, input_shapes)
    same = eval_data is calib
    calib_raw = load_data(calib, served, "evaluation data" if same else "calibration data", preprocess)
    inline = pop_labels(calib_raw, served)
    if inline is not None and eval_data is not None and not same:
        say("calibration data: its 'labels' array is not used (the evaluation data, --eval, is what is gated)")
    calib_arrays = check_arrays(calib_raw, check_against, "calibration data", set_by)
    if same:
        eval_arrays = calib_arrays
        eval_labels = _labels(labels, inline, sample_count(eval_arrays))
    elif eval_data is not None:
        eval_raw = load_data(eval_data, served, "evaluation data", preprocess)
        inline = pop_labels(eval_raw, served)
        eval_arrays = check_arrays(eval_raw, check_against, "evaluation data", set_by)
        eval_labels = _labels(labels, inline, sample_count(eval_arrays))
    else:
        all_labels = _labels(labels, inline, sample_count(calib_arrays), "calibration data")
        calib_arrays, eval_arrays, eval_labels = split_holdout(calib_arrays, all_labels)
        say(
            f"no evaluation data given: holding out {sample_count(eval_arrays)} of "
            f"{sample_count(eval_arrays) + sample_count(calib_arrays)} calibration samples for validation"
        )
    batch = fixed_batch(served)
    for what, arrays in (("calibration data", calib_arrays), ("evaluation data", eval_arrays)):
        if batch and sample_count(arrays) % batch:
            raise CalibrationDataError(
                f"{what}: {sample_count(arrays)} samples is not a multiple of the model's fixed batch {batch}"
            )
    return calib_arrays, eval_arrays, eval_labels


def _labels(given: Any, inline: np.ndarray | None, count: int, what: str = "evaluation data") -> np.ndarray | None:
    if given is not None and inline is not None:
        raise CalibrationDataError(f"{what} holds a 'labels' array and --labels was given too; keep one of them")
    source = given if given is not None else inline
    return None if source is None else load_labels(source, count)


@contextlib.contextmanager
def _kept_log(log: Path, log_dir: str | Path | None, target: str) -> Iterator[None]:
    """Copy the target's converter log to ``LOG_DIR/<target>.log`` when the target is done (or failed)."""
    try:
        yield
    finally:
        if log_dir is not None and log.exists():
            shutil.copyfile(log, Path(log_dir) / f"{target}.log")


def _with_static_inputs(served: Signature, shapes: Mapping[str, Sequence[int]] | None) -> Signature:
    """``served`` with the given input shapes fixed (axis 0, the samples axis, stays as it was)."""
    shapes = shapes or {}
    inputs = []
    for spec in served.inputs:
        if spec.name in shapes and len(shapes[spec.name]) == len(spec.shape):
            dims = (spec.shape[0], *(int(d) for d in shapes[spec.name][1:]))
            spec = dataclasses.replace(spec, shape=dims)
        inputs.append(spec)
    return dataclasses.replace(served, inputs=tuple(inputs))


def _batch(served: Signature, static: bool) -> int:
    return fixed_batch(served) or (1 if static else EVAL_BATCH)


def _evaluator(run: _Run, static: Signature) -> Callable[[RunFn], Comparison]:
    # At the static batch (1 unless --input-shape fixes another), short batches padded: a target
    # may hand in a candidate that takes static shapes only.
    batch = _batch(static, static=True)

    def evaluate(fn: RunFn) -> Comparison:
        outputs = run_all(fn, run.eval, batch, pad=True)
        return compare(run.reference, outputs, run.kind, run.tolerance, run.labels, run.tasks, run.post)

    return evaluate


# -- validation, golden vectors, manifest ----------------------------------------------------


def _validate_and_describe(
    target: str,
    precision: str,
    result: BuildResult,
    ctx: BuildContext,
    run: _Run,
    source: Any,
    name: str,
    version: int,
    expires: str | None,
    private_key: Any,
    static_shapes: Mapping[str, tuple[int, ...]],
    searched: Any = None,  # edgekit.optimize.engine.SearchResult for engine targets
) -> tuple[Manifest, Comparison, Row]:
    for path in result.files:
        if path in (GOLDEN_FILE, MANIFEST_NAME, SIGNATURE_NAME):
            raise EdgekitError(f"target {target} wrote {path!r}, a name the packager owns")
    served = static_signature(run.served, static_shapes) if result.static else run.served
    served = profiled_signature(served, result.target_options)  # a TensorRT profile's fixed axes
    artifact_files = file_entries(ctx.out_dir, result.files)
    size = sum(f.size_bytes for f in artifact_files if f.role == "artifact")
    provisional = _manifest(
        name,
        version,
        target,
        result,
        served,
        source,
        (*artifact_files, _placeholder_golden()),
        _placeholder_validation(run),
        Golden(file=GOLDEN_FILE, count=0),
        expires,
        private_key,
    )
    batch = _batch(served, result.static)
    pad = fixed_batch(served) is not None  # a fixed batch takes exactly `batch` samples per call
    latency: dict[str, LatencyStats] = {}
    served_model = None
    if result.runnable_here:
        from device_agents.runtimes import load_model

        served_model = load_model(ctx.out_dir, provisional)
        fn: RunFn = served_model.infer
        measured_on = _host_description(served_model.runner.describe())
    elif result.intermediate is not None:
        fn = result.intermediate
        measured_on = f"intermediate ({result.intermediate_name or 'target-provided'}) on the host"
    else:
        raise EdgekitError(f"target {target} can neither run its artifact here nor gave an intermediate to validate")
    try:
        run.say(f"[{target}] validating on {sample_count(run.eval)} held-out samples ({measured_on})")
        outputs = run_all(fn, run.eval, batch, pad=pad)
        comparison = compare(run.reference, outputs, run.kind, run.tolerance, run.labels, run.tasks, run.post)
        if result.static:  # the frozen artifact's outputs have one shape: serve that one
            served = _concrete_outputs(served, outputs)
        if searched is not None:
            # the engine timed the chosen candidate side by side with the FP32 source in one loop
            if searched.chosen.latency is not None and searched.reference_latency is not None:
                latency = {"artifact": searched.chosen.latency, "fp32": searched.reference_latency}
        elif served_model is not None:
            one = pad_samples(take(run.eval, 0, batch if pad else 1), batch if pad else 1)
            run.say(f"[{target}] timing the artifact side by side with fp32")
            latency = stats_side_by_side(
                {"fp32": call_with(run.fp32, one), "artifact": call_with(served_model.infer, one)}, repeats=20
            )
        artifact = fn if served_model is not None else None
        golden = _write_golden(ctx.out_dir, run, served, artifact, comparison, outputs)
        from edgekit.validate.row_independence import check_golden_rows

        rows = check_golden_rows(fn, ctx.out_dir / GOLDEN_FILE, served, golden)
        run.say(f"[{target}] {rows.line()}")
    finally:
        if served_model is not None:
            served_model.close()
    for path, (src, _) in run.bundle_files.items():
        shutil.copyfile(src, ctx.out_dir / path)
    files = file_entries(
        ctx.out_dir, {**result.files, GOLDEN_FILE: "golden", **{p: role for p, (_, role) in run.bundle_files.items()}}
    )
    # slower than FP32 on the artifact's own runtime (the engine's baseline), else than the FP32 source
    slower: bool | None = None
    slower_note: tuple[str, ...] = ()
    if not comparison.passed:
        pass  # "slower" is said of an artifact that passed; a failed one is failed
    elif searched is not None and searched.baseline is not None and searched.chosen.latency is not None:
        from edgekit.optimize.record import baseline_note

        slower = searched.slower_than_fp32
        slower_note = baseline_note(searched)
        if slower:
            slower_note += (
                f"slower than fp32: {searched.chosen.name} p50 {searched.chosen.p50_ms:.3f} ms vs "
                f"{searched.baseline.name} {searched.baseline.p50_ms:.3f} ms on the same runtime",
            )
    elif latency:
        slower = latency["artifact"].p50_ms > latency["fp32"].p50_ms
    validation = Validation(
        passed=comparison.passed,
        kind=comparison.kind,
        samples=comparison.samples,
        tolerance=run.tolerance,
        **{k: getattr(comparison, k) for k in MEASURES},
        size_bytes=size,
        size_ratio=size / run.source_size if run.source_size else None,
        latency_p50_ms=latency["artifact"].p50_ms if latency else None,
        fp32_latency_p50_ms=latency["fp32"].p50_ms if latency else None,
        latency_p90_ms=latency["artifact"].p90_ms if latency else None,
        latency_iqr_ms=latency["artifact"].iqr_ms if latency else None,
        measured_on=measured_on,
        notes=(
            *(f"prepared: {s}" for s in run.steps),
            *run.gate_notes,
            *((f"held-out {comparison.detections}",) if comparison.detections else ()),
            *(frozen_axes(run.served, static_shapes) if result.static else ()),
            *result.notes,
            *slower_note,
        ),
        failures=comparison.failures,
        slower_than_fp32=slower,
    )
    # provenance starts at the source model: the shared preparation, then the target's own steps
    prepared = tuple(CompressionStep(kind="prepare", tool="edgekit", notes=step) for step in run.steps)
    result = dataclasses.replace(result, provenance=(*run.compression, *prepared, *result.provenance))
    manifest = _manifest(name, version, target, result, served, source, files, validation, golden, expires, private_key)
    manifest = dataclasses.replace(manifest, **run.manifest_extras, rows_independent=rows.independent)
    if result.runnable_here and manifest.estimates is None:
        manifest = dataclasses.replace(manifest, estimates=_memory_estimates(ctx.out_dir, manifest, measured_on, run))
    if searched is not None:
        from edgekit.optimize.record import calibration_data, candidate_report, with_excluded

        given = run.manifest_extras.get("calibration")
        manifest = dataclasses.replace(
            manifest,
            precision=with_excluded(manifest.precision, searched),
            candidates=candidate_report(searched, run.tolerance, measured_on),
            # the subset the engine calibrated on, not every sample given
            calibration=calibration_data(searched, given.source if given is not None else ""),
        )
    row = Row(
        target, precision, result.precision.label, result.precision.method, validation, comparison.failures,
        own_fp32=_own_fp32(searched, validation),
        shipped=f"{searched.chosen.name} on {manifest.compatibility.runtime}" if searched is not None else "",
        timed_on=_timed_on(searched, validation), cpu_only=cpu_only_reason(manifest),
        shapes=shapes_line(target, run.served, static_shapes, result.static, result.target_options),
    )  # fmt: skip
    return manifest, comparison, row


def _with_processing(
    run: _Run,
    preprocess: Preprocess | None,
    postprocess: Postprocess | None,
    labels: tuple[str, ...] | None,
    labels_file: str | Path | None,
    image: Path | None = None,
) -> _Run:
    """``run`` with the manifest's processing steps (checked against the model's shapes) and the
    labels file. The post-processing runs here, on the FP32 outputs of an evaluation sample, as
    the agent will run it: a step that cannot apply fails the packaging, not the device. ``image``
    (the first image file of the data, if any) goes into the golden vectors with the whole
    pipeline's answer, which the device's self-test checks."""
    from device_agents.processing.post import Postprocessor

    extras = dict(run.manifest_extras)
    bundle_files = dict(run.bundle_files)
    if preprocess is not None and "preprocess" not in extras:  # given for the agent, not for reading images
        if len(run.served.inputs) != 1:
            raise ConfigError(f"--preprocess: the model has {len(run.served.inputs)} inputs; images feed one")
        extras["preprocess"] = preprocess.to_steps(run.served.inputs[0])
    if postprocess is not None:
        steps = postprocess.to_steps(run.served, labels, run.reference, run.say)
        if labels_file is not None:
            bundle_files[LABELS_FILE] = (Path(labels_file), "labels")
        post = Postprocessor(steps, run.served.outputs, lambda _path: Path(labels_file or "").read_bytes())
        one = {k: v[:1] for k, v in run.reference.items()}
        found = post.run(one, None)
        run.say(f"post-processing: {', '.join(f'{k} {list(v.shape)}' for k, v in found.items())} on one sample")
        extras["postprocess"] = steps
        if boxes_post(post):
            gate = (
                f"gate: output {post.tensor!r} judged by its detections after the post-processing: matched to fp32's "
                f"at IoU {MATCH_IOU:g}, F1 >= {DETECTION_MIN_F1:g} (its worst channel's cosine does not veto)"
            )
            run = dataclasses.replace(run, post=post, gate_notes=(*run.gate_notes, gate))
    golden = image.read_bytes() if image is not None and "preprocess" in extras and postprocess is not None else None
    return dataclasses.replace(run, manifest_extras=extras, bundle_files=bundle_files, golden_image=golden)


def _first_image(source: ArraysLike | None) -> Path | None:
    """The first image file of a folder or glob of images, else None."""
    if source is None or isinstance(source, Mapping):
        return None
    files = image_files(source)
    return files[0] if files else None


def _golden_image(run: _Run, served: Signature, fn: RunFn) -> dict[str, np.ndarray]:
    """The golden vectors' image entries: ``run.golden_image`` through the whole pipeline with ``fn``."""
    from device_agents.processing.golden import golden_arrays, run_pipeline
    from device_agents.processing.signature import image_input_of

    if run.golden_image is None:
        return {}
    pre, post = run.manifest_extras["preprocess"], run.manifest_extras["postprocess"]
    batch = fixed_batch(served) or 1

    def infer(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {k: v[:1] for k, v in fn(pad_samples(feed, batch)).items()}

    files = {path: src for path, (src, _) in run.bundle_files.items()}
    answer = run_pipeline(pre, post, served, run.golden_image, infer, lambda path: files[path].read_bytes())
    name = image_input_of(pre, served)
    run.say(f"golden image: {len(answer['scores'])} result(s) from the whole pipeline, checked by the self-test")
    return golden_arrays(name or served.inputs[0].name, run.golden_image, answer)


def _own_fp32(searched: Any, v: Validation) -> tuple[str, float] | None:
    """The table's second ratio (see ``Row.own_fp32``), or None when it would say nothing new."""
    if searched is None or searched.baseline is None or v.latency_p50_ms is None or not v.fp32_latency_p50_ms:
        return None
    from edgekit.optimize.report import speed_vs_baseline

    own = speed_vs_baseline(searched)
    if own is None or searched.baseline.name == searched.chosen.name or searched.chosen.latency_from:
        return None  # with a device profile the table's ratio already is to the target's own FP32
    vs_source = v.fp32_latency_p50_ms / v.latency_p50_ms
    if searched.baseline.runtime == "onnxruntime" and (own >= 1.0) == (vs_source >= 1.0):
        return None
    return searched.baseline.name, own


def _keep_candidates(
    root: Path,
    target: str,
    target_obj: Any,
    ctx: BuildContext,
    searched: Any,
    run: _Run,
    source: Any,
    name: str,
    version: int,
    private_key: Any,
    static_shapes: Mapping[str, tuple[int, ...]],
) -> list[dict[str, Any]]:
    """Each candidate that met the budget (and the baseline) as an opened-bundle folder for
    ``edgekit bench --profile``: the target's files, one input in ``golden.npz``, an unsigned
    manifest marked not validated."""
    from edgekit.optimize.profile import NOT_VALIDATED, candidate_key, keep_candidates

    outcomes = {o.name: o for o in searched.outcomes}
    kept = [
        (n, candidate_key(outcomes[n].runtime, outcomes[n].precision, outcomes[n].settings), outcomes[n].runtime,
         outcomes[n].precision, folder.name)
        for n, (_, folder) in searched.kept.items()
    ]  # fmt: skip

    def describe(candidate: str, dest: Path) -> None:
        built, folder = searched.kept[candidate]
        scratch = ctx.work_dir / "kept" / folder.name
        scratch.mkdir(parents=True)
        result = target_obj.finish(dataclasses.replace(ctx, out_dir=dest, work_dir=scratch), built, folder)
        served = static_signature(run.served, static_shapes) if result.static else run.served
        n = fixed_batch(served) or 1
        feed = pad_samples(take(run.eval, 0, n), n)
        np.savez(dest / GOLDEN_FILE, **{f"in_{k}": v for k, v in feed.items()})  # type: ignore[arg-type]  # numpy's savez kwargs stub is too narrow
        validation = dataclasses.replace(_placeholder_validation(run), notes=(NOT_VALIDATED,))
        manifest = _manifest(
            name, version, target, dataclasses.replace(result, notes=(NOT_VALIDATED, *result.notes)), served, source,
            file_entries(dest, {**result.files, GOLDEN_FILE: "golden"}), validation,
            Golden(file=GOLDEN_FILE, count=n), None, private_key,
        )  # fmt: skip
        (dest / MANIFEST_NAME).write_bytes(manifest.to_json())

    return keep_candidates(root, target, kept, describe)


def _write_golden(
    out_dir: Path,
    run: _Run,
    served: Signature,
    artifact: RunFn | None,
    comparison: Comparison,
    measured: Mapping[str, np.ndarray],
) -> Golden:
    """A few evaluation samples with expected outputs: the artifact's own where it runs here
    (tight tolerance), else FP32 outputs under the validation tolerance. ``measured``: what the
    artifact (or its intermediate) gave on the evaluation samples."""
    fixed = fixed_batch(served)
    count = min(GOLDEN_COUNT, sample_count(run.eval))
    if fixed:  # whole batches of a static batch size: the self-test runs them one batch at a time
        count = fixed * max(1, count // fixed)
    chosen = _golden_samples(run, measured if artifact is None else None)[:count]
    # padded: a fixed batch larger than the evaluation set
    inputs = pad_samples({k: v[chosen] for k, v in run.eval.items()}, count)
    if artifact is not None:
        expected = run_all(artifact, inputs, fixed or count)
        # Another CPU's kernels (e.g. int8 without VNNI) may differ from this host's by about as much
        # as the artifact differs from FP32; a tighter atol would fail healthy devices.
        atol = max(1e-3, comparison.max_abs_error or 0.0)
        golden = Golden(file=GOLDEN_FILE, count=count, min_cosine=0.99, atol=_round_up(atol), rtol=1e-2)
    else:
        expected = pad_samples({k: v[chosen] for k, v in run.reference.items()}, count)
        t = run.tolerance
        golden = Golden(
            file=GOLDEN_FILE,
            count=count,
            min_cosine=t.min_cosine if t.min_cosine is not None else 0.96,
            atol=_round_up(max(1e-3, 2 * (comparison.max_abs_error or 0.0))),
            rtol=0.1,
            min_top1_agreement=t.min_top1_agreement if run.kind == "classifier" else None,
        )
    arrays = {f"in_{k}": v for k, v in inputs.items()} | {f"out_{k}": v for k, v in expected.items()}
    arrays |= _golden_image(run, served, artifact if artifact is not None else run.fp32)
    np.savez(out_dir / GOLDEN_FILE, **arrays)  # type: ignore[arg-type]  # numpy's savez kwargs stub is too narrow
    return golden


def _check_static_fit(target: str, arrays: Mapping[str, np.ndarray], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """Evaluation samples must have the static shape a static artifact takes (axis 0 aside)."""
    for name, shape in shapes.items():
        got = tuple(arrays[name].shape[1:])
        if got != tuple(shape[1:]):
            raise ConfigError(
                f"evaluation data: input {name!r} has samples of shape {list(got)}, but the {target} artifact takes "
                f"the static shape {list(shape)} (from --input-shape, else the calibration data); give --eval data "
                f"of shape [N, {', '.join(map(str, shape[1:]))}] or --input-shape {name}=... matching both"
            )


def _golden_samples(run: _Run, measured: Mapping[str, np.ndarray] | None) -> np.ndarray:
    """Evaluation sample indices for golden vectors. Where the expected outputs are FP32's and the
    gate is top-1 agreement, samples on which the validated artifact agreed come first: a device
    faithful to that artifact must be able to reproduce every golden top-1."""
    n = sample_count(run.eval)
    if measured is None or run.kind != "classifier":
        return np.arange(n)
    first = next(iter(run.reference))
    agree = run.reference[first].reshape(n, -1).argmax(-1) == np.asarray(measured[first]).reshape(n, -1).argmax(-1)
    return np.concatenate([np.flatnonzero(agree), np.flatnonzero(~agree)])


def _round_up(x: float) -> float:
    """``x`` to 3 significant digits, rounded up (a tolerance must not shrink below what was seen)."""
    if x <= 0:
        return 0.0
    scale = 10.0 ** (math.floor(math.log10(x)) - 2)
    return float(f"{math.ceil(x / scale) * scale:.3g}")


def _concrete_outputs(served: Signature, outputs: Mapping[str, np.ndarray]) -> Signature:
    """A frozen (static-shape) signature whose outputs keep no symbolic dim the artifact fixed:
    each is what it produced (``outputs``: the validation run's, samples on axis 0), axis 0 the
    inputs' fixed batch (a YOLOv8 head's ``anchors`` and box-channel dims are no input's)."""
    batch = fixed_batch(served)
    specs = []
    for o in served.outputs:
        got = outputs.get(o.name)
        if got is not None and got.ndim == len(o.shape):
            shape = tuple(
                d if isinstance(d, int) else (batch if axis == 0 else int(got.shape[axis]))
                for axis, d in enumerate(o.shape)
            )
            o = dataclasses.replace(o, shape=tuple(d if d is not None else o.shape[0] for d in shape))
        specs.append(o)
    return dataclasses.replace(served, outputs=tuple(specs))


def _placeholder_golden() -> FileEntry:
    # The provisional manifest only opens the artifact; the runtime never reads the golden file.
    return FileEntry(path=GOLDEN_FILE, size_bytes=0, sha256="0" * 64, role="golden")


def _placeholder_validation(run: _Run) -> Validation:
    return Validation(passed=False, kind=run.kind, samples=0, tolerance=run.tolerance)


def _memory_estimates(out_dir: Path, manifest: Manifest, measured_on: str, run: _Run) -> Estimates | None:
    """The artifact's memory on the host (load + first inference, in a fresh process), for the
    device's memory budget until it has measured its own; None (and a note) if it cannot be measured."""
    from device_agents.budgets.footprint import measure_in_child

    try:
        with tempfile.TemporaryDirectory() as tmp:
            got = measure_in_child(out_dir, manifest, Path(tmp))
    except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as exc:
        run.say(f"[{manifest.target}] memory not measured: {exc}")
        return None
    return Estimates(memory_mb=got["memory_mb"], peak_memory_mb=got["peak_memory_mb"], measured_on=measured_on)


def _manifest(
    name: str,
    version: int,
    target: str,
    result: BuildResult,
    served: Signature,
    source: Any,
    files: Sequence[FileEntry],
    validation: Validation,
    golden: Golden,
    expires: str | None,
    private_key: Any,
) -> Manifest:
    return Manifest(
        schema_version=SCHEMA_VERSION,
        name=name,
        version=version,
        created=utc_now(),
        expires=expires,
        signer_key_id=key_id(private_key.public_key()),
        target=target,
        compatibility=result.compatibility,
        source=source,
        files=tuple(files),
        signature=served,
        artifact_signature=_artifact_signature(result, served),
        mapping=result.mapping,
        precision=result.precision,
        validation=validation,
        golden=golden,
        op_placement=result.op_placement,
        target_options=dict(result.target_options),
        provenance=result.provenance,
    )


def _artifact_signature(result: BuildResult, served: Signature) -> Signature:
    # A target that keeps the served interface (e.g. cpu) returns ``served`` as its artifact
    # signature; under static shapes the artifact is then as static as the served one.
    if result.static and result.artifact_signature.inputs and _same_names(result.artifact_signature, served):
        return Signature(
            inputs=tuple(
                dataclasses.replace(a, shape=s.shape) if a.shape != s.shape and _dynamic(a) else a
                for a, s in zip(result.artifact_signature.inputs, served.inputs, strict=True)
            ),
            outputs=result.artifact_signature.outputs,
        )
    return result.artifact_signature


def _same_names(a: Signature, b: Signature) -> bool:
    return [s.name for s in a.inputs] == [s.name for s in b.inputs]


def _dynamic(spec: TensorSpec) -> bool:
    return any(isinstance(d, str) for d in spec.shape)


def _timed_on(searched: Any, validation: Validation) -> str:
    """Where the row's latencies come from: a device profile, this host (its CPU's features), or nowhere."""
    from edgekit.host_cpu import describe_host_cpu

    if searched is not None and searched.chosen.latency_from:
        return str(searched.chosen.latency_from)
    return f"this host: {describe_host_cpu()}" if validation.latency_p50_ms is not None else ""


def _host_description(describe: Mapping[str, Any]) -> str:
    runtime = describe.get("runtime", "runtime")
    ver = describe.get("version", "")
    from edgekit.host_cpu import describe_host_cpu

    return f"host {runtime} {ver} on {describe_host_cpu()}".replace("  ", " ")


def _tried_notes(searched: Any, precision: str) -> tuple[str, ...]:
    """``tried ...`` lines for the candidates of the requested precision (the FP32 baseline the
    engine measures alongside an int8 request is not one of the configurations tried for it)."""
    return tuple(
        f"tried {o.name}"
        for o in searched.outcomes
        if o.status != "skipped" and (precision == "auto" or o.precision == precision)
    )


def _failure_message(
    failed: list[tuple[str, Comparison, tuple[str, ...]]],
    precisions: Mapping[str, str],
    reports: Mapping[str, Path] | None = None,
) -> str:
    parts = []
    for target, comp, notes in failed:
        tried = [n for n in notes if n.startswith("tried ")]
        why = "; ".join(comp.failures)
        line = f"{target} {precisions[target]} failed validation on {comp.samples} held-out samples: {why}"
        report = (reports or {}).get(target)
        if report is not None:  # an engine target: its report lists every candidate
            if len(tried) > 1:
                line += f" ({len(tried)} configurations tried; see {report})"
            line += "".join(f"; {n}" for n in notes if n.startswith("fallback chain: "))
        elif tried:
            line += f" ({len(tried)} configurations tried; see `edgekit inspect` of an --allow-failed bundle)"
        parts.append(line)
    advice = (
        "no bundle was written for it; try more representative --calib data, another precision for that "
        "target alone (such as --precision int8,TARGET=fp16), a --option for the target's calibration, "
        "relax the gate with --tolerance KEY=VALUE, or pass --allow-failed to write the bundle anyway (marked "
        "failed; agents refuse it unless their agent.toml sets allow_failed_validation = true)"
    )
    return "\n".join(parts) + "\n" + advice
