"""Split bundles: the device bundle (the full model as the local fallback, one head per useful
cut, the plan in the manifest's ``split``) and one tail bundle per cut for the tail server
(``<name>-tail-<cut>``), all signed.

The device bundle starts as the ordinary bundle of the full model (``edgekit.packaging``, gated as
always); its heads are added under ``heads/`` (role ``split_head``) and the manifest re-signed
with the same key. Each tail is packaged FP32 with the heads' outputs on the calibration samples
as its calibration data, so the tail's golden vectors are real cut tensors. Before anything is
added, every shipped head and its tail composed are held to the device bundle's own gate (its
validation kind and tolerance, ``edgekit.validate.metrics.compare``) against the full FP32 model
on the samples: a cut that fails it is refused (``SplitGateError``). When no cut is chosen at any
planned bandwidth, only the ordinary bundle is written and the result says why, per bandwidth.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgekit.bundle import file_entries, load_private_key, write_bundle
from edgekit.bundle.archive import extract, read_verified_manifest
from edgekit.bundle.manifest import MANIFEST_NAME, SIGNATURE_NAME
from edgekit.bundle.signing import TrustStore, key_id
from edgekit.errors import ConfigError, ValidationFailedError
from edgekit.split.plan import Plan, to_manifest, useful_cuts, why_no_cut
from edgekit.validate.ort_runner import ort_cpu_runner


class SplitGateError(ValidationFailedError):
    """A head and its tail composed miss the gate the full model's bundle passed."""


@dataclass(frozen=True)
class SplitBundles:
    device: Path
    tails: dict[str, Path]  # cut id -> tail bundle
    note: str
    gate: tuple[str, ...] = ()  # per shipped cut: head∘tail against the full model, one line


def tail_model_name(name: str) -> str:
    return f"{name}-tail"


def write_split_bundles(
    model: Path,
    plan: Plan,
    heads: Mapping[str, Path],
    tails: Mapping[str, Path],
    calib: Mapping[str, np.ndarray],
    *,
    key: Path,
    name: str,
    out_dir: Path,
    version: int = 1,
    cuts: Sequence[str] | None = None,
    precision: str = "fp32",
) -> SplitBundles:
    """``heads`` / ``tails``: cut id -> the planner's head / tail ONNX; ``cuts``: the cuts to ship
    (None: those the plan chose at some bandwidth)."""
    from edgekit import package

    check_cuts(plan, heads, cuts)
    result = package(
        model,
        targets="cpu",
        precision=precision,
        calib=dict(calib),
        key=key,
        name=name,
        version=version,
        out_dir=out_dir,
        overwrite=True,
    )
    bundle = result.bundles.get("cpu")
    if bundle is None:
        raise ConfigError(f"{model}: packaging the full model failed: {result.errors}")
    return add_split(
        bundle, model, plan, heads, tails, calib, key=key, name=name, out_dir=out_dir, version=version, cuts=cuts
    )


def check_cuts(plan: Plan, heads: Mapping[str, Path], cuts: Sequence[str] | None) -> list[str]:
    """The cuts to ship: ``cuts`` (each one a cut of the plan; ``["all"]``: every cut measured, for
    a bundle to profile on the device) or, for None, those chosen."""
    chosen = list(cuts) if cuts is not None else useful_cuts(plan)
    if chosen == ["all"]:
        chosen = list(heads)
    unknown = [c for c in chosen if c not in heads]
    if unknown:
        raise ConfigError(f"--cuts {','.join(unknown)}: not cuts of this plan (it has {', '.join(heads)})")
    return chosen


