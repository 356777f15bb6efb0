"""Shape sub-graphs folded once in preparation (``edgekit.compress.shape_fold``): the graph every
target converts has no run-time size computation left where the sizes are fixed, keeps the served
signature (dynamic batch included) and computes the same outputs; a model the folder cannot
handle is prepared and packaged unfolded, with a note saying why."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from edgekit.compress.onnx_prep import prepare_model
from edgekit.compress.shape_fold import resize_sizes_as_scales
from edgekit.compress.signature import served_signature
from tests.factories import tiny_unet


def _run(path: Path | onnx.ModelProto, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    data = path.SerializeToString() if isinstance(path, onnx.ModelProto) else str(path)
    return ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)


def _shape_fed(model: onnx.ModelProto, tensor: str) -> bool:
    """Whether ``tensor`` is computed (at any depth) from a Shape or Size node."""
    producer = {o: n for n in model.graph.node for o in n.output}
    todo, seen = [tensor], set()
    while todo:
        node = producer.get(todo.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if node.op_type in ("Shape", "Size"):
            return True
        todo.extend(i for i in node.input if i)
    return False


def _resize_size_inputs(model: onnx.ModelProto) -> list[str]:
    return [i for n in model.graph.node if n.op_type == "Resize" for i in n.input[1:] if i]


def test_prepare_folds_runtime_resize_and_reshape_sizes_keeping_the_dynamic_batch(tmp_path: Path) -> None:
    src = tiny_unet(tmp_path / "unet.onnx")
    source = onnx.load(str(src))
    assert any(_shape_fed(source, i) for i in _resize_size_inputs(source))  # the export computes sizes at run time
    prepared = prepare_model(src, tmp_path / "prep")
    assert prepared.graph_path is not None and prepared.graph_path != src
    note = next(s for s in prepared.steps if s.startswith("shape sub-graphs"))
    assert note.startswith("shape sub-graphs folded (onnxslim ") and "2 Resize sizes as constant scales" in note
    x = np.random.default_rng(0).standard_normal((3, 3, 32, 32)).astype(np.float32)
    (expected,) = _run(src, {"image": x})
    for path in (prepared.graph_path, prepared.path):  # what OpenVINO/NNCF get, and what the other targets get
        model = onnx.load(str(path))
        resize_inputs = _resize_size_inputs(model)
        assert len(resize_inputs) == 2 and not any(_shape_fed(model, i) for i in resize_inputs)
        reshapes = [n.input[1] for n in model.graph.node if n.op_type == "Reshape"]
        assert reshapes and not any(_shape_fed(model, i) for i in reshapes)
        assert not [n.op_type for n in model.graph.node if n.op_type in ("Shape", "Gather", "Unsqueeze", "Cast")]
        assert served_signature(model) == served_signature(source)
        assert served_signature(model).inputs[0].shape == ("batch", 3, 32, 32)
        (got,) = _run(path, {"image": x})  # batch 3: the batch axis was not folded to the export's 1
        assert got.shape == (3, 2, 32 * 32)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _upsample(size_out: int, size_in: int = 5) -> onnx.ModelProto:
    """``x`` [N, 2, size_in, size_in] resized (nearest) to ``Concat(Shape(x)[0:2], [size_out]*2)``."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "zero", "two"], ["nc"]),
        helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
        helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], mode="nearest", name="up"),
    ]
    graph = helper.make_graph(
        nodes,
        "up",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 2, size_in, size_in])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, size_out, size_out])],
        [
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([2], np.int64), "two"),
            numpy_helper.from_array(np.array([size_out, size_out], np.int64), "hw"),
        ],
    )
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize(("size_out", "rewritten"), [(10, 1), (15, 1), (7, 0)])
def test_resize_sizes_become_scales_only_where_the_scale_reproduces_them(size_out: int, rewritten: int) -> None:
    # 7/5 in float32 is 1.39999998: floor(5 * 1.39999998) = 6, so those sizes stay sizes
    model = _upsample(size_out)
    x = np.random.default_rng(1).standard_normal((2, 2, 5, 5)).astype(np.float32)
    (expected,) = _run(model, {"x": x})
    assert resize_sizes_as_scales(model) == rewritten
    up = next(n for n in model.graph.node if n.op_type == "Resize")
    assert len(up.input) == (3 if rewritten else 4)
    (got,) = _run(model, {"x": x})
    np.testing.assert_array_equal(got, expected)


