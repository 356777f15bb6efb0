"""``edgekit split package`` and ``edgekit package --split``: the device bundle with heads and plan,
tail bundles, all signed; head∘tail held to the full model's gate; the ordinary bundle alone, and
why, when no cut helps."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekit.bundle.archive import read_unverified_manifest
from edgekit.bundle.manifest import Manifest
from edgekit.cli import main
from tests.split.conftest import SplitBuild, write_profiles
from tests.split.models import inputs, shrinking_convnet


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


def _package_split_args(tmp_path: Path, model: Path, key: Path, *extra: str) -> list[str]:
    device, server = write_profiles(tmp_path / "profiles", model)
    np.savez(tmp_path / "calib.npz", x=inputs(64, seed=5))
    return [
        "package", str(model), "--calib", str(tmp_path / "calib.npz"), "--target", "cpu", "--precision", "fp32",
        "--split", "--key", str(key),
        "--name", "sc", "--version", "1", "-o", str(tmp_path / "dist"), "-q",
        "--split-device-profile", str(device), "--server-profile", str(server), "--rtt-ms", "5",
        "--split-budget-s", "0.3", "--split-dir", str(tmp_path / "plan"), *extra,
    ]  # fmt: skip


def _verified(bundle: Path, public: Path) -> Manifest:
    from edgekit.bundle import load_public_key
    from edgekit.bundle.archive import read_verified_manifest
    from edgekit.bundle.signing import TrustStore, key_id

    pub = load_public_key(public)
    return read_verified_manifest(bundle, TrustStore({key_id(pub): pub})).manifest


def test_package_split_writes_a_signed_device_bundle_with_heads_and_signed_tail_bundles(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    assert main(_package_split_args(tmp_path, model, keypair[0], "--bandwidth-mbps", "1,10")) == 0
    out = capsys.readouterr().out
    device = _verified(tmp_path / "dist" / "sc-cpu-v1.ekb", keypair[1])
    assert device.split is not None
    cut_ids = [c.id for c in device.split.cuts]
    assert len(cut_ids) == 2  # 1 Mbit/s and 10 Mbit/s choose different cuts
    roles = {f.path: f.role for f in device.files}
    assert all(roles[c.head_file] == "split_head" for c in device.split.cuts)
    assert "artifact" in roles.values()  # the full model stays as the local fallback
    for cut_id in cut_ids:
        assert f"split gate {cut_id}: head∘tail against the full model on 64 samples" in out
        tail = _verified(tmp_path / "dist" / f"sc-tail-{cut_id}-cpu-v1.ekb", keypair[1])
        assert tail.name == f"sc-tail-{cut_id}"
    assert (tmp_path / "plan" / "plan.json").is_file()


def test_package_split_cuts_ships_the_cuts_named(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    assert main(_package_split_args(tmp_path, model, keypair[0], "--bandwidth-mbps", "1", "--cuts", "cut1")) == 0
    device = _verified(tmp_path / "dist" / "sc-cpu-v1.ekb", keypair[1])
    assert device.split is not None and [c.id for c in device.split.cuts] == ["cut1"]
    assert [p.name for p in (tmp_path / "dist").glob("sc-tail-*.ekb")] == ["sc-tail-cut1-cpu-v1.ekb"]


def test_package_split_writes_the_ordinary_bundle_and_the_plan_says_why_when_no_cut_helps(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    assert main(_package_split_args(tmp_path, model, keypair[0], "--bandwidth-mbps", "0.1")) == 0
    out = capsys.readouterr().out
    assert "ordinary bundle only: no cut beats both local and remote" in out
    device = _verified(tmp_path / "dist" / "sc-cpu-v1.ekb", keypair[1])
    assert device.split is None and not list((tmp_path / "dist").glob("sc-tail-*"))
    why = json.loads((tmp_path / "plan" / "plan.json").read_text())["no_cut_because"]
    assert "at 0.1 Mbit/s local 100.00 ms beats the best cut" in why
    assert "the device runs the whole model sooner" in (tmp_path / "plan" / "plan.txt").read_text()


def test_package_split_refuses_a_target_other_than_cpu(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    args = _package_split_args(tmp_path, model, keypair[0])
    args[args.index("cpu")] = "cpu,intel"
    assert main(args) == 2
    assert "--target cpu --split" in capsys.readouterr().err
    assert not (tmp_path / "dist").exists()


def test_split_gate_refuses_a_tail_that_misses_the_full_models_gate(
    tmp_path: Path, split_build: SplitBuild, keypair: tuple[Path, Path]
) -> None:
    from edgekit.split import graph
    from edgekit.split.bundles import SplitGateError, gate_cuts

    cut = split_build.run.measured.cuts[0]
    other = graph.load_model(shrinking_convnet(tmp_path / "other.onnx", seed=7))  # other weights
    _, wrong = graph.extract(other, cut.cut)
    samples = {"x": inputs(32, seed=4)}
    good = gate_cuts(
        split_build.bundles.device, split_build.model, {cut.cut.id: cut.head_path}, {cut.cut.id: cut.tail_path},
        samples, key=keypair[0],
    )  # fmt: skip
    assert good[0].endswith("(passed)") and "top-1 agreement 1.000" in good[0]
    with pytest.raises(SplitGateError, match=f"{cut.cut.id}: head∘tail .* fails the gate the full model passed"):
        gate_cuts(
            split_build.bundles.device, split_build.model, {cut.cut.id: cut.head_path},
            {cut.cut.id: graph.save(wrong, tmp_path / "t.onnx")}, samples, key=keypair[0],
        )  # fmt: skip


def test_package_split_ships_a_cut_of_a_model_whose_batch_is_fixed_at_one(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from bench.split import bottleneck_convnet

    model = bottleneck_convnet(tmp_path / "b.onnx", size=64, width=8, depth=1)  # input [1, 3, 64, 64]
    np.savez(tmp_path / "calib.npz", x=np.random.default_rng(0).standard_normal((64, 3, 64, 64)).astype(np.float32))
    args = [
        "package", str(model), "--calib", str(tmp_path / "calib.npz"), "--precision", "fp32", "--split",
        "--cuts", "cut1", "--key", str(keypair[0]), "--name", "b", "--version", "1", "-o", str(tmp_path / "dist"),
        "-q", "--split-budget-s", "0.2", "--split-dir", str(tmp_path / "plan"),
    ]  # fmt: skip
    assert main(args) == 0
    assert "split gate cut1: head∘tail against the full model on 64 samples" in capsys.readouterr().out
    tail = _verified(tmp_path / "dist" / "b-tail-cut1-cpu-v1.ekb", keypair[1])
    assert [s.shape for s in tail.signature.inputs] == [(1, 4, 8, 8)]


def test_package_split_energy_objective_plans_for_the_devices_energy(
    tmp_path: Path, keypair: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    model = shrinking_convnet(tmp_path / "m.onnx")
    base = _package_split_args(tmp_path, model, keypair[0], "--bandwidth-mbps", "10", "--split-objective", "energy")
    assert main(base) == 2  # no device power given
    assert "--split-objective energy needs the device's power" in capsys.readouterr().err
    # a 50 W device: at 10 Mbit/s sending the input costs it less energy than any head (latency: the cut after conv1)
    power = ["--device-power-w", "50", "--radio-power-w", "1", "--idle-power-w", "0"]
    assert main([*base, *power]) == 0
    plan = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert plan["objective"] == "energy" and plan["choices"][0]["best"] == "remote"
    assert plan["power_w"] == {"device_w": 50.0, "radio_w": 1.0, "idle_w": 0.0}
    assert _verified(tmp_path / "dist" / "sc-cpu-v1.ekb", keypair[1]).split is None
