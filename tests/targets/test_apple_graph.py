"""Graphs the ``apple`` path met on Keras/TF and PyTorch exports: tensor names Core ML sanitises
(``input.1``), elementwise ``Max``/``Min`` against constants (onnx2torch writes ``broadcast_to``),
PRelu on NHWC tensors, a comparison coremltools converts from ``torch.export`` but not from the
traced graph, and a torch op coremltools has no converter for on either path (one line naming the
op, its ONNX node and both paths' reasons; the other targets still ship). Each builds one
``.mlpackage`` candidate here; Core ML prediction needs macOS, so the package is checked by its spec
and the torch intermediate."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from edgekit.compress.onnx_prep import prepare_model
from edgekit.errors import UnsupportedOpError
from edgekit.targets.apple import AppleOptions, AppleTarget, build_one
from edgekit.targets.base import BuildContext
from edgekit.validate.ort_runner import ort_cpu_runner
from tests.factories import _save

pytestmark = pytest.mark.filterwarnings("ignore")  # coremltools warns about untested torch/tf versions
SHAPE = (1, 4, 6, 6)


def _graph(path: Path, nodes: list[Any], inits: dict[str, np.ndarray], x: str = "x", y: str = "y") -> Path:
    """x [N, 4, 6, 6] -> ``nodes`` -> Conv 1x1 (4 -> 3) -> y [N, 3, 6, 6]."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {**inits, "w": rng.standard_normal((3, 4, 1, 1)).astype(np.float32)}
    graph = helper.make_graph(
        [*nodes, helper.make_node("Conv", ["h", "w"], [y], name="head")],
        path.stem,
        [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["batch", 4, 6, 6])],
        [helper.make_tensor_value_info(y, TensorProto.FLOAT, ["batch", 3, 6, 6])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()],
    )
    return _save(graph, path, 13)


def _build(model: Path, root: Path, precision: str = "fp16") -> tuple[Any, BuildContext, Any]:
    prepared = prepare_model(model, root / "prepared")
    (root / "out").mkdir()
    (root / "work").mkdir()
    name = prepared.served.inputs[0].name
    ctx = BuildContext(
        model_path=prepared.path,
        served=prepared.served,
        precision=precision,
        calib={name: np.random.default_rng(1).standard_normal((4, *SHAPE[1:])).astype(np.float32)},
        static_shapes={name: SHAPE},
        out_dir=root / "out",
        work_dir=root / "work",
        options=AppleOptions(weight_threshold=0),
        progress=lambda _msg: None,
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return prepared, ctx, build_one(ctx)


def _agrees_with_onnx(prepared: Any, result: Any) -> None:
    x = np.random.default_rng(2).standard_normal(SHAPE).astype(np.float32)
    name, out = prepared.served.inputs[0].name, prepared.served.outputs[0].name
    want = ort_cpu_runner(prepared.path)({name: x})[out]
    got = result.intermediate({name: x})[out]
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2)  # activations rounded to FP16


def test_apple_maps_the_names_coreml_sanitised_back_to_the_model_names(tmp_path: Path) -> None:
    import coremltools as ct
    from onnx import helper

    model = _graph(tmp_path / "dotted.onnx", [helper.make_node("Relu", ["input.1"], ["h"])], {}, "input.1", "out.0")
    prepared, ctx, result = _build(model, tmp_path)
    spec = ct.utils.load_spec(str(ctx.out_dir / "model.mlpackage"))
    package_in = [i.name for i in spec.description.input]
    package_out = [o.name for o in spec.description.output]
    assert package_in == ["input_1"]  # what Core ML accepts
    assert [s.name for s in result.artifact_signature.inputs] == package_in
    assert [s.name for s in result.artifact_signature.outputs] == package_out
    # the bundle serves the ONNX model's names; the agent feeds Core ML the package's through the mapping
    assert {(m.served, m.artifact) for m in result.mapping} == {("input.1", "input_1"), ("out.0", package_out[0])}
    # a graph the traced path converts is built from it, as before torch.export was a second path
    assert _convert_tool(result).endswith(" -> torch.jit.trace -> coremltools " + ct.__version__)
    assert "converted from torch.jit.trace" in result.notes
    _agrees_with_onnx(prepared, result)


def _convert_tool(result: Any) -> str:
    (step,) = [s for s in result.provenance if s.kind == "convert"]
    return str(step.tool)


