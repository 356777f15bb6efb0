"""The host packaging run: one ``PackageRequest`` -> one signed ``.ekb`` bundle per target.

Order of work (bad combinations are rejected before any conversion starts):

1. check arguments: targets, precision per target, target options, signing key, version;
2. prepare the model once (``compress.onnx_prep``) and read the served signature;
3. check calibration / evaluation data and labels (``packaging.data``); hold out part of the
   calibration data for evaluation when no ``eval`` is given; compute FP32 reference outputs once;
4. per target: ``check_model``, then the optimisation engine (``edgekit.optimize.run``) builds,
   measures and chooses among the target's candidates; the validation gate (``packaging.gate``)
   runs the chosen artifact through the *device* runtime where it runs here, else through the
   target's intermediate; a chosen candidate that fails it gives way to the next in the engine's
   fallback chain; the manifest is filled (``packaging.assemble``), signed, and written as
   ``OUTDIR/<name>-<target>-v<version>.ekb``.

An artifact outside the tolerance produces no bundle and raises ``PackageValidationError`` once
every target was tried; with ``allow_failed`` its bundle is written, marked failed in the manifest
(``validation.passed`` false), and the result says so (``PackageResult.passed``; the CLI exits 3).
"""

from __future__ import annotations

import contextlib
import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

from edgekit.bundle import load_private_key, write_bundle
from edgekit.bundle.manifest import CompressionStep, Manifest, Tolerance, utc_now
from edgekit.errors import ConfigError, EdgekitError, UnsupportedOpError, ValidationFailedError
from edgekit.package_checks import (
    check_data_sources,
    check_input_shapes,
    check_model_path,
    check_out_dir,
    check_tolerance_kind,
)
from edgekit.packaging.assemble import kept_candidate_rows, with_processing
from edgekit.packaging.data import (
    check_same_interface,
    check_static_fit,
    compress_first,
    first_image,
    load_calib_and_eval,
)
from edgekit.packaging.gate import evaluator, validate_and_describe
from edgekit.packaging.request import PackageRequest
from edgekit.packaging.result import PackageResult, PackageValidationError, Row
from edgekit.packaging.shared import SharedRun, eval_batch
from edgekit.targets import BuildContext, BuildResult, get_target, parse_targets
from edgekit.targets.base import static_signature
from edgekit.targets.options import check_option_targets, resolve_options
from edgekit.targets.precisions import choose_precisions
from edgekit.targets.sdk_output import sdk_output_to
from edgekit.validate.calib import data_manifest_fields, sample_count
from edgekit.validate.drawn_inputs import drawn_for_validation
from edgekit.validate.eval_size import check_eval_size
from edgekit.validate.heads import head_outputs
from edgekit.validate.metrics import (
    Comparison,
    compressed_gate,
    kind_of,
    output_kind,
    output_tasks,
    parse_tasks,
    run_all,
    tolerance_with,
)
from edgekit.validate.ort_runner import ort_cpu_runner
from edgekit.validate.postprocess import Postprocess, read_labels_file
from edgekit.validate.preprocess import Preprocess, describe_steps

FLOAT_PRECISIONS = ("fp32", "fp16")  # a target's float candidates: the last resort of its fallback chain


SDK_LOG = "sdk-output.log"  # in each target's work folder: what the converters printed


