"""``edgekit split package``: the device bundle with heads and plan, tail bundles, and the
ordinary bundle alone when no cut helps."""

from __future__ import annotations

from pathlib import Path

import pytest

from edgekit.bundle.archive import read_unverified_manifest
from edgekit.cli import main
from tests.split.conftest import write_profiles
from tests.split.models import shrinking_convnet


def _args(tmp_path: Path, model: Path, key: Path, *extra: str) -> list[str]:
    device, server = write_profiles(tmp_path / "profiles", model)
    return [
        "split", "package", str(model), "--key", str(key), "--name", "sc",
        "--device-profile", str(device), "--server-profile", str(server),
        "--rtt-ms", "5", "--budget-s", "0.3", "--no-plot", "-o", str(tmp_path / "plan"),
        "--bundle-dir", str(tmp_path / "bundles"), *extra,
    ]  # fmt: skip


def test_split_package_writes_heads_plan_and_a_tail_bundle_per_cut(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    assert main(_args(tmp_path, model, keypair[0], "--bandwidth-mbps", "1", "--cuts", "cut3")) == 0
    out = capsys.readouterr().out
    assert "tail bundle cut3" in out
    manifest, _ = read_unverified_manifest(tmp_path / "bundles" / "sc-cpu-v1.ekb")
    assert manifest.split is not None and [c.id for c in manifest.split.cuts] == ["cut3"]
    assert manifest.split.cuts[0].tail_model == "sc-tail-cut3"
    tail, _ = read_unverified_manifest(tmp_path / "bundles" / "sc-tail-cut3-cpu-v1.ekb")
    assert [s.name for s in tail.signature.inputs] == ["c2"]


def test_split_package_writes_the_ordinary_bundle_when_no_cut_helps(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    assert main(_args(tmp_path, model, keypair[0], "--bandwidth-mbps", "0.1")) == 0  # local wins at 0.1 Mbit/s
    assert "no cut beats both local and remote" in capsys.readouterr().out
    manifest, _ = read_unverified_manifest(tmp_path / "bundles" / "sc-cpu-v1.ekb")
    assert manifest.split is None
    assert not list((tmp_path / "bundles").glob("sc-tail-*"))