@pytest.mark.parametrize("precision", ["fp16", "int8-weights"])
def test_apple_converts_by_torch_export_when_coremltools_refuses_the_traced_graph(
    tmp_path: Path, precision: str
) -> None:
    """ONNX ``Greater`` is ``torch.greater`` in onnx2torch: traced it is ``aten::greater``, which
    coremltools 9 has no converter for; torch.export's core ATen decompositions write ``aten.gt``."""
    import coremltools as ct
    from onnx import TensorProto, helper

    from edgekit.compress.mlpackage_weights import compute_ops, load_program

    nodes = [
        helper.make_node("Greater", ["input.1", "t"], ["m"], name="/gate/cmp"),
        helper.make_node("Cast", ["m"], ["mf"], to=TensorProto.FLOAT),
        helper.make_node("Mul", ["input.1", "mf"], ["h"]),
    ]
    t = np.random.default_rng(7).standard_normal((4, 1, 1)).astype(np.float32)
    model = _graph(tmp_path / "gate.onnx", nodes, {"t": t}, "input.1", "out.0")
    prepared, ctx, result = _build(model, tmp_path, precision)
    assert _convert_tool(result).endswith(" -> torch.export -> coremltools " + ct.__version__)
    assert "converted from torch.export: the torch.jit.trace path failed, no converter for 'greater'" in result.notes
    spec, program = load_program(ctx.out_dir / "model.mlpackage")
    assert "greater" in {t for t, _ in compute_ops(program)}
    # the same name mapping as the traced path: Core ML's sanitised names back to the model's
    assert [i.name for i in spec.description.input] == ["input_1"]
    assert [s.name for s in result.artifact_signature.inputs] == ["input_1"]
    package_out = [o.name for o in spec.description.output]
    assert {(m.served, m.artifact) for m in result.mapping} == {("input.1", "input_1"), ("out.0", package_out[0])}
    assert result.artifact_signature.inputs[0].shape == SHAPE
    if precision == "int8-weights":
        assert any(n.startswith("package weights:") and "int8" in n for n in result.notes), result.notes
    _agrees_with_onnx(prepared, result)


def test_apple_converts_elementwise_max_and_min_against_constants(tmp_path: Path) -> None:
    from onnx import helper

    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Max", ["x", "floor"], ["m"]), helper.make_node("Min", ["m", "cap"], ["h"])]
    consts = {"floor": rng.standard_normal((4, 1, 1)).astype(np.float32), "cap": np.array([0.5], np.float32)}
    prepared, ctx, result = _build(_graph(tmp_path / "maxmin.onnx", nodes, consts), tmp_path)
    from edgekit.compress.mlpackage_weights import compute_ops, load_program

    ops = {t for t, _ in compute_ops(load_program(ctx.out_dir / "model.mlpackage")[1])}
    assert {"reduce_max", "reduce_min"} <= ops or {"maximum", "minimum"} <= ops, ops
    _agrees_with_onnx(prepared, result)


def test_apple_converts_prelu_on_nhwc_and_nchw_tensors_without_data_dependent_shapes(tmp_path: Path) -> None:
    from onnx import helper

    rng = np.random.default_rng(4)
    nodes = [
        helper.make_node("Transpose", ["x"], ["nhwc"], perm=[0, 2, 3, 1]),
        helper.make_node("PRelu", ["nhwc", "slope_hwc"], ["p1"]),  # Keras: slope [1, 1, C]
        helper.make_node("Transpose", ["p1"], ["nchw"], perm=[0, 3, 1, 2]),
        helper.make_node("PRelu", ["nchw", "slope_chw"], ["h"]),  # slope [C, 1, 1]
    ]
    slopes = {
        "slope_hwc": rng.uniform(0.1, 0.3, (1, 1, 4)).astype(np.float32),
        "slope_chw": rng.uniform(0.1, 0.3, (4, 1, 1)).astype(np.float32),
    }
    prepared, ctx, result = _build(_graph(tmp_path / "prelu.onnx", nodes, slopes), tmp_path)
    from edgekit.compress.mlpackage_weights import compute_ops, load_program

    ops = [t for t, _ in compute_ops(load_program(ctx.out_dir / "model.mlpackage")[1])]
    # the NHWC slope as Relu arithmetic, not a boolean mask (data-dependent shapes the Neural Engine does not
    # run); the per-channel one as Core ML's own prelu
    assert not {"non_zero", "gather_nd", "scatter_nd"} & set(ops), ops
    assert {"relu", "sub", "mul", "add"} <= set(ops) and ops.count("prelu") == 1, ops
    _agrees_with_onnx(prepared, result)