def package(request: PackageRequest) -> PackageResult:
    """Run ``request`` (``edgekit.packaging.PackageRequest``, whose docstring says what each
    setting does): one signed bundle per target, and the validation table.

    Raises ``ConfigError`` (arguments, exit 2), ``ModelFormatError``, ``CalibrationDataError``,
    ``MissingSDKError`` (exit 4) before any conversion where it can, ``PackageValidationError``
    (exit 3) after every target was tried.
    """
    model, calib, eval, preprocess, postprocess = (
        request.model, request.calib, request.eval, request.preprocess, request.postprocess
    )  # fmt: skip
    name, out_dir = request.name, request.out_dir
    if not isinstance(model, (str, Path)):  # a torch.nn.Module: exported to OUT_DIR/NAME.onnx first
        from edgekit.export import export_for_package

        model, name = export_for_package(model, request.example_inputs, Path(out_dir), name)
    say = request.progress or (lambda _msg: None)
    started = time.perf_counter()
    names = (
        parse_targets(request.targets) if isinstance(request.targets, str) else parse_targets(",".join(request.targets))
    )
    chosen = {t: get_target(t) for t in names}
    precisions = choose_precisions(request.precision, chosen)
    options = dict(request.options or {})
    check_option_targets(options, names)
    target_options = {t: resolve_options(t, chosen[t].Options, options.get(t)) for t in names}
    tol = tolerance_with(request.tolerance)
    from edgekit.optimize.run import EngineSettings

    engine = EngineSettings(
        objective=request.objective,
        mixed_precision=request.mixed_precision,
        threads=request.threads,
        calib_samples=request.calib_samples,
        tolerance=tol,
        max_memory_gb=request.max_memory_gb,
    )
    profile = None
    if request.device_profile is not None:
        from edgekit.optimize.profile import DeviceProfile

        profile = DeviceProfile.load(request.device_profile)
        engine = dataclasses.replace(engine, device_profile=profile)
    keep_dir = None if request.keep_candidates is None else Path(request.keep_candidates)
    if keep_dir is not None and keep_dir.exists() and (not keep_dir.is_dir() or any(keep_dir.iterdir())):
        raise ConfigError(f"--keep-candidates {keep_dir}: give a new or empty folder")
    if request.key is None:
        raise ConfigError("package: a signing key is required (--signing-key); make one with `edgekit keygen`")
    private_key = load_private_key(Path(request.key))
    if isinstance(request.version, bool) or not isinstance(request.version, int) or request.version < 1:
        raise ConfigError(f"--version must be an integer >= 1, got {request.version!r}")
    if isinstance(preprocess, str):
        preprocess = Preprocess.parse(preprocess)
    if isinstance(postprocess, str):
        postprocess = Postprocess.parse(postprocess)
    labels_names = read_labels_file(request.labels_file) if request.labels_file is not None else None
    if labels_names is not None and postprocess is None:
        raise ConfigError("--labels-file names the classes of --postprocess topk=K or boxes=yolo; give one of them")
    calib, eval = check_data_sources(calib, eval, precisions)
    model = Path(model)
    check_model_path(model)
    original = Path(request.reference) if request.reference is not None else model
    if request.reference is not None:
        check_model_path(original)
    drop = request.max_drop
    if drop is not None and (isinstance(drop, bool) or not isinstance(drop, (int, float)) or not 0 <= drop <= 1):
        raise ConfigError(
            f"--max-drop must be a number in [0, 1] (0.01 = one point of top-1), got {request.max_drop!r}"
        )
    # a gate the user set whole (a Tolerance), or min_top1_agreement named: a compressed classifier's
    # agreement with the original then gates as well (``compressed_gate``)
    agreement_given = isinstance(request.tolerance, Tolerance) or "min_top1_agreement" in (request.tolerance or {})
    if (request.train is not None or request.train_labels is not None) and not request.compress:
        raise ConfigError("--train is the compression steps' training data: give --compress STEP with it")
    name = name or _name_from(model)
    _check_name(name)
    expires_at = _expires(request.expires)
    out_dir = Path(out_dir)
    check_out_dir(out_dir, "-o")
    if request.log_dir is not None:
        check_out_dir(Path(request.log_dir), "--log-dir")
    for t in names:
        dest = out_dir / f"{name}-{t}-v{request.version}.ekb"
        if dest.exists() and not request.overwrite:
            raise ConfigError(f"{dest} already exists; publish a higher --version, remove it, or pass --overwrite")
    timings: dict[str, float] = {}

    from edgekit.compress.onnx_prep import model_size_bytes, prepare_model, resolve_static_shapes

    with tempfile.TemporaryDirectory(prefix="edgekit-package-") as tmp:
        work = Path(tmp)
        compression: tuple[CompressionStep, ...] = ()
        if request.compress:
            steps_tol = tol if drop is None else dataclasses.replace(tol, max_top1_drop=float(drop))
            model, compression = compress_first(
                model, request.compress, work, calib, eval, request.labels, request.train, request.train_labels, say,
                objective=request.objective, tolerance=steps_tol, agreement_given=agreement_given,
            )  # fmt: skip
        say(f"preparing {model.name}")
        prepared = prepare_model(model, work / "prepared", say, request.input_shapes)
        if original != model:
            check_same_interface(original, prepared.served)
        if profile is not None:
            profile.check(prepared.source.sha256, model.name, names)
        given_tasks = parse_tasks(request.task, [o.name for o in prepared.served.outputs])
        first_output = prepared.served.outputs[0].name
        kind = kind_of(given_tasks, prepared.served) if first_output in given_tasks else output_kind(prepared.served)
        if request.max_drop is not None:
            if kind == "classifier":
                tol = dataclasses.replace(tol, max_top1_drop=float(request.max_drop))
                engine = dataclasses.replace(engine, tolerance=tol)
            else:
                say(f"--max-drop {request.max_drop}: dense outputs keep their gate (cosine, relative error)")
        if request.tolerance is not None and not isinstance(request.tolerance, Tolerance):
            check_tolerance_kind(request.tolerance, kind, prepared.served)
        if request.input_shapes:
            check_input_shapes(prepared.served, request.input_shapes)
        drawn: tuple[str, ...] = ()
        if calib is None:  # fp32/fp16 without data: inputs drawn within the declared shapes
            calib, note = drawn_for_validation(prepared.path, prepared.served, request.input_shapes)
            eval, drawn = calib, (note,)
        calib_arrays, eval_arrays, eval_labels = load_calib_and_eval(
            prepared.served, calib, eval, request.labels, request.input_shapes, say, preprocess
        )
        check_eval_size(sample_count(eval_arrays), held_out=eval is None, allow_small=request.allow_small_eval)
        fp32 = ort_cpu_runner(original)  # the FP32 source (the original), as the device runtime would open it
        say(f"fp32 reference on {sample_count(eval_arrays)} evaluation samples")
        reference = run_all(fp32, eval_arrays, eval_batch(prepared.served, static=False))
        # a fresh session for what follows (timing one sample per call): the first keeps its arena at
        # the evaluation batch's size for as long as it is open (1.2 GB for a 512x512 conv model)
        fp32 = ort_cpu_runner(original)
        run = SharedRun(
            served=prepared.served,
            kind=kind,
            tolerance=tol,
            calib=calib_arrays,
            eval=eval_arrays,
            labels=eval_labels,
            reference=reference,
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
        if original != model:
            # compressed (here or before, --reference): judged against the original by accuracy where labels
            # are given; the engine's candidates are compared with the compressed model itself, as quantization
            judged, line = compressed_gate(tol, run.kind, run.labels is not None, agreement_given)
            if line:
                say(line)
                run = dataclasses.replace(run, tolerance=judged, gate_notes=(*run.gate_notes, line))
        if request.cache is not None:
            from edgekit.validate.cache_calibration import cache_policy

            declared = cache_policy(
                request.cache,
                request.false_hit_budget,
                fp32,
                eval_arrays,
                run.reference,
                eval_batch(prepared.served, static=False),
                say,
            )
            run = dataclasses.replace(run, manifest_extras={**run.manifest_extras, "cache": declared})
        if preprocess is not None or postprocess is not None:
            image = first_image(eval if eval is not None else calib)
            run = with_processing(run, preprocess, postprocess, labels_names, request.labels_file, image)
            engine = dataclasses.replace(engine, post=run.post)
        static_shapes = resolve_static_shapes(prepared.served, run.calib, request.input_shapes)
        errors: dict[str, str] = {}  # targets that failed: the other targets go on
        for t in names:
            if chosen[t].static_shapes:  # before any conversion: a mismatch found after one wastes it
                check_static_fit(t, run.eval, static_shapes)
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
                _kept_log(target_dir / "work" / SDK_LOG, request.log_dir, t),
                sdk_output_to(target_dir / "work" / SDK_LOG, say) as target_say,
            ):
                ctx = BuildContext(
                    model_path=prepared.path,
                    source_path=prepared.graph_path,  # shape sub-graphs folded, else the model as given
                    served=prepared.served,
                    precision=precisions[t],
                    calib=run.calib,
                    static_shapes=static_shapes,
                    out_dir=target_dir / "bundle",
                    work_dir=target_dir / "work",
                    options=target_options[t],
                    progress=target_say,
                    evaluate=evaluator(run, static_signature(prepared.served, static_shapes)),
                    heads=head_outputs(tasks, given_tasks),
                )
                target_say(f"[{t}] building {precisions[t]}")
                try:
                    built = _build_target(
                        t, chosen[t], ctx, model, engine, shared_builds, keep_dir, run, prepared.source, name,
                        request.version, private_key, static_shapes,
                    )  # fmt: skip
                    result, searched, ctx = built.result, built.searched, built.ctx
                    kept_rows += built.kept_rows
                    gate_failed: list[str] = []  # the fallback chain: chosen candidates the final gate failed
                    while True:
                        manifest, comparison, row = validate_and_describe(
                            t,
                            precisions[t],
                            result,
                            ctx,
                            dataclasses.replace(run, say=target_say),
                            prepared.source,
                            name,
                            request.version,
                            expires_at,
                            private_key,
                            static_shapes,
                            searched,
                        )
                        if comparison.passed or built.optimized is None:
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
                reports[t] = write_report(
                    searched, out_dir / f"{name}-{t}-v{request.version}", t, comparison.passed, images
                )
                say(f"[{t}] candidate report {reports[t]}")
            if comparison.passed or request.allow_failed:
                dest = out_dir / f"{name}-{t}-v{request.version}.ekb"
                bundles[t] = write_bundle(manifest, ctx.out_dir, private_key, dest)
                manifests[t] = manifest
                say(f"[{t}] wrote {dest}" + ("" if comparison.passed else " (marked: failed validation)"))
            rows.append(dataclasses.replace(row, bundle=bundles.get(t)))
            timings[t] = time.perf_counter() - target_started
            # this target's search (its data, sessions and reference outputs) is not the next one's
            del built, result, searched
            from edgekit.optimize.memory import release_memory

            release_memory()
        if keep_dir is not None:
            from edgekit.optimize.profile import write_index

            index = write_index(keep_dir, name, prepared.source.sha256, kept_rows, utc_now())
            say(f"kept {len(kept_rows)} candidate(s) for on-device timing: {index}")
    result_all = PackageResult(
        bundles=bundles, rows=tuple(rows), manifests=manifests, timings_s=timings, reports=reports, errors=errors
    )
    if errors or (failed and not request.allow_failed):
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
    optimized: Any = None  # edgekit.optimize.run.Optimized: its fallback chain


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

    nxt = fall_back(target, ctx, built.optimized, failure, engine, before_finish=empty)
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
    run: SharedRun,
    source: Any,
    name: str,
    version: int,
    private_key: Any,
    static_shapes: Mapping[str, tuple[int, ...]],
) -> _Built:
    """Build target ``t`` through the optimisation engine: its candidates searched side by side."""
    from edgekit.optimize.run import optimize

    kept_rows: list[dict[str, Any]] = []
    ctx = dataclasses.replace(ctx, source_path=ctx.source_path or model)
    optimized = optimize(
        target, ctx, engine, reference_path=model, shared=shared_builds, holdout_reference=run.reference,
        also_held=(run.eval,),
    )  # fmt: skip
    result, searched = optimized.build, optimized.search
    if keep_dir is not None:
        kept_rows = kept_candidate_rows(
            keep_dir, t, target, ctx, searched, run, source, name, version, private_key, static_shapes
        )
    if result.static and not target.static_shapes:
        raise EdgekitError(f"target {t} built a static-shape artifact but does not declare static_shapes")
    return _Built(result, searched, ctx, kept_rows, optimized)


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


@contextlib.contextmanager
def _kept_log(log: Path, log_dir: str | Path | None, target: str) -> Iterator[None]:
    """Copy the target's converter log to ``LOG_DIR/<target>.log`` when the target is done (or failed)."""
    try:
        yield
    finally:
        if log_dir is not None and log.exists():
            shutil.copyfile(log, Path(log_dir) / f"{target}.log")


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
