"""The validation gate: each target's artifact run through the device runtime (``device_agents.
runtimes``) where it runs here, else through the target's intermediate, compared with the FP32
source under the tolerance, timed side by side, and its golden vectors written; then the
validation record, the manifest (``edgekit.packaging.assemble``) and the table row.

An artifact outside the tolerance is marked failed; what happens to its bundle (none, or one
marked failed under ``allow_failed``) is the orchestration's (``edgekit.packaging.orchestrate``).
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle import file_entries
from edgekit.bundle.manifest import (
    MANIFEST_NAME,
    SIGNATURE_NAME,
    CompressionStep,
    Golden,
    Manifest,
    Signature,
    Validation,
)
from edgekit.errors import EdgekitError
from edgekit.packaging.assemble import assemble_manifest, memory_estimates, placeholder_golden, placeholder_validation
from edgekit.packaging.result import Row
from edgekit.packaging.shared import GOLDEN_FILE, SharedRun, eval_batch
from edgekit.targets import BuildContext, BuildResult
from edgekit.targets.base import static_signature
from edgekit.targets.shape_profile import frozen_axes, profiled_signature, shapes_line
from edgekit.validate.calib import fixed_batch, pad_samples, sample_count, take
from edgekit.validate.latency import LatencyStats, call_with, stats_side_by_side
from edgekit.validate.metrics import MEASURES, Comparison, RunFn, compare, run_all
from edgekit.validate.table import cpu_only_reason

GOLDEN_COUNT = 4


def evaluator(run: SharedRun, static: Signature) -> Callable[[RunFn], Comparison]:
    # At the static batch (1 unless --input-shape fixes another), short batches padded: a target
    # may hand in a candidate that takes static shapes only.
    batch = eval_batch(static, static=True)

    def evaluate(fn: RunFn) -> Comparison:
        outputs = run_all(fn, run.eval, batch, pad=True)
        return compare(run.reference, outputs, run.kind, run.tolerance, run.labels, run.tasks, run.post)

    return evaluate


def validate_and_describe(
    target: str,
    precision: str,
    result: BuildResult,
    ctx: BuildContext,
    run: SharedRun,
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
    provisional = assemble_manifest(
        name,
        version,
        target,
        result,
        served,
        source,
        (*artifact_files, placeholder_golden()),
        placeholder_validation(run),
        Golden(file=GOLDEN_FILE, count=0),
        expires,
        private_key,
    )
    batch = eval_batch(served, result.static)
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
        if comparison.drop_text():  # with labels: how far from the threshold, in samples and as an interval
            run.say(f"[{target}] {comparison.drop_text()}")
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
        golden = write_golden(ctx.out_dir, run, served, artifact, comparison, outputs)
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
            *((comparison.drop_text(),) if comparison.drop_text() else ()),
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
    manifest = assemble_manifest(
        name, version, target, result, served, source, files, validation, golden, expires, private_key
    )
    manifest = dataclasses.replace(manifest, **run.manifest_extras, rows_independent=rows.independent)
    if result.runnable_here and manifest.estimates is None:
        manifest = dataclasses.replace(manifest, estimates=memory_estimates(ctx.out_dir, manifest, measured_on, run))
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


def write_golden(
    out_dir: Path,
    run: SharedRun,
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


def _golden_samples(run: SharedRun, measured: Mapping[str, np.ndarray] | None) -> np.ndarray:
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


def _golden_image(run: SharedRun, served: Signature, fn: RunFn) -> dict[str, np.ndarray]:
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