def _fmod(path: Path) -> Path:
    from onnx import helper

    return _graph(
        path,
        [helper.make_node("Mod", ["x", "d"], ["h"], fmod=1, name="/blocks.0/wrap")],
        {"d": np.array([0.7], np.float32)},
    )


def test_apple_names_the_op_coremltools_cannot_convert_in_one_line(tmp_path: Path) -> None:
    model = _fmod(tmp_path / "fmod.onnx")
    AppleTarget().check_model(model)  # onnx2torch takes Mod; coremltools has no converter for torch's fmod
    with pytest.raises(UnsupportedOpError) as exc:
        _build(model, tmp_path)
    message = str(exc.value)
    assert "no converter for the torch op 'fmod' (from ONNX node /blocks.0/wrap (Mod))" in message
    # both paths were tried, and the line says why each failed
    assert "torch.jit.trace: no converter for 'fmod'; torch.export: no converter for 'aten.fmod.Tensor'" in message
    assert "\n" not in message and exc.value.__cause__ is None and exc.value.__suppress_context__


def test_apple_refuses_in_one_line_a_graph_neither_path_converts(tmp_path: Path) -> None:
    """onnx2torch's reverse exclusive CumSum reads its axis with ``.item()``: coremltools fails on the
    traced graph and torch.export cannot specialise the data-dependent axis."""
    from onnx import helper

    node = helper.make_node("CumSum", ["x", "axis"], ["h"], reverse=1, exclusive=1, name="/scan")
    model = _graph(tmp_path / "cumsum.onnx", [node], {"axis": np.array(2, np.int64)})
    with pytest.raises(UnsupportedOpError) as exc:
        _build(model, tmp_path)
    message = str(exc.value)
    assert message.startswith("apple: coremltools ") and "could not convert the torch graph" in message
    assert "torch.jit.trace: coremltools failed (" in message and "; torch.export: export failed (" in message
    assert "\n" not in message


@pytest.mark.slow
def test_package_ships_the_other_targets_when_coremltools_cannot_convert(
    keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    from edgekit.packaging.result import PackageValidationError
    from tests.factories import package_small_data as package

    model = _fmod(tmp_path / "fmod.onnx")
    x = np.random.default_rng(5).standard_normal((8, *SHAPE[1:])).astype(np.float32)
    with pytest.raises(PackageValidationError) as exc:
        package(
            model,
            targets=["cpu", "apple"],
            precision="fp16",
            eval={"x": x},
            key=keypair[0],
            name="m",
            out_dir=tmp_path / "out",
        )
    result = exc.value.result
    assert set(result.bundles) == {"cpu"} and result.bundles["cpu"].exists()
    assert "no converter for the torch op 'fmod' (from ONNX node /blocks.0/wrap (Mod))" in result.errors["apple"]
    assert "\n" not in result.errors["apple"]


@pytest.mark.slow
def test_package_apple_bundle_serves_the_onnx_names_of_a_model_coreml_renames(
    keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    from onnx import helper

    from tests.factories import package_small_data as package

    model = _graph(tmp_path / "dotted.onnx", [helper.make_node("Relu", ["input.1"], ["h"])], {}, "input.1", "out.0")
    x = np.random.default_rng(6).standard_normal((8, *SHAPE[1:])).astype(np.float32)
    result = package(
        model,
        targets=["apple"],
        precision="fp16",
        eval={"input.1": x},
        key=keypair[0],
        name="m",
        out_dir=tmp_path / "out",
    )
    manifest = result.manifests["apple"]
    assert result.passed and result.bundles["apple"].exists()
    assert [s.name for s in manifest.signature.inputs] == ["input.1"]
    assert [s.name for s in manifest.signature.outputs] == ["out.0"]
    assert [s.name for s in manifest.artifact_signature.inputs] == ["input_1"]
    assert ("input.1", "input_1") in {(m.served, m.artifact) for m in manifest.mapping}
