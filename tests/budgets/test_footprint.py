"""The memory estimate the packager records: a model's load + first inference measured in a fresh
child process (the device's memory budget uses it until it has measured the model itself)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_agents.budgets.footprint import measure_in_child
from edgekit.bundle import TrustStore, extract, read_verified_manifest
from edgekit.bundle.manifest import Manifest
from tests.agent.bundles import read_manifest
from tests.factories import make_cpu_bundle, tiny_classifier

N = 1024  # a MatMul of N x N float32 weights: 4 MB


def _matmul(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((N, N)) * 0.01).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="matmul")],
        "matmul",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", N])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", N])],
        [numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_packager_records_the_measured_memory_of_load_and_first_inference(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    import edgekit

    calib = {"x": np.random.default_rng(1).standard_normal((8, N)).astype(np.float32)}
    result = edgekit.package(
        _matmul(tmp_path / "m.onnx"), targets=["cpu"], precision="fp32", calib=calib, key=keypair[0], name="m",
        out_dir=tmp_path / "out", allow_small_eval=True,  # the memory estimate is tested, not the gate
    )  # fmt: skip
    manifest = read_manifest(Path(result.bundles["cpu"]))
    est = manifest.estimates
    assert est is not None and est.memory_mb is not None and est.peak_memory_mb is not None
    assert est.memory_mb >= 3.5  # the 4 MB of weights are resident once loaded
    assert est.peak_memory_mb >= est.memory_mb
    assert est.measured_on.startswith("host onnxruntime")
    from edgekit.cli import describe_manifest

    shown = [line for line in describe_manifest(manifest, "k") if line.startswith("memory: ")]
    assert shown == [
        f"memory: {est.memory_mb:g} MB resident, peak {est.peak_memory_mb:g} MB (load + first inference, "
        f"{est.measured_on})"
    ]


def test_footprint_child_raises_with_what_failed(tmp_path: Path) -> None:
    manifest = Manifest.from_json((Path(__file__).parents[1] / "golden" / "manifest_v2.json").read_bytes())
    empty = tmp_path / "empty"  # no artifact: the child's load fails
    empty.mkdir()
    with pytest.raises(RuntimeError, match="measuring the model's memory failed: "):
        measure_in_child(empty, manifest, tmp_path / "work")


def test_footprint_child_peak_is_the_model_s_not_the_parent_s(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    bundle = make_cpu_bundle(tmp_path / "m.ekb", tiny_classifier(tmp_path / "m.onnx"), keypair[0])
    verified = read_verified_manifest(bundle, TrustStore.from_files([keypair[1]]))
    model_dir = extract(bundle, verified, tmp_path / "model")
    held = np.ones(300 * 2**20 // 8)  # the parent (a packager) holds 300 MB when it starts the child
    got = measure_in_child(model_dir, verified.manifest, tmp_path / "work")
    assert held.sum() > 0
    assert got["peak_memory_mb"] < 50, got  # a model of a few kB: its load, not the parent's memory
    assert got["peak_memory_mb"] >= got["memory_mb"]
