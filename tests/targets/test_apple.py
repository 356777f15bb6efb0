"""The ``apple`` target (Core ML ``.mlpackage``) and the ``coreml`` device runtime.

Core ML prediction needs macOS; none here. What runs here: the conversion itself, the package's
structure (spec, interface, files), its compressed weights read back from disk (int8 / LUT), the
torch intermediate that computes with them, the runtime's refusal on Linux and ``edgekit.package``
end to end. Prediction on Core ML is ``requires_macos``. One conversion per precision (module fixture).
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from device_agents.errors import IncompatibleError
from device_agents.runtimes import load_model
from device_agents.runtimes.coreml import compute_units, package_dir
from device_agents.runtimes.options import CoreMlOptions
from edgekit.bundle import file_entries
from edgekit.errors import BundleError, ConfigError, ValidationFailedError
from edgekit.optimize.run import build as build_with_engine
from edgekit.targets.apple import AppleOptions, AppleTarget
from edgekit.targets.base import BuildContext
from edgekit.targets.op_support import TargetOpError
from edgekit.validate.ort_runner import ort_cpu_runner
from tests.factories import sample_inputs, tiny_classifier
from tests.packager.conftest import confident_inputs

pytestmark = pytest.mark.filterwarnings("ignore")  # coremltools warns about untested torch/tf versions
ON_MACOS = sys.platform == "darwin"
SMALL = AppleOptions(weight_threshold=0)  # the tiny model's weights are under coremltools' 2048 default


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    from edgekit.compress.onnx_prep import prepare_model

    root = tmp_path_factory.mktemp("apple-src")
    return prepare_model(tiny_classifier(root / "tiny.onnx"), root / "prepared")


def _ctx(prepared, root: Path, precision: str, options: AppleOptions = SMALL) -> BuildContext:
    (root / "out").mkdir(parents=True)
    (root / "work").mkdir(parents=True)
    return BuildContext(
        model_path=prepared.path,
        served=prepared.served,
        precision=precision,
        calib={"input": sample_inputs(8)},
        static_shapes={"input": (1, 3, 16, 16)},
        out_dir=root / "out",
        work_dir=root / "work",
        options=options,
        progress=lambda _msg: None,
    )


@pytest.fixture(scope="module")
def build(prepared, tmp_path_factory: pytest.TempPathFactory):
    """``build(precision)`` -> (context, result), converting each precision at most once."""
    done: dict[str, tuple[BuildContext, object]] = {}

    def get(precision: str):
        if precision not in done:
            ctx = _ctx(prepared, tmp_path_factory.mktemp(f"apple-{precision}"), precision)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                done[precision] = (ctx, build_with_engine(AppleTarget(), ctx))
        return done[precision]

    return get


def _served_outputs(fn, x: np.ndarray) -> np.ndarray:
    return np.concatenate([fn({"input": x[i : i + 1]})["probs"] for i in range(len(x))])


# -- the package and its structure -------------------------------------------------------------------


def test_apple_lists_every_file_of_the_mlpackage_as_a_flat_bundle_path(build) -> None:
    ctx, result = build("fp16")
    on_disk = sorted(p.relative_to(ctx.out_dir).as_posix() for p in ctx.out_dir.rglob("*") if p.is_file())
    assert sorted(result.files) == on_disk
    assert "model.mlpackage/Manifest.json" in result.files
    assert "model.mlpackage/Data/com.apple.CoreML/model.mlmodel" in result.files
    assert set(result.files.values()) == {"artifact"}
    entries = file_entries(ctx.out_dir, result.files)  # the archive writer takes these paths as they are
    assert all(e.size_bytes > 0 for e in entries)


def test_apple_package_spec_loads_and_matches_the_recorded_interface(build) -> None:
    import coremltools as ct

    ctx, result = build("fp16")
    model = ct.models.MLModel(str(ctx.out_dir / "model.mlpackage"), skip_model_load=True)
    desc = model.get_spec().description
    assert [i.name for i in desc.input] == [s.name for s in result.artifact_signature.inputs] == ["input"]
    assert [o.name for o in desc.output] == [s.name for s in result.artifact_signature.outputs]
    assert tuple(desc.input[0].type.multiArrayType.shape) == result.artifact_signature.inputs[0].shape == (1, 3, 16, 16)
    served_to_artifact = {m.served: m.artifact for m in result.mapping}
    assert served_to_artifact == {"input": desc.input[0].name, "probs": desc.output[0].name}
    assert result.static and not result.runnable_here
    assert result.compatibility.runtime == "coreml"
    assert result.target_options["minimum_deployment_target"] == "iOS16"


def test_apple_int8_weights_are_stored_as_int8_and_shrink_the_weight_file(build) -> None:
    from edgekit.compress.mlpackage_weights import load_program, main_operations, package_weights

    fp16_ctx, _ = build("fp16")
    ctx, result = build("int8-weights")
    _, program = load_program(ctx.out_dir / "model.mlpackage")
    op_types = {op.op_type for op in main_operations(program)}
    assert "constexpr_affine_dequantize" in op_types
    compressed = [w for w in package_weights(program) if w.compressed]
    assert sorted(w.base_name for w in compressed) == ["conv1_weight", "conv2_weight", "fc_weight"]
    assert {w.compression for w in compressed} == {"int8"}
    weight_bin = "model.mlpackage/Data/com.apple.CoreML/weights/weight.bin"
    assert (ctx.out_dir / weight_bin).stat().st_size < (fp16_ctx.out_dir / weight_bin).stat().st_size
    assert (result.precision.weights, result.precision.activations) == ("int8", "fp16")
    assert "package weights: 3 float16, 3 int8" in result.notes


def test_apple_palettize4_stores_16_entry_luts_and_the_intermediate_computes_with_them(build, prepared) -> None:
    import torch

    from edgekit.compress.freeze import freeze_graph
    from edgekit.compress.mlpackage_weights import load_into_torch, load_program, package_weights
    from edgekit.compress.onnx_to_torch import onnx_to_torch

    ctx, result = build("palettize4")
    _, program = load_program(ctx.out_dir / "model.mlpackage")
    compressed = [w for w in package_weights(program) if w.compressed]
    assert {(w.op_type, w.compression) for w in compressed} == {("constexpr_lut_to_dense", "palettized-4bit")}
    module = onnx_to_torch(freeze_graph(prepared.path, ctx.work_dir / "again.onnx", {"input": (1, 3, 16, 16)}).path)
    _, uncompressed = load_program(next(ctx.work_dir.rglob("uncompressed.mlpackage")))
    report = load_into_torch(module, package_weights(program), package_weights(uncompressed))
    assert len(report.compressed_loaded) == 3
    assert report.min_compressed_cosine is not None and report.min_compressed_cosine > 0.9
    weights = dict(module.named_parameters())
    assert all(len(torch.unique(weights[n])) <= 16 for n in ("conv1.weight", "conv2.weight", "fc.weight"))
    # the target's intermediate is that graph: it differs from the fp16 build's
    x = sample_inputs(8, seed=4)
    _, fp16 = build("fp16")
    assert not np.allclose(_served_outputs(result.intermediate, x), _served_outputs(fp16.intermediate, x), atol=1e-4)
    assert (
        result.intermediate_name
        == "torch intermediate with the mlpackage's dequantized weights, activations rounded to FP16"
    )


def test_apple_palettize4_per_grouped_channel_keeps_one_lut_per_channel_group(prepared, tmp_path: Path) -> None:
    from edgekit.compress.mlpackage_weights import load_program, main_operations

    options = AppleOptions(
        weight_threshold=0, minimum_deployment_target="iOS18", palettize_granularity="per_grouped_channel"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = build_with_engine(AppleTarget(), _ctx(prepared, tmp_path, "palettize4", options))
    _, program = load_program(tmp_path / "out" / "model.mlpackage")
    luts = {
        op.outputs[0].name: op.inputs["lut"].val.shape
        for op in main_operations(program)
        if op.op_type == "constexpr_lut_to_dense"
    }
    # conv1 (8 output channels) and conv2 (16): 2 and 4 LUTs of 16 entries; fc's 10 channels do not split into 4s
    assert sorted(shape[0] for shape in luts.values()) == [2, 4]
    assert all(shape[-2:] == (16, 1) for shape in luts.values())
    assert "one LUT per 4 output channels" in result.precision.method
    assert "package weights: 4 float16, 2 palettized-4bit" in result.notes


def test_apple_refuses_grouped_luts_below_ios18() -> None:
    with pytest.raises(ConfigError, match=r"targets\.apple\.palettize_granularity: per_grouped_channel .* not iOS16"):
        AppleOptions(palettize_granularity="per_grouped_channel", minimum_deployment_target="iOS16")
    with pytest.raises(ConfigError, match=r"targets\.apple\.palettize_group_size: must be >= 1"):
        AppleOptions(palettize_group_size=0)


def test_apple_fp16_intermediate_agrees_with_fp32_onnx(build, prepared) -> None:
    _, result = build("fp16")
    x = confident_inputs(prepared.path, 16, seed=2)
    ref = ort_cpu_runner(prepared.path)({"input": x})["probs"]
    got = _served_outputs(result.intermediate, x)
    assert np.mean(got.argmax(1) == ref.argmax(1)) == 1.0
    assert 0 < np.abs(got - ref).max() < 1e-2  # fp16 weights and activations: close, not identical


def test_apple_op_placement_comes_from_the_mil_program(build) -> None:
    _, result = build("fp16")
    placement = result.op_placement
    types = {e.op for e in placement.entries}
    assert {"conv", "relu", "linear", "softmax"} <= types
    assert not any(t == "const" or t.startswith("constexpr_") for t in types)
    if not ON_MACOS:
        assert {e.device for e in placement.entries} == {"not measured here"}
        assert "device not measured here" in placement.tool


def test_apple_refuses_to_label_uncompressed_weights_as_int8(prepared, tmp_path: Path) -> None:
    ctx = _ctx(prepared, tmp_path, "int8-weights", AppleOptions())  # default threshold 2048 > every weight here
    with pytest.raises(ConfigError, match=r"targets\.apple\.weight_threshold: no weight has 2048 or more elements"):
        build_with_engine(AppleTarget(), ctx)


def test_loading_package_weights_refuses_a_compressed_weight_with_no_torch_tensor(prepared, tmp_path: Path) -> None:
    from edgekit.compress.freeze import freeze_graph
    from edgekit.compress.mlpackage_weights import PackageWeight, load_into_torch
    from edgekit.compress.onnx_to_torch import onnx_to_torch

    module = onnx_to_torch(freeze_graph(prepared.path, tmp_path / "f.onnx", {"input": (1, 3, 16, 16)}).path)
    conv1 = module.conv1.weight.detach().numpy()
    lut = "constexpr_lut_to_dense"

    def weight(name: str, values: np.ndarray, op_type: str = "const") -> PackageWeight:
        return PackageWeight(name, values, "palettized-4bit" if op_type == lut else "float16", op_type, (("c", "w"),))

    mystery = np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32)
    with pytest.raises(
        ValidationFailedError, match=r"1 compressed weight.*: op_7_q \(uncompressed as op_7, which is no "
    ):
        load_into_torch(module, [weight("op_7_q", mystery, lut)], [weight("op_7", mystery)])
    with pytest.raises(ValidationFailedError, match=r"op_8_q \(feeds the inputs of 0 constants"):
        load_into_torch(module, [weight("op_8_q", conv1, lut)], [])
    with pytest.raises(ValidationFailedError, match="does not match torch tensor conv1_weight"):
        load_into_torch(module, [weight("conv1_weight_q", -conv1, lut)], [weight("conv1_weight", conv1)])


# -- linking package constants to torch tensors ----------------------------------------------------------


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "conv_a_weight": rng.standard_normal((8, 4, 3, 3)),
        "conv_b_weight": rng.standard_normal((8, 4, 3, 3)),
        "conv_a_bias": rng.standard_normal(8),
        "fc_weight": rng.standard_normal((10, 16)),
    }


def _const(name: str, values: np.ndarray) -> object:
    from edgekit.compress.mlpackage_weights import PackageWeight

    return PackageWeight(name, values.astype(np.float16).astype(np.float32), "float16", "const")


def test_link_weights_finds_a_renamed_constant_with_a_fused_scale_by_value() -> None:
    from edgekit.compress.mlpackage_weights import link_weights

    t = _tensors()
    hard_sigmoid = 0.2 * t["conv_b_weight"]  # coremltools' fuse_conv_scale under a new name
    per_channel = np.linspace(0.5, 2.0, 8)[:, None, None, None] * t["conv_a_weight"]  # batch norm folded in
    links, why = link_weights(
        [
            _const("op_813_weight_0", hard_sigmoid),
            _const("var_9_weight_0", per_channel),
            _const("fc_weight", t["fc_weight"].T),
        ],
        t,
    )
    assert why == {}
    b, a, fc = links["op_813_weight_0"], links["var_9_weight_0"], links["fc_weight"]
    assert (b.tensor, b.by, b.transposed) == ("conv_b_weight", "value", False)
    assert float(b.scale) == pytest.approx(0.2, rel=1e-4)
    assert (a.tensor, a.scale.shape) == ("conv_a_weight", (8, 1, 1, 1))
    np.testing.assert_allclose(a.scale.ravel(), np.linspace(0.5, 2.0, 8), rtol=1e-3)
    assert (fc.tensor, fc.by, fc.transposed, fc.rescaled) == ("fc_weight", "name", True, False)
    # what goes into torch is the package constant with the fused scale divided out
    np.testing.assert_allclose(b.to_torch(0.2 * t["conv_b_weight"]), t["conv_b_weight"], rtol=1e-4, atol=1e-6)


def test_link_weights_refuses_affine_copies_and_ambiguous_values() -> None:
    from edgekit.compress.mlpackage_weights import link_weights

    t = _tensors()
    t["conv_c_weight"] = t["conv_b_weight"] * 3.0  # two free tensors a constant fits equally
    links, why = link_weights(
        [_const("const_9", 0.2 * t["conv_a_bias"] + 0.5), _const("op_5_weight", 0.2 * t["conv_b_weight"])], t
    )
    assert links == {}
    assert why["const_9"] == "is no scaled copy of a free torch tensor of shape [8]"  # HardSigmoid's fused bias
    assert why["op_5_weight"] == "fits several free torch tensors (conv_b_weight, conv_c_weight): ambiguous"


def test_link_weights_does_not_give_a_named_tensor_to_a_second_constant() -> None:
    from edgekit.compress.mlpackage_weights import link_weights

    t = _tensors()
    links, why = link_weights([_const("conv_a_weight", t["conv_a_weight"]), _const("op_3", t["conv_a_weight"])], t)
    assert links["conv_a_weight"].by == "name" and not links["conv_a_weight"].rescaled
    assert "op_3" in why


def _se_classifier(path: Path) -> Path:
    """The tiny classifier with a MobileNetV3 squeeze-excite block gated by HardSigmoid(0.2, 0.5), as
    paddle2onnx writes PP-OCR: coremltools folds the gate's 0.2 into the conv before it."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)

    def init(name: str, shape: tuple[int, ...], scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    node = helper.make_node
    nodes = [
        node("Conv", ["input", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        node("Relu", ["c1"], ["r1"]),
        node("GlobalAveragePool", ["r1"], ["squeeze"]),
        node("Conv", ["squeeze", "w_se1", "b_se1"], ["se1"]),
        node("Relu", ["se1"], ["se1r"]),
        node("Conv", ["se1r", "w_se2", "b_se2"], ["se2"]),
        node("HardSigmoid", ["se2"], ["gate"], alpha=0.2, beta=0.5),
        node("Mul", ["r1", "gate"], ["excited"]),
        node("Conv", ["excited", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        node("Relu", ["c2"], ["r2"]),
        node("GlobalAveragePool", ["r2"], ["gap"]),
        node("Flatten", ["gap"], ["flat"], axis=1),
        node("Gemm", ["flat", "w3", "b3"], ["logits"], transB=1),
        node("Softmax", ["logits"], ["probs"], axis=1),
    ]
    shapes = {"w1": (8, 3, 3, 3), "w_se1": (4, 8, 1, 1), "w_se2": (8, 4, 1, 1), "w2": (16, 8, 3, 3), "w3": (10, 16)}
    inits = [init(n, s, 1.0 if n == "w3" else 0.3) for n, s in shapes.items()]
    inits += [init(f"b{n[1:]}", (s[0],), 0.1) for n, s in shapes.items()]
    graph = helper.make_graph(
        nodes,
        "se_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("precision", ["int8-weights", "palettize4"])
def test_apple_intermediate_takes_a_compressed_weight_coremltools_fused_a_scale_into(
    precision: str, tmp_path: Path
) -> None:
    from edgekit.compress.freeze import freeze_graph
    from edgekit.compress.mlpackage_weights import load_into_torch, load_program, package_weights
    from edgekit.compress.onnx_prep import prepare_model
    from edgekit.compress.onnx_to_torch import onnx_to_torch

    prepared = prepare_model(_se_classifier(tmp_path / "se.onnx"), tmp_path / "prepared")
    ctx = _ctx(prepared, tmp_path, precision)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = build_with_engine(AppleTarget(), ctx)
    _, program = load_program(ctx.out_dir / "model.mlpackage")
    (fused,) = [w for w in package_weights(program) if w.compressed and w.values.shape == (8, 4, 1, 1)]
    assert not fused.base_name.startswith("w_se2")  # renamed by the fusion: only its value can place it
    assert f"1 with a scale coremltools fused in divided out ({fused.name})" in " ".join(result.notes)
    # loaded into torch, the SE conv holds the package's compressed weight with the 0.2 divided out
    module = onnx_to_torch(freeze_graph(prepared.path, tmp_path / "again.onnx", {"input": (1, 3, 16, 16)}).path)
    _, uncompressed = load_program(next(ctx.work_dir.rglob("uncompressed.mlpackage")))
    report = load_into_torch(module, package_weights(program), package_weights(uncompressed))
    assert report.by_value == report.rescaled == (fused.name,)
    (se2,) = [p for p in module.parameters() if tuple(p.shape) == (8, 4, 1, 1)]
    np.testing.assert_allclose(se2.detach().numpy() * 0.2, fused.values, rtol=1e-3, atol=1e-6)
    x = confident_inputs(prepared.path, 16, seed=2)
    ref = ort_cpu_runner(prepared.path)({"input": x})["probs"]
    got = _served_outputs(result.intermediate, x)
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.9


# -- W8A8 (--precision int8) -------------------------------------------------------------------------


def test_apple_w8a8_package_holds_activation_quantization_and_the_intermediate_computes_with_its_scales(
    build, prepared
) -> None:
    from edgekit.compress.mlpackage_weights import load_program, main_operations
    from edgekit.compress.torch_w8a8 import package_activation_quant, torch_activation_quant

    ctx, result = build("int8")
    _, program = load_program(ctx.out_dir / "model.mlpackage")
    ops = [op.op_type for op in main_operations(program)]
    assert ops.count("quantize") >= 3 and ops.count("constexpr_affine_dequantize") == 3  # conv1, conv2, fc
    assert result.precision.label == "w8a8" and "LinearQuantizer" in result.precision.method
    assert result.compatibility.hardware == {"minimum_deployment_target": "iOS17"}  # the lowest W8A8 runs on
    assert result.target_options["minimum_deployment_target"] == "iOS17"
    assert [step.kind for step in result.provenance] == ["fix_shapes", "simplify", "quantize", "convert", "select"]
    # the intermediate is the quantized torch graph, holding the package's FP16 activation scales exactly
    module = inspect.getclosurevars(result.intermediate).nonlocals["module"]  # what torch_runner runs
    package_scales = [q.scale for q in package_activation_quant(program)]
    torch_scales = [q.scale for q in torch_activation_quant(module)]
    assert set(package_scales) <= set(torch_scales)
    assert all(np.float16(s) == s for s in torch_scales)
    x = confident_inputs(prepared.path, 24, seed=3)
    ref = ort_cpu_runner(prepared.path)({"input": x})["probs"]
    got = _served_outputs(result.intermediate, x)
    _, fp16 = build("fp16")
    assert not np.allclose(got, _served_outputs(fp16.intermediate, x), atol=1e-4)  # activations really quantized
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.9


def test_activation_quant_alignment_drops_only_exact_repeats() -> None:
    from edgekit.compress.torch_w8a8 import ActivationQuant, align

    torch_q = [ActivationQuant("a", 0.1, 128), ActivationQuant("b", 0.05, 0), ActivationQuant("flat", 0.05, 0)]
    package_q = [ActivationQuant("qa", float(np.float16(0.1)), 128), ActivationQuant("qb", 0.05, 0)]
    assert align(torch_q, package_q) == [0, 1, None]  # the repeat after a reshape is a no-op coremltools drops
    with pytest.raises(ValidationFailedError, match=r"activation quantization b \(scale 0\.05, zero point 0\)"):
        align(torch_q, [package_q[0], ActivationQuant("qb", 0.07, 0)])
    with pytest.raises(ValidationFailedError, match="has no counterpart in the torch intermediate"):
        align(torch_q[:1], package_q)


def _residual_classifier(path: Path) -> Path:
    """MobileNetV3's inverted-residual pattern: ``Add(x, Conv(Relu(Conv(x))))`` between convs."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)

    def init(name: str, shape: tuple[int, ...], scale: float = 0.3) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)

    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1], name="conv3"),
        helper.make_node("Add", ["r1", "c3"], ["res"], name="residual"),
        helper.make_node("Conv", ["res", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1], strides=[2, 2], name="conv4"),
        helper.make_node("GlobalAveragePool", ["c4"], ["gap"], name="gap"),
        helper.make_node("Flatten", ["gap"], ["flat"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["flat", "w5", "b5"], ["logits"], transB=1, name="fc"),
        helper.make_node("Softmax", ["logits"], ["probs"], axis=1, name="softmax"),
    ]
    graph = helper.make_graph(
        nodes,
        "residual_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 10])],
        [
            init("w1", (8, 3, 3, 3)), init("b1", (8,), 0.1), init("w2", (8, 8, 3, 3)), init("b2", (8,), 0.1),
            init("w3", (8, 8, 3, 3)), init("b3", (8,), 0.1), init("w4", (16, 8, 3, 3)), init("b4", (16,), 0.1),
            init("w5", (10, 16), 1.0), init("b5", (10,), 0.1),
        ],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def test_apple_w8a8_checks_a_residual_add_whose_output_scale_coremltools_normalized(tmp_path: Path) -> None:
    # coremltools' distributive_quantized_binary_op_scale_normalization stores the residual Add's output
    # quantize scale divided by one input's scale (PP-OCR's MobileNetV3 cls failed alignment on it): the
    # check compares it in the source's units and the intermediate computes with the package's numbers
    from edgekit.compress.mlpackage_weights import load_program, main_operations
    from edgekit.compress.onnx_prep import prepare_model
    from edgekit.compress.torch_w8a8 import package_activation_quant, torch_activation_quant

    residual = prepare_model(_residual_classifier(tmp_path / "residual.onnx"), tmp_path / "prepared")
    ctx = _ctx(residual, tmp_path, "int8")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = build_with_engine(AppleTarget(), ctx)
    _, program = load_program(ctx.out_dir / "model.mlpackage")
    adds = [op for op in main_operations(program) if op.op_type == "add"]
    unit = [op.inputs[k].op for op in adds for k in ("x", "y") if op.inputs[k].op.op_type == "dequantize"]
    assert any(float(d.inputs["scale"].val) == 1.0 for d in unit)  # the pass ran: one input in units of 1.0
    raw = {str(op.name): float(op.inputs["scale"].val) for op in main_operations(program) if op.op_type == "quantize"}
    package_q = package_activation_quant(program)
    rescaled = [q for q in package_q if abs(q.scale - raw[q.where]) > 1e-3 * q.scale]
    assert len(rescaled) == 1  # the Add's output, stored as s_z / s_y
    assert any("normalized by an input's scale" in n for n in result.notes)
    module = inspect.getclosurevars(result.intermediate).nonlocals["module"]
    torch_scales = [q.scale for q in torch_activation_quant(module)]
    assert np.isclose(torch_scales, rescaled[0].scale, rtol=1e-6).any()  # the sum quantized on the package's grid
    x = confident_inputs(residual.path, 16, seed=3)
    ref = ort_cpu_runner(residual.path)({"input": x})["probs"]
    assert np.mean(_served_outputs(result.intermediate, x).argmax(1) == ref.argmax(1)) >= 0.9


def _quantized_add(s_x: float, s_y: float, s_z: float) -> object:
    """A MIL program ``quantize(dequantize(qa, s_x) + dequantize(qb, s_y), s_z)``, qa at 0.1, qb at 0.05."""
    import coremltools as ct
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.mil import types

    @mb.program(input_specs=[mb.TensorSpec((1, 4), dtype=types.fp32)], opset_version=ct.target.iOS17)
    def program(x):  # type: ignore[no-untyped-def]
        qa = mb.quantize(input=x, scale=np.float32(0.1), output_dtype="int8", name="qa")
        qb = mb.quantize(input=x, scale=np.float32(0.05), output_dtype="int8", name="qb")
        z = mb.add(x=mb.dequantize(input=qa, scale=np.float32(s_x)), y=mb.dequantize(input=qb, scale=np.float32(s_y)))
        return mb.dequantize(
            input=mb.quantize(input=z, scale=np.float32(s_z), output_dtype="int8", name="qz"), scale=0.3
        )

    return program


def test_package_activation_quant_undoes_only_coremltools_scale_normalization() -> None:
    from edgekit.compress.torch_w8a8 import package_activation_quant

    def scales(program: object) -> list[float]:
        return [round(q.scale, 6) for q in package_activation_quant(program)]

    assert scales(_quantized_add(0.1, 0.05, 0.3)) == [0.1, 0.05, 0.3]  # not normalized: as stored
    assert scales(_quantized_add(0.1 / 0.05, 1.0, 0.3 / 0.05)) == [0.1, 0.05, 0.3]  # in units of s_y, undone
    with pytest.raises(ValidationFailedError, match=r"package op qz: the add before it reads dequantize scales 3 and"):
        package_activation_quant(_quantized_add(3.0, 1.0, 0.3 / 0.05))  # 3 * 0.05 is not qa's 0.1: not that pass


def test_apple_w8a8_loads_a_conv_transpose_weight_quantized_along_its_output_axis(tmp_path: Path) -> None:
    """A ConvTranspose weight is [in, out, kH, kW]: torch.ao and Core ML both keep one scale per
    output channel, on axis 1 (an upsampling decoder, as in DBNet-style text detectors)."""
    from edgekit.compress.mlpackage_weights import load_program, main_operations
    from edgekit.compress.onnx_prep import prepare_model
    from tests.factories import tiny_upsampler

    model = prepare_model(tiny_upsampler(tmp_path / "up.onnx"), tmp_path / "prepared")
    ctx = _ctx(model, tmp_path / "build", "int8")
    ctx = dataclasses.replace(ctx, calib={"image": sample_inputs(8)}, static_shapes={"image": (1, 3, 16, 16)})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = build_with_engine(AppleTarget(), ctx)
    assert result.precision.label == "w8a8"
    _, program = load_program(ctx.out_dir / "model.mlpackage")
    assert [op.op_type for op in main_operations(program)].count("constexpr_affine_dequantize") == 3
    x = sample_inputs(8, seed=4)
    ref = ort_cpu_runner(model.path)({"image": x})["prob"]
    got = np.concatenate([result.intermediate({"image": x[i : i + 1]})["prob"] for i in range(len(x))])
    cos = float((ref * got).sum() / (np.linalg.norm(ref) * np.linalg.norm(got)))
    assert cos > 0.99


def test_apple_w8a8_keeps_a_sigmoid_fed_by_no_quantized_op_in_float(tmp_path: Path) -> None:
    """A detector head's score sigmoid after an anchor Reshape/Concat (opaque ops): torch.ao would
    quantize its input with the sigmoid's fixed output range [0, 1), clamping every logit, so each
    score lands in [0.5, 0.73]. It stays float; the convs keep their quantization."""
    import torch

    from edgekit.compress.freeze import freeze_graph
    from edgekit.compress.onnx_to_torch import onnx_to_torch
    from edgekit.compress.torch_w8a8 import calibrate, float_fed_fixed_range_ops
    from tests.optimize.models import tiny_score_head

    model = tiny_score_head(tmp_path / "head.onnx")
    frozen = freeze_graph(model, tmp_path / "frozen.onnx", {"x": (1, 4, 8, 8)})
    module = onnx_to_torch(frozen.path)
    (sigmoid,) = float_fed_fixed_range_ops(module)
    assert "sigmoid" in sigmoid.lower()
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((16, 4, 8, 8)).astype(np.float32) * 3)
    with torch.no_grad():
        want = module(x[:8]).numpy()
        quantized = calibrate(module, (x[:1],), [(x[i : i + 1],) for i in range(16)])
        got = np.concatenate([quantized(x[i : i + 1]).numpy() for i in range(8)])
    assert (want[:, 2:] < 0.01).all()  # the scores: about 5e-5
    # float scores (without the exclusion: 0.5 each, as the clamped logits are 0)
    np.testing.assert_allclose(got[:, 2:], want[:, 2:], rtol=0.2)
    names = {n.target for n in quantized.graph.nodes if n.op == "call_function"}
    assert any("quantize_per_tensor" in str(t) for t in names)  # the convs are still W8A8


def test_apple_refuses_w8a8_below_ios17(prepared, tmp_path: Path) -> None:
    ctx = _ctx(prepared, tmp_path, "int8", AppleOptions(minimum_deployment_target="iOS16"))
    with pytest.raises(
        ConfigError, match=r"minimum_deployment_target=iOS16: --precision int8 \(W8A8\) needs Core ML 7"
    ):
        build_with_engine(AppleTarget(), ctx)


@pytest.mark.slow
def test_apple_w8a8_passes_its_gate_on_the_digits_example(keypair, tmp_path: Path, open_bundle) -> None:
    from tests.factories import package_small_data as package

    digits = Path(__file__).resolve().parents[2] / "examples" / "digits"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = package(
            digits / "model.onnx",
            targets=["apple"],
            precision="int8",
            calib=digits / "calib.npz",
            eval=digits / "eval.npz",
            labels=digits / "eval_labels.npy",
            key=keypair[0],
            out_dir=tmp_path,
        )
    _, manifest = open_bundle(result.bundles["apple"])
    v = manifest.validation
    assert manifest.precision.label == "w8a8" and v.passed and v.samples == 450
    assert v.top1_agreement >= 0.98 and v.fp32_top1_accuracy - v.top1_accuracy <= 0.01
    assert v.measured_on.startswith("intermediate (quantized torch intermediate with the mlpackage's int8 weights")
    assert any(
        n.startswith("intermediate: the quantized torch graph with the package's 8 int8 weights") for n in v.notes
    )
    assert manifest.compatibility.hardware == {"minimum_deployment_target": "iOS17"}
    assert v.size_ratio is not None and v.size_ratio < 0.35


@pytest.mark.slow
def test_apple_w8a8_converts_a_dynamic_hw_yolo_style_detector_and_passes_its_gate(
    keypair, tmp_path: Path, open_bundle
) -> None:
    # Frozen first (static shapes, onnxslim), then quantized with onnx2torch's own op modules (Div,
    # Reshape, Split...) left opaque to FX tracing, which their value checks would break.
    from tests.factories import package_small_data as package
    from tests.factories import tiny_yolo

    model = tiny_yolo(tmp_path / "yolo.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = package(
            model,
            targets=["apple"],
            precision="int8",
            calib={"images": sample_inputs(24, size=64, seed=8)},
            key=keypair[0],
            out_dir=tmp_path,
        )
    _, manifest = open_bundle(result.bundles["apple"])
    v = manifest.validation
    assert manifest.precision.label == "w8a8" and v.kind == "dense" and v.passed and v.cosine > 0.99
    assert "frozen: static input shapes images=1x3x64x64" in v.notes
    assert manifest.signature.outputs[0].shape == (1, 7, 84)  # what the frozen package gives, not 'anchors'
    kinds = [step.kind for step in manifest.provenance if step.kind != "prepare"]
    assert kinds == ["fix_shapes", "simplify", "quantize", "convert", "select"]


# -- check_model -------------------------------------------------------------------------------------


def test_apple_check_model_names_an_op_onnx2torch_cannot_take(tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node("Det", ["x"], ["y"], name="determinant")
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    path = tmp_path / "det.onnx"
    onnx.save(model, str(path))
    with pytest.raises(TargetOpError) as err:
        AppleTarget().check_model(path)
    assert "'apple' cannot take op Det (node 'determinant'): onnx2torch" in str(err.value)
    assert "cpu" in err.value.alternatives


def test_apple_check_model_accepts_the_tiny_classifier(prepared) -> None:
    AppleTarget().check_model(prepared.path)


# -- coreml runtime ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def apple_bundle(package_tiny):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return package_tiny("apple", "int8-weights", samples=40, options={"apple": {"weight_threshold": 0}})


def test_package_apple_writes_a_verified_bundle_with_the_whole_mlpackage(apple_bundle) -> None:
    import coremltools as ct

    result, manifest, extracted = apple_bundle
    assert manifest == result.manifests["apple"]
    artifacts = sorted(f.path for f in manifest.artifact_files())
    assert artifacts and all(p.startswith("model.mlpackage/") for p in artifacts)
    assert package_dir(manifest) == "model.mlpackage"
    spec = ct.utils.load_spec(str(extracted / "model.mlpackage"))
    assert [o.name for o in spec.description.output] == [m.artifact for m in manifest.mapping if m.served == "probs"]
    v = manifest.validation
    assert v.passed and v.top1_agreement >= 0.98 and v.latency_p50_ms is None
    assert v.measured_on.startswith("intermediate (torch intermediate with the mlpackage's dequantized weights")
    assert (manifest.precision.label, manifest.compatibility.runtime) == ("w8a16", "coreml")


@pytest.mark.skipif(ON_MACOS, reason="checks the refusal off macOS")
def test_coreml_runtime_refuses_to_load_off_macos(apple_bundle) -> None:
    _, manifest, extracted = apple_bundle
    with pytest.raises(IncompatibleError, match="Core ML prediction needs macOS"):
        load_model(extracted, manifest)


def test_coreml_runtime_reads_compute_units_and_refuses_unknown_ones(apple_bundle) -> None:
    _, manifest, _ = apple_bundle
    assert compute_units(CoreMlOptions(), manifest) == "ALL"
    assert compute_units(CoreMlOptions(compute_units="CPU_AND_NE"), manifest) == "CPU_AND_NE"
    npu = manifest.with_updates(target_options=manifest.target_options | {"compute_units": "NPU"})
    with pytest.raises(BundleError, match="'NPU' is not a Core ML compute unit"):
        compute_units(CoreMlOptions(), npu)
    two = manifest.with_updates(files=(*manifest.files, manifest.files[0].__class__("other.mlpackage/x", 1, "0" * 64)))
    with pytest.raises(BundleError, match=r"exactly one \.mlpackage"):
        package_dir(two)


@pytest.mark.requires_macos
@pytest.mark.skipif(not ON_MACOS, reason="Core ML prediction needs macOS")
def test_coreml_runtime_predicts_like_the_golden_vectors(apple_bundle) -> None:
    _, manifest, extracted = apple_bundle
    golden = np.load(extracted / "golden.npz")
    served = load_model(extracted, manifest, CoreMlOptions(compute_units="CPU_ONLY"))
    try:
        got = np.concatenate([served.infer({"input": x[None]})["probs"] for x in golden["in_input"]])
    finally:
        served.close()
    assert np.mean(got.argmax(1) == golden["out_probs"].argmax(1)) >= 0.75


# -- the optimisation engine (--precision auto) -------------------------------------------------------


def test_apple_device_rank_follows_coremltools_performance_guide() -> None:
    from edgekit.targets.apple import device_rank

    ranks = [device_rank(p, "ALL") for p in ("int8", "palettize4", "palettize6", "int8-weights", "fp16", "fp32")]
    assert ranks == sorted(ranks) and len(set(ranks)) == len(ranks)  # W8A8 first, then fewer weight bits
    # activation quantization slows the CPU/GPU down: W8A8 last where the Neural Engine is excluded
    assert device_rank("int8", "CPU_ONLY") > device_rank("fp16", "CPU_ONLY")
    assert device_rank("int8", "CPU_AND_GPU") > device_rank("palettize4", "CPU_AND_GPU")


def test_apple_auto_without_w8a8_deployment_target_skips_it_with_the_reason(prepared, tmp_path: Path) -> None:
    plan = AppleTarget().candidates(_ctx(prepared, tmp_path, "auto", AppleOptions(minimum_deployment_target="iOS16")))
    assert [c.precision for c in plan.first] == ["palettize4", "palettize6", "int8-weights", "fp16"]
    reasons = dict(plan.skipped)
    assert "W8A8 needs Core ML 7" in reasons["coreml w8a8 (coremltools.optimize.torch)"]
    assert "Neural Engine computes in fp16" in reasons["coreml fp32"]
    assert all(c.device_rank is not None for c in plan.first)


@pytest.mark.slow
def test_apple_auto_records_every_candidate_with_latency_not_measured_here(package_tiny, tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result, manifest, _ = package_tiny("apple", "auto", samples=40, options={"apple": {"weight_threshold": 0}})
    report = manifest.candidates
    assert report is not None and not report.latency_measured
    rows = {c.id: c for c in report.candidates}
    assert {c.settings["precision"] for c in report.candidates if c.status != "skipped"} == {
        "int8", "palettize4", "palettize6", "int8-weights", "fp16",
    }  # fmt: skip
    assert rows["coreml fp32"].status == "skipped"
    assert all(c.latency_p50_ms is None for c in report.candidates)
    assert all(c.status == "skipped" or c.size_bytes for c in report.candidates)
    # the choice: the passing candidate Apple's guide ranks fastest (W8A8 on the Neural Engine)
    passing = [c for c in report.candidates if c.status in ("passed", "chosen")]
    assert passing and report.chosen == "coreml w8a8 (coremltools.optimize.torch)"
    assert manifest.precision.label == "w8a8" and manifest.validation.passed
    assert any("latency not measured here" in n for n in report.notes)
    text = result.reports["apple"].read_text()
    assert "latency not measured here" in text and "coreml palettized 4-bit" in text
    assert manifest.validation.latency_p50_ms is None


def test_apple_explicit_precision_builds_only_that_candidate(prepared, tmp_path: Path) -> None:
    plan = AppleTarget().candidates(_ctx(prepared, tmp_path, "palettize6"))
    assert [c.precision for c in plan.first] == ["palettize6"] and not plan.skipped
