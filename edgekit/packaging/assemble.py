"""Bundle assembly: the manifest from a target's ``BuildResult`` and the validation record, the
files every bundle carries beside the artifact (processing steps, labels), memory estimates,
and the unsigned candidate folders ``--keep-candidates`` writes for on-device timing."""

from __future__ import annotations

import dataclasses
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle import file_entries, key_id
from edgekit.bundle.manifest import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    Estimates,
    FileEntry,
    Golden,
    Manifest,
    Signature,
    TensorSpec,
    Validation,
    utc_now,
)
from edgekit.errors import ConfigError
from edgekit.packaging.shared import GOLDEN_FILE, SharedRun
from edgekit.targets import BuildContext, BuildResult
from edgekit.targets.base import static_signature
from edgekit.validate.calib import fixed_batch, pad_samples, take
from edgekit.validate.detections import DETECTION_MIN_F1, MATCH_IOU, boxes_post
from edgekit.validate.postprocess import LABELS_FILE, Postprocess
from edgekit.validate.preprocess import Preprocess


def assemble_manifest(
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


def placeholder_golden() -> FileEntry:
    # The provisional manifest only opens the artifact; the runtime never reads the golden file.
    return FileEntry(path=GOLDEN_FILE, size_bytes=0, sha256="0" * 64, role="golden")


def placeholder_validation(run: SharedRun) -> Validation:
    return Validation(passed=False, kind=run.kind, samples=0, tolerance=run.tolerance)


def memory_estimates(out_dir: Path, manifest: Manifest, measured_on: str, run: SharedRun) -> Estimates | None:
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


def kept_candidate_rows(
    root: Path,
    target: str,
    target_obj: Any,
    ctx: BuildContext,
    searched: Any,
    run: SharedRun,
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
        validation = dataclasses.replace(placeholder_validation(run), notes=(NOT_VALIDATED,))
        manifest = assemble_manifest(
            name, version, target, dataclasses.replace(result, notes=(NOT_VALIDATED, *result.notes)), served, source,
            file_entries(dest, {**result.files, GOLDEN_FILE: "golden"}), validation,
            Golden(file=GOLDEN_FILE, count=n), None, private_key,
        )  # fmt: skip
        (dest / MANIFEST_NAME).write_bytes(manifest.to_json())

    return keep_candidates(root, target, kept, describe)


def with_processing(
    run: SharedRun,
    preprocess: Preprocess | None,
    postprocess: Postprocess | None,
    labels: tuple[str, ...] | None,
    labels_file: str | Path | None,
    image: Path | None = None,
) -> SharedRun:
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