def add_split(
    bundle: Path,
    model: Path,
    plan: Plan,
    heads: Mapping[str, Path],
    tails: Mapping[str, Path],
    calib: Mapping[str, np.ndarray],
    *,
    key: Path,
    name: str,
    out_dir: Path,
    version: int = 1,
    cuts: Sequence[str] | None = None,
) -> SplitBundles:
    """Make the ordinary device ``bundle`` of ``model`` a split one: gate each cut, package its
    tail, add the heads and the plan (re-signed in place). No cut chosen: ``bundle`` as it is,
    and the note says why."""
    from edgekit import package

    chosen = check_cuts(plan, heads, cuts)
    if not chosen:
        why = why_no_cut(plan).split(":", 1)[0]  # the per-bandwidth detail is in the plan's text and JSON
        return SplitBundles(bundle, {}, f"ordinary bundle only: {why}; the plan says why, per bandwidth")
    gate = gate_cuts(bundle, model, {c: heads[c] for c in chosen}, {c: tails[c] for c in chosen}, calib, key=key)
    from edgekit.validate.metrics import run_all

    tail_bundles = {}
    for cut_id in chosen:
        mids = run_all(ort_cpu_runner(heads[cut_id]), calib)  # a sample at a time: heads of a batch-1 model
        out = package(
            tails[cut_id],
            targets="cpu",
            precision="fp32",
            calib=mids,
            key=key,
            name=f"{tail_model_name(name)}-{cut_id}",
            version=version,
            out_dir=out_dir,
            overwrite=True,
        )
        if "cpu" not in out.bundles:
            raise ConfigError(f"{tails[cut_id]}: packaging the tail of {cut_id} failed: {out.errors}")
        tail_bundles[cut_id] = out.bundles["cpu"]
    add_heads(bundle, plan, {c: heads[c] for c in chosen}, key=key, name=name)
    return SplitBundles(bundle, tail_bundles, f"cuts {', '.join(chosen)}", gate)


def gate_cuts(
    bundle: Path,
    model: Path,
    heads: Mapping[str, Path],
    tails: Mapping[str, Path],
    samples: Mapping[str, np.ndarray],
    *,
    key: Path,
) -> tuple[str, ...]:
    """Each head∘tail against the full FP32 ``model`` on ``samples``, judged by the gate the device
    ``bundle`` was validated with (its kind and tolerance); one line per cut, or SplitGateError."""
    from edgekit.validate.metrics import compare, run_all

    manifest = read_verified_manifest(bundle, _trust(key)).manifest
    validation = manifest.validation
    if validation is None:
        raise ConfigError(f"{bundle}: its manifest records no validation to hold the split cuts to")
    full = ort_cpu_runner(model)
    reference = run_all(full, samples)
    lines = []
    for cut_id, head_path in heads.items():
        head, tail = ort_cpu_runner(head_path), ort_cpu_runner(tails[cut_id])
        composed = run_all(lambda feed, h=head, t=tail: t(h(feed)), samples)  # type: ignore[misc]  # default-bound loop vars
        got = compare(reference, {n: composed[n] for n in reference}, validation.kind, validation.tolerance)
        line = f"{cut_id}: head∘tail against the full model on {got.samples} samples: {got.summary()}"
        if not got.passed:
            raise SplitGateError(
                f"{line}: fails the gate the full model passed ({'; '.join(got.failures)}); this cut cannot be "
                "shipped: leave it out with --cuts, or plan again"
            )
        lines.append(line + " (passed)")
    return tuple(lines)


def add_heads(bundle: Path, plan: Plan, heads: Mapping[str, Path], *, key: Path, name: str) -> Path:
    """Re-sign ``bundle`` (in place) with ``heads`` added under ``heads/`` and the plan of them."""
    private = load_private_key(key)
    verified = read_verified_manifest(bundle, _trust(key))
    with tempfile.TemporaryDirectory(prefix="edgekit-split-") as tmp:
        root = extract(bundle, verified, Path(tmp) / "b")
        for leftover in (MANIFEST_NAME, SIGNATURE_NAME):
            (root / leftover).unlink(missing_ok=True)
        (root / "heads").mkdir()
        head_files = {}
        for cut_id, path in heads.items():
            rel = f"heads/{cut_id}.onnx"
            shutil.copyfile(path, root / rel)
            head_files[cut_id] = rel
        m = verified.manifest
        manifest = dataclasses.replace(
            m,
            files=(*m.files, *file_entries(root, {rel: "split_head" for rel in head_files.values()})),
            split=to_manifest(plan, list(heads), head_files, tail_model_name(name)),
        )
        return write_bundle(manifest, root, private, bundle)


def _trust(key: Path) -> TrustStore:
    public = load_private_key(key).public_key()
    return TrustStore({key_id(public): public})
