"""Row independence, checked on golden rows with the runtime that validated the artifact: a model
whose outputs mix rows (a mean over the batch axis) is recorded ``rows_independent = false`` in
its manifest, a per-row model ``true``; a batch that does not run or a static batch axis are
said so. Models are built here; the runtime is ONNX Runtime through the device's runner."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgekit import package
from edgekit.bundle.manifest import Golden, Signature, TensorSpec
from edgekit.validate.row_independence import check_rows
from tests.agent.bundles import reshape_model
from tests.factories import tiny_dense

GOLDEN = Golden(file="golden.npz", count=4)


def _graph_model(path: Path, nodes: list[Any], inits: list[Any] | None = None) -> Path:
    """``x[batch, 8] -> y[batch, 8]`` through ``nodes``."""
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        nodes,
        "rows",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 8])],
        inits or [],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def batch_mixing_model(path: Path) -> Path:
    """``y = x - mean(x over the batch axis)``: each row's answer depends on its companions."""
    from onnx import helper

    return _graph_model(
        path,
        [
            helper.make_node("ReduceMean", ["x"], ["m"], axes=[0], keepdims=1),
            helper.make_node("Sub", ["x", "m"], ["y"]),
        ],
    )


def per_row_model(path: Path) -> Path:
    """``y = softmax(x, axis=1)``: each row alone."""
    from onnx import helper

    return _graph_model(path, [helper.make_node("Softmax", ["x"], ["y"], axis=1)])


def _ort(path: Path):  # type: ignore[no-untyped-def]  # returns a RunFn
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return lambda feed: dict(zip(names, sess.run(None, feed), strict=True))


def _signature(batch: int | str = "batch") -> Signature:
    spec = (TensorSpec("x", "float32", (batch, 8)),)
    return Signature(inputs=spec, outputs=(TensorSpec("y", "float32", (batch, 8)),))


ROWS = {"x": np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)}


def test_check_rows_finds_a_model_that_mixes_rows_across_the_batch(tmp_path: Path) -> None:
    check = check_rows(_ort(batch_mixing_model(tmp_path / "mix.onnx")), ROWS, _signature(), GOLDEN)
    assert check.independent is False
    assert (
        "output 'y' of row 0 changes by up to" in check.reason and "when another row shares its batch" in check.reason
    )
    assert check.line().endswith("; agents will refuse to batch this model")


def test_check_rows_passes_a_per_row_model(tmp_path: Path) -> None:
    check = check_rows(_ort(per_row_model(tmp_path / "softmax.onnx")), ROWS, _signature(), GOLDEN)
    assert check.independent is True, check.reason


def test_check_rows_makes_a_second_row_when_the_golden_rows_are_the_same(tmp_path: Path) -> None:
    same = {"x": np.repeat(ROWS["x"][:1], 2, axis=0)}  # identical rows would hide the mixing
    check = check_rows(_ort(batch_mixing_model(tmp_path / "mix.onnx")), same, _signature(), GOLDEN)
    assert check.independent is False


def test_check_rows_says_a_batch_of_two_that_does_not_run_is_not_independent(tmp_path: Path) -> None:
    sig = Signature(
        inputs=(TensorSpec("x", "float32", ("batch", 4)),), outputs=(TensorSpec("y", "float32", ("batch", 4)),)
    )
    rows = {"x": np.ones((2, 4), np.float32)}
    check = check_rows(_ort(reshape_model(tmp_path / "reshape.onnx")), rows, sig, GOLDEN)
    assert check.independent is False and check.reason.startswith("a batch of 2 golden rows does not run")


def test_check_rows_leaves_a_static_batch_axis_unchecked(tmp_path: Path) -> None:
    check = check_rows(_ort(per_row_model(tmp_path / "softmax.onnx")), ROWS, _signature(batch=1), GOLDEN)
    assert check.independent is None and "static batch axis" in check.reason


@pytest.mark.parametrize(("build", "expected"), [(batch_mixing_model, False), (tiny_dense, True)])
def test_package_records_rows_independent_in_the_manifest(build, expected: bool, keypair, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]  # a factory
    model = build(tmp_path / "model.onnx")
    from onnxruntime import InferenceSession

    spec = InferenceSession(str(model)).get_inputs()[0]
    shape = [4 if not isinstance(d, int) else d for d in spec.shape]
    rng = np.random.default_rng(0)
    calib, held_out = ({spec.name: rng.standard_normal([n, *shape[1:]]).astype(np.float32)} for n in (30, 50))
    result = package(
        model,
        targets="cpu",
        precision="fp32",
        calib=calib,
        eval=held_out,
        key=keypair[0],
        name="rows",
        out_dir=tmp_path,
    )
    assert result.manifests["cpu"].rows_independent is expected
