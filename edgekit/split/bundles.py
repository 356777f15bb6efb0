"""Split bundles: the device bundle (the full model as the local fallback, one head per useful
cut, the plan in the manifest's ``split``) and one tail bundle per cut for the tail server
(``<name>-tail-<cut>``), all signed.

The device bundle starts as the ordinary bundle of the full model (``edgekit.packaging``, gated as
always); its heads are added under ``heads/`` (role ``split_head``) and the manifest re-signed
with the same key. Each tail is packaged FP32 with the heads' outputs on the calibration samples
as its calibration data, so the tail's golden vectors are real cut tensors. When no cut is chosen
at any planned bandwidth, only the ordinary bundle is written and the result says why.
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
from edgekit.errors import ConfigError
from edgekit.split.plan import Plan, to_manifest, useful_cuts
from edgekit.validate.ort_runner import ort_cpu_runner


@dataclass(frozen=True)
class SplitBundles:
    device: Path
    tails: dict[str, Path]  # cut id -> tail bundle
    note: str


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

    chosen = list(cuts) if cuts is not None else useful_cuts(plan)
    unknown = [c for c in chosen if c not in heads]
    if unknown:
        raise ConfigError(f"--cuts {','.join(unknown)}: not cuts of this plan (it has {', '.join(heads)})")
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
    if not chosen:
        return SplitBundles(
            bundle, {}, "no cut beats both local and remote at any planned bandwidth: ordinary bundle only"
        )
    tail_bundles = {}
    for cut_id in chosen:
        head = ort_cpu_runner(heads[cut_id])
        mids = head(dict(calib))
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
    return SplitBundles(bundle, tail_bundles, f"cuts {', '.join(chosen)}")


def add_heads(bundle: Path, plan: Plan, heads: Mapping[str, Path], *, key: Path, name: str) -> Path:
    """Re-sign ``bundle`` (in place) with ``heads`` added under ``heads/`` and the plan of them."""
    private = load_private_key(key)
    public = private.public_key()
    trust = TrustStore({key_id(public): public})
    verified = read_verified_manifest(bundle, trust)
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