def _with_unused_input(path: Path) -> Path:
    """A classifier-like graph that flattens through ``Reshape(x, Concat(Shape(x)[0:1], [-1]))``
    and has a second input nothing reads (exports keep such inputs): onnxslim drops that input,
    which would change the served signature."""
    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [
            helper.make_node("Shape", ["input"], ["s"]),
            helper.make_node("Slice", ["s", "zero", "one"], ["n"]),
            helper.make_node("Concat", ["n", "minus_one"], ["target"], axis=0),
            helper.make_node("Reshape", ["input", "target"], ["flat"]),
            helper.make_node("Gemm", ["flat", "w", "b"], ["logits"]),
        ],
        "unused",
        [
            helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 4, 4]),
            helper.make_tensor_value_info("unused", TensorProto.FLOAT, ["batch", 1]),
        ],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
        [
            numpy_helper.from_array(rng.standard_normal((48, 5)).astype(np.float32), "w"),
            numpy_helper.from_array(rng.standard_normal(5).astype(np.float32), "b"),
            numpy_helper.from_array(np.array([0], np.int64), "zero"),
            numpy_helper.from_array(np.array([1], np.int64), "one"),
            numpy_helper.from_array(np.array([-1], np.int64), "minus_one"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_prepare_keeps_the_model_unfolded_when_folding_would_change_its_signature(tmp_path: Path) -> None:
    src = _with_unused_input(tmp_path / "unused.onnx")
    prepared = prepare_model(src, tmp_path / "prep")
    note = next(s for s in prepared.steps if s.startswith("shape sub-graphs"))
    assert note == (
        f"shape sub-graphs not folded (onnxslim {__import__('onnxslim').__version__}): it changed the inputs "
        "['input', 'unused'] -> ['input']; the unfolded model is used"
    )
    assert prepared.graph_path == src
    assert [t.name for t in prepared.served.inputs] == ["input", "unused"]


def test_package_of_a_model_the_folder_refuses_still_writes_a_bundle_with_the_note(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    from edgekit import package

    src = _with_unused_input(tmp_path / "unused.onnx")
    result = package(src, targets=["cpu"], precision="fp32", key=keypair[0], name="unused", out_dir=tmp_path / "out")
    manifest = result.manifests["cpu"]
    assert result.passed and result.bundles["cpu"].is_file()
    assert [t.name for t in manifest.signature.inputs] == ["input", "unused"]
    assert any(n.startswith("prepared: shape sub-graphs not folded (onnxslim") for n in manifest.validation.notes)
    assert any(s.kind == "prepare" and s.notes.startswith("shape sub-graphs not folded") for s in manifest.provenance)


def test_intel_ir_is_converted_from_the_folded_graph(tmp_path: Path, keypair: tuple[Path, Path]) -> None:
    pytest.importorskip("openvino", reason="the intel target needs openvino")
    from edgekit import package
    from edgekit.bundle import TrustStore, extract, read_verified_manifest

    src = tiny_unet(tmp_path / "unet.onnx")
    result = package(src, targets=["intel"], precision="fp32", key=keypair[0], name="unet", out_dir=tmp_path / "out")
    assert result.passed
    verified = read_verified_manifest(result.bundles["intel"], TrustStore.from_files([keypair[1]]))
    files = extract(result.bundles["intel"], verified, tmp_path / "x")
    xml = (files / "model.xml").read_text()
    assert 'type="Interpolate"' in xml and 'type="ShapeOf"' not in xml  # the export's IR keeps 4 ShapeOf
    notes = [s.notes for s in verified.manifest.provenance if s.kind == "prepare"]
    assert any(n.startswith("shape sub-graphs folded (onnxslim") for n in notes)
    assert verified.manifest.signature.inputs[0].shape == ("batch", 3, 32, 32)


def test_a_fixed_batch_of_one_is_folded_and_checked_one_sample_at_a_time(tmp_path: Path) -> None:
    src = tiny_unet(tmp_path / "unet.onnx", batch=1, opset=11)
    prepared = prepare_model(src, tmp_path / "prep")
    note = next(s for s in prepared.steps if s.startswith("shape sub-graphs"))
    assert note.startswith("shape sub-graphs folded"), note  # was: ONNX Runtime could not run it on drawn inputs
    model = onnx.load(str(prepared.path))
    assert served_signature(model).inputs[0].shape == (1, 3, 32, 32)
    assert not [n for n in model.graph.node if n.op_type == "Shape"]


@pytest.mark.parametrize("fold", [False, True])
def test_ort_fp16_of_a_resize_with_empty_scales_loads_and_matches(tmp_path: Path, fold: bool) -> None:
    """Opset-11 exports give Resize an empty ``scales`` next to ``sizes``; after the opset upgrade
    the float16 converter casts it and ONNX Runtime refused the node ("Either `sizes` or `scales`
    must be provided, but not both")."""
    from edgekit.targets.cpu import _fp16

    src = tiny_unet(tmp_path / "unet.onnx", batch=1, opset=11)
    source = onnx.load(str(src))
    assert any(n.op_type == "Resize" and len(n.input) == 4 and n.input[2] for n in source.graph.node)
    prepared = prepare_model(src, tmp_path / "prep")
    graph = prepared.path if fold else tmp_path / "prep" / "staged.onnx"  # folded, and upgraded only
    out = tmp_path / "fp16.onnx"
    _fp16(graph, out, None)  # type: ignore[arg-type]  # the build space is not read
    x = np.random.default_rng(1).standard_normal((1, 3, 32, 32)).astype(np.float32)
    (expected,) = _run(src, {"image": x})
    (got,) = _run(out, {"image": x})
    np.testing.assert_allclose(got, expected, rtol=2e-2, atol=2e-2)


def _masked_softmax(path: Path) -> Path:
    """``scores`` [1, 4] + (1 - ``mask``) * finfo(float32).min, softmax: BERT's additive mask as
    transformers exports it (int64 mask cast to float)."""
    nodes = [
        helper.make_node("Cast", ["mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Sub", ["one", "maskf"], ["inv"]),
        helper.make_node("Mul", ["inv", "minf"], ["bias"]),
        helper.make_node("Add", ["scores", "bias"], ["biased"]),
        helper.make_node("Softmax", ["biased"], ["probs"], axis=-1),
    ]
    graph = helper.make_graph(
        nodes,
        "masked",
        [
            helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", 4]),
            helper.make_tensor_value_info("mask", TensorProto.INT64, ["batch", 4]),
        ],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 4])],
        [
            numpy_helper.from_array(np.float32(1.0), "one"),
            numpy_helper.from_array(np.float32(np.finfo(np.float32).min), "minf"),
        ],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    return path


def test_an_attention_masks_float32_min_is_written_in_the_float16_range(tmp_path: Path) -> None:
    from edgekit.targets.jetson import fp16_weights_model

    src = _masked_softmax(tmp_path / "masked.onnx")
    prepared = prepare_model(src, tmp_path / "prep")
    assert any("mask constant(s) of +-3.4e38 written as +-10000" in s for s in prepared.steps)
    feed = {
        "scores": np.array([[1.0, 2.0, 3.0, 4.0]], np.float32),
        "mask": np.array([[1, 1, 0, 0]], np.int64),
    }
    (expected,) = _run(src, feed)
    (same,) = _run(prepared.path, feed)
    np.testing.assert_array_equal(same, expected)  # float32: masked positions still weigh exactly 0
    for path in (src, prepared.path):
        rounded = fp16_weights_model(path, tmp_path / f"fp16-{path.stem}.onnx")  # jetson's FP16 emulation
        (got,) = _run(rounded, feed)
        assert np.isfinite(got).all() == (path == prepared.path)  # the source's -inf gives 0 * -inf = NaN
    np.testing.assert_allclose(got, expected, atol=1e-6)
