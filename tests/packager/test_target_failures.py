"""One target's failure never stops the others: ``edgekit package --target a,b,c`` builds every
target it can, reports each failure in one line and exits non-zero at the end."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekit.cli import main
from edgekit.errors import UnsupportedOpError
from edgekit.packaging.result import PackageValidationError
from tests.factories import _save
from tests.factories import package_small_data as package


def _thresholded_relu_mlp(path: Path) -> Path:
    """x [N, 8] -> MatMul -> ThresholdedRelu -> MatMul -> y [N, 4, 1]: ONNX Runtime and TensorRT run
    ThresholdedRelu, onnx2torch (apple's first step) has no converter for it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("MatMul", ["x", "a"], ["h"], name="fc1"),
        helper.make_node("ThresholdedRelu", ["h"], ["t"], alpha=0.1, name="gate"),
        helper.make_node("MatMul", ["t", "b"], ["z"], name="fc2"),
        helper.make_node("Unsqueeze", ["z", "axes"], ["y"], name="as_map"),
    ]
    graph = helper.make_graph(
        nodes,
        "thresholded",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4, 1])],
        [
            numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "a"),
            numpy_helper.from_array(rng.standard_normal((16, 4)).astype(np.float32), "b"),
            numpy_helper.from_array(np.array([2], dtype=np.int64), "axes"),
        ],
    )
    return _save(graph, path, 13)


def _data() -> dict[str, np.ndarray]:
    return {"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}


def test_package_builds_every_other_target_when_one_cannot_convert_the_model(keypair, tmp_path: Path) -> None:
    model = _thresholded_relu_mlp(tmp_path / "m.onnx")
    with pytest.raises(PackageValidationError) as info:
        package(
            model,
            targets=["cpu", "apple", "jetson"],
            precision="fp32",
            calib=_data(),
            key=keypair[0],
            name="m",
            out_dir=tmp_path,
        )
    result = info.value.result
    assert set(result.bundles) == {"cpu", "jetson"} and all(p.is_file() for p in result.bundles.values())
    assert [r.target for r in result.rows] == ["cpu", "jetson"] and all(r.passed for r in result.rows)
    assert set(result.errors) == {"apple"} and "ThresholdedRelu" in result.errors["apple"]
    (line,) = str(info.value).splitlines()  # one line per failed target
    assert line.startswith("apple fp32: ") and "ThresholdedRelu" in line
    assert info.value.exit_code == 3


def test_package_with_one_target_raises_its_own_error(keypair, tmp_path: Path) -> None:
    model = _thresholded_relu_mlp(tmp_path / "m.onnx")
    with pytest.raises(UnsupportedOpError, match="ThresholdedRelu"):
        package(model, targets=["apple"], precision="fp32", calib=_data(), key=keypair[0], name="m", out_dir=tmp_path)


def test_cli_package_multi_target_exits_non_zero_after_writing_what_it_could(tmp_path: Path, capsys) -> None:
    model = _thresholded_relu_mlp(tmp_path / "m.onnx")
    np.savez(tmp_path / "calib.npz", **_data())  # type: ignore[arg-type]  # numpy's savez kwargs stub is too narrow
    assert main(["keygen", "--out", str(tmp_path / "keys"), "--name", "k"]) == 0
    capsys.readouterr()
    code = main([
        "package", str(model), "--target", "apple,cpu", "--precision", "fp32", "--calib", str(tmp_path / "calib.npz"),
        "--key", str(tmp_path / "keys" / "k.key"), "--name", "m", "--version", "1", "-o", str(tmp_path / "out"),
        "-q", "--json", "--allow-small-eval",
    ])  # fmt: skip
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert code == 3 and not doc["passed"]
    assert set(doc["bundles"]) == {"cpu"} and Path(doc["bundles"]["cpu"]).is_file()
    assert list(doc["errors"]) == ["apple"] and "ThresholdedRelu" in doc["errors"]["apple"]
    assert len(doc["error"].splitlines()) == 1
