"""The ``coral`` target (onnx2tf -> full-integer INT8 TFLite) and the ``litert`` device runtime.

Two conversions for the whole module (TensorFlow is slow to load): a classifier and a dense model
with an NCHW map output, both packaged with every network connection refused. Marked ``slow``: a
YOLOv8-style detector exported with dynamic H/W (frozen before onnx2tf), and the 16x8 build. Their bundles are
checked against ONNX Runtime FP32 through the runtime the agent uses; the classifier is served by
a real agent over the v2 API. The Edge TPU compile path needs ``edgetpu_compiler`` and an Edge
TPU: marked ``requires_edgetpu``.
"""

from __future__ import annotations

import ctypes.util
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import edgekit
from device_agents.errors import IncompatibleError
from device_agents.runtimes import load_model
from device_agents.runtimes.litert import LiteRtRunner
from device_agents.runtimes.options import LiteRtOptions, RuntimesConfig
from edgekit.bundle.manifest import Compatibility, Manifest
from edgekit.compress.freeze import scope_name
from edgekit.compress.onnx2tflite import signature_details
from edgekit.errors import ConfigError
from edgekit.packaging.result import PackageResult
from edgekit.targets.base import BuildContext
from edgekit.targets.coral import SIXTEEN_BY_EIGHT, CoralOptions, CoralTarget, edgetpu_placement
from edgekit.targets.op_support import TargetOpError
from edgekit.validate.metrics import worst_channel
from tests.agent.conftest import RunningAgent, agent_cli, start_agent, write_config
from tests.factories import sample_inputs, tiny_classifier, tiny_dense, tiny_yolo
from tests.optimize.models import served_coral
from tests.targets.conftest import no_network

HAS_EDGETPU = shutil.which("edgetpu_compiler") is not None and ctypes.util.find_library("edgetpu") is not None
CALIB = sample_inputs(60, seed=3) * 3.0  # scaled so that the tiny classifier's classes are well apart


def _ort(model: Path, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
    return ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, feed)  # type: ignore[no-any-return]  # arrays


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per-sample cosine similarity."""
    a, b = a.reshape(len(a), -1).astype(np.float64), b.reshape(len(b), -1).astype(np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)  # type: ignore[no-any-return]  # an array


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # onnxslim-style node names that TensorFlow refuses as scope names
    path = tiny_classifier(tmp_path_factory.mktemp("coral-model") / "tiny.onnx")
    model = onnx.load(str(path))
    for node in model.graph.node:
        node.name = f"{node.op_type}@0" if node.op_type == "Softmax" else f"/{node.name}:0"
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def packaged(
    tmp_path_factory: pytest.TempPathFactory, classifier: Path, keypair: tuple[Path, Path]
) -> tuple[PackageResult, list[object]]:
    out = tmp_path_factory.mktemp("coral-bundles")
    with no_network() as attempts:
        result = edgekit.package(
            classifier, targets=["coral"], precision="int8", calib={"input": CALIB}, key=keypair[0], out_dir=out
        )
    return result, attempts


def test_coral_converts_offline_to_a_full_integer_tflite_that_matches_fp32(
    packaged: tuple[PackageResult, list[object]], classifier: Path, open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    result, attempts = packaged
    assert attempts == []  # onnx2tf found its sample file made from our calibration data
    model_dir, manifest = open_bundle(result.bundles["coral"])
    assert manifest.compatibility.runtime == "litert" and manifest.compatibility.accelerator is None
    assert [f.path for f in manifest.artifact_files()] == ["model.tflite"]
    assert manifest.precision.label == "w8a8" and manifest.validation.passed
    assert any("not compiled for the Edge TPU" in n and "XNNPACK" in n for n in manifest.validation.notes)
    # int8 in and out, NHWC in the artifact, quantization parameters in the manifest
    (art_in,), (art_out,) = manifest.artifact_signature.inputs, manifest.artifact_signature.outputs
    assert art_in.dtype == art_out.dtype == "int8" and art_in.quant is not None and art_out.quant is not None
    assert art_in.shape == (1, 16, 16, 3) and art_in.layout == "NHWC"
    assert {m.served: m.transpose for m in manifest.mapping} == {"input": (0, 2, 3, 1), "probs": None}
    # the served interface stays the source model's (NCHW float32), fixed to the static shape
    assert manifest.signature.inputs[0].shape == (1, 3, 16, 16) and manifest.signature.inputs[0].dtype == "float32"
    placement = manifest.op_placement
    assert placement is not None and placement.tool.startswith("litert interpreter op list")
    assert "CONV_2D" in {e.op for e in placement.entries} and {e.device for e in placement.entries} == {"CPU"}
    assert placement.accelerated == 0 and placement.fallback == len(placement.entries)

    served = load_model(model_dir, manifest, LiteRtOptions(threads=1))
    try:
        x = sample_inputs(40, seed=11) * 3.0
        got = np.concatenate([served.infer({"input": x[i : i + 1]})["probs"] for i in range(len(x))])
    finally:
        served.close()
    want = _ort(classifier, {"input": x})[0]
    assert got.dtype == np.float32 and got.shape == want.shape
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.95
    assert np.mean(_cosines(got, want)) > 0.98


def test_coral_golden_vectors_cover_several_batch_1_samples_and_pass_the_device_self_test(
    packaged: tuple[PackageResult, list[object]], open_bundle: Callable[[Path], tuple[Path, Manifest]], tmp_path: Path
) -> None:
    from device_agents.selftest import run_selftest

    model_dir, manifest = open_bundle(packaged[0].bundles["coral"])
    assert manifest.signature.inputs[0].shape[0] == 1  # a static batch-1 artifact ...
    assert manifest.golden.count == 4  # ... still gets several golden samples, checked one batch at a time
    with np.load(model_dir / manifest.golden.file) as golden:
        assert golden["in_input"].shape[0] == golden["out_probs"].shape[0] == 4
    report = run_selftest(
        model_dir,
        timeout_s=60,
        memory_mb=2048,
        options=RuntimesConfig(litert=LiteRtOptions(threads=1)),
        work_dir=tmp_path,
    )
    assert report.passed, report.reason
    assert report.latency_p50_ms is not None


def test_coral_dense_nchw_output_comes_back_nchw_through_the_runtime(
    tmp_path_factory: pytest.TempPathFactory,
    keypair: tuple[Path, Path],
    open_bundle: Callable[[Path], tuple[Path, Manifest]],
) -> None:
    model = tiny_dense(tmp_path_factory.mktemp("coral-dense") / "dense.onnx")
    calib = {"image": sample_inputs(40, seed=2)}
    with no_network():
        result = edgekit.package(
            model, targets=["coral"], precision="int8", calib=calib, key=keypair[0], out_dir=model.parent,
            allow_small_eval=True,  # 8 held out: the layout is tested, not the gate
        )  # fmt: skip
    model_dir, manifest = open_bundle(result.bundles["coral"])
    mapping = {m.served: m for m in manifest.mapping}
    assert mapping["mask"].transpose == (0, 2, 3, 1) and mapping["embedding"].transpose is None
    assert mapping["mask"].artifact == "output_0" and mapping["embedding"].artifact == "output_1"
    assert manifest.validation.kind == "dense" and manifest.validation.passed
    served = load_model(model_dir, manifest)
    try:
        x = sample_inputs(1, seed=17)
        got = served.infer({"image": x})
    finally:
        served.close()
    mask, embedding = _ort(model, {"image": x})
    assert got["mask"].shape == mask.shape == (1, 4, 16, 16)
    assert _cosines(got["mask"], mask)[0] > 0.98 and _cosines(got["embedding"], embedding)[0] > 0.98


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], packaged: tuple[PackageResult, list[object]]
) -> Iterator[RunningAgent]:
    config = write_config(tmp_path_factory.mktemp("coral-agent"), keypair[1])
    done = agent_cli("install", str(packaged[0].bundles["coral"]), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    running = start_agent(config)
    yield running
    assert running.stop() == 0


def test_coral_bundle_is_served_by_the_agent_over_v2_with_float_nchw_tensors(
    agent: RunningAgent, classifier: Path
) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(agent.address)
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [1, 3, 16, 16]}]
    assert meta["outputs"] == [{"name": "probs", "datatype": "FP32", "shape": [1, 10]}]
    x = sample_inputs(1, seed=23) * 3.0
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    got = client.infer("tiny", [inp]).as_numpy("probs")
    want = _ort(classifier, {"input": x})[0]
    assert got.argmax() == want.argmax() and _cosines(got, want)[0] > 0.98
    bad = triton.InferInput("input", [2, 3, 16, 16], "FP32")  # the artifact's shapes are static
    bad.set_data_from_numpy(np.zeros((2, 3, 16, 16), np.float32))
    with pytest.raises(Exception, match="does not match"):
        client.infer("tiny", [bad])


def test_litert_refuses_an_edgetpu_bundle_without_the_delegate(
    packaged: tuple[PackageResult, list[object]], open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    if HAS_EDGETPU:
        pytest.skip("libedgetpu is installed here: the delegate loads")
    model_dir, manifest = open_bundle(packaged[0].bundles["coral"])
    compat = Compatibility(runtime="litert", runtime_version="x", accelerator="edgetpu")
    with pytest.raises(IncompatibleError, match=r"libedgetpu\.so\.1 cannot be loaded"):
        LiteRtRunner(model_dir, manifest.with_updates(compatibility=compat), LiteRtOptions())


def test_coral_check_model_names_the_op_the_node_and_the_targets_that_take_it(tmp_path: Path) -> None:
    # LpPool: OpenVINO and ONNX Runtime convert it, onnx2tf has no converter for it.
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("LpPool", ["a"], ["y"], name="the_lp_pool", kernel_shape=[2, 2], p=2),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, 7, 7])],
    )  # fmt: skip
    path = tmp_path / "lppool.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(path))
    with pytest.raises(TargetOpError) as caught:
        CoralTarget().check_model(path)
    message = str(caught.value)
    assert "target 'coral' cannot take op LpPool (node 'the_lp_pool')" in message and "onnx2tf" in message
    assert {"cpu", "intel"} <= set(caught.value.alternatives)
    assert "Targets that can take it:" in message and "intel" in message


def test_coral_edgetpu_true_without_the_compiler_is_refused_before_converting(tmp_path: Path) -> None:
    if shutil.which("edgetpu_compiler"):
        pytest.skip("edgetpu_compiler is installed here")
    ctx = BuildContext(
        model_path=tmp_path / "never-read.onnx", served=None, precision="int8", calib={}, static_shapes={},  # type: ignore[arg-type]  # refused first
        out_dir=tmp_path, work_dir=tmp_path, options=CoralOptions(edgetpu=True), progress=lambda _m: None,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"targets\.coral\.edgetpu=true but edgetpu_compiler is not on PATH"):
        CoralTarget().candidates(ctx)


def test_scope_names_are_valid_for_tensorflow_and_unique() -> None:
    import re

    taken: set[str] = set()
    names = [scope_name(n, i, taken) for i, n in enumerate(["Softmax@0", "/conv/Conv:0", "", "Softmax@0", "_x"])]
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*", n) for n in names)


def test_edgetpu_compiler_table_becomes_op_placement() -> None:
    # The layout of edgetpu_compiler's operation log (coral.ai/docs/edgetpu/compiler).
    log = "\n".join(
        [
            "Edge TPU Compiler version 16.0.384591198",
            "Model compiled successfully in 215 ms.",
            "",
            "Number of Edge TPU subgraphs: 1",
            "Total number of operations: 7",
            "Operation log: model_edgetpu.log",
            "",
            "Operator                       Count      Status",
            "",
            "CONV_2D                        2          Mapped to Edge TPU",
            "MEAN                           1          Mapped to Edge TPU",
            "FULLY_CONNECTED                1          Mapped to Edge TPU",
            "SOFTMAX                        1          Operation is otherwise supported, but not mapped due to "
            "some unspecified limitation",
            "QUANTIZE                       2          Mapped to Edge TPU",
        ]
    )
    placement = edgetpu_placement(log, "model_edgetpu.log")
    assert (placement.accelerated, placement.fallback) == (6, 1)
    assert [(e.op, e.device) for e in placement.entries][3] == ("SOFTMAX", "CPU")
    assert placement.log_file == "model_edgetpu.log" and placement.tool == "edgetpu_compiler"


@pytest.mark.requires_edgetpu
@pytest.mark.skipif(not HAS_EDGETPU, reason="needs edgetpu_compiler on PATH and libedgetpu with an Edge TPU attached")
def test_coral_compiles_for_the_edgetpu_and_runs_on_it(
    tmp_path: Path, classifier: Path, keypair: tuple[Path, Path], open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    result = edgekit.package(
        classifier, targets=["coral"], precision="int8", calib={"input": CALIB}, key=keypair[0], out_dir=tmp_path,
        options={"coral": CoralOptions(edgetpu=True)},
    )  # fmt: skip
    model_dir, manifest = open_bundle(result.bundles["coral"])
    assert manifest.compatibility.accelerator == "edgetpu"
    roles = {f.path: f.role for f in manifest.files}
    assert roles["model_edgetpu.tflite"] == "artifact" and roles["model_edgetpu.log"] == "report"
    assert manifest.op_placement is not None and manifest.op_placement.tool == "edgetpu_compiler"
    assert manifest.op_placement.accelerated > 0
    served = load_model(model_dir, manifest)
    try:
        x = sample_inputs(8, seed=11) * 3.0
        got = np.concatenate([served.infer({"input": x[i : i + 1]})["probs"] for i in range(len(x))])
    finally:
        served.close()
    assert np.mean(got.argmax(1) == _ort(classifier, {"input": x})[0].argmax(1)) >= 0.95


# -- frozen graphs (static shapes, onnxslim folding) and 16x8 ---------------------------------------------


@pytest.fixture(scope="module")
def yolo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_yolo(tmp_path_factory.mktemp("coral-yolo") / "yolo.onnx")


def test_freeze_graph_folds_the_shape_chains_of_a_dynamic_hw_detector(yolo: Path, tmp_path: Path) -> None:
    import re

    from edgekit.compress.freeze import freeze_graph

    source = onnx.load(str(yolo))
    assert {"Shape", "Range"} <= {n.op_type for n in source.graph.node}  # anchors computed from run-time H/W
    x = sample_inputs(1, size=64, seed=5)
    frozen = freeze_graph(
        yolo,
        tmp_path / "frozen.onnx",
        {"images": (1, 3, 64, 64)},
        check={"images": x},
        input_names={"images": "in0"},
        tf_scope_names=True,
    )
    model = onnx.load(str(frozen.path))
    ops = {n.op_type for n in model.graph.node}
    assert frozen.shape_ops_left == 0 and not ops & {"Shape", "Range", "ConstantOfShape", "Gather"}
    assert {"Split", "Softmax", "MaxPool", "Concat"} <= ops  # C2f, DFL, SPPF survive as computation
    assert frozen.nodes_after < frozen.nodes_before == len(source.graph.node)
    assert all(re.fullmatch(r"[A-Za-z0-9.][A-Za-z0-9_.\\/>-]*", n.name) for n in model.graph.node)
    assert [i.name for i in model.graph.input] == ["in0"]
    dims = [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim]
    assert dims == [1, 7, 84]  # 4 box + 3 class rows, 8*8 + 4*4 + 2*2 anchors
    assert frozen.min_cosine is not None and frozen.min_cosine > 0.9999
    assert frozen.steps[0] == "static input shapes images=1x3x64x64"
    assert frozen.steps[1].startswith(f"onnxslim constant folding and simplification: {frozen.nodes_before} -> ")
    want = _ort(yolo, {"images": x})[0]
    got = _ort(frozen.path, {"in0": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-3)


def test_freeze_graph_refuses_a_static_shape_of_the_wrong_rank(yolo: Path, tmp_path: Path) -> None:
    from edgekit.compress.freeze import freeze_graph
    from edgekit.errors import ModelFormatError

    with pytest.raises(ModelFormatError, match=r"input 'images': static shape \[1, 64, 64\] has rank 3, not 4"):
        freeze_graph(yolo, tmp_path / "f.onnx", {"images": (1, 64, 64)})


@pytest.mark.slow
def test_coral_auto_packages_a_dynamic_hw_yolo_style_detector_and_records_its_candidates(
    yolo: Path, keypair: tuple[Path, Path], open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    # Without freezing, onnx2tf 1.28.8 fails on this graph in a Shape->Slice chain (edgekit.compress.freeze).
    calib = {"images": sample_inputs(40, size=64, seed=8)}
    with no_network():
        result = edgekit.package(
            yolo, targets=["coral"], precision="auto", calib=calib, key=keypair[0], out_dir=yolo.parent,
            allow_small_eval=True,  # 8 held out: the conversion and the candidates are tested, not the gate
        )  # fmt: skip
    model_dir, manifest = open_bundle(result.bundles["coral"])
    validation = manifest.validation
    assert validation.kind == "dense" and validation.passed and validation.cosine is not None
    assert validation.cosine > 0.98
    # boxes in pixels next to class scores in 0-1: whatever ships kept every score channel alive
    assert validation.channel_cosine is not None and validation.channel_cosine >= 0.9
    # every candidate is recorded; without the Edge TPU compiler they all ran (and were timed) on host LiteRT
    report = manifest.candidates
    assert report is not None and report.latency_measured
    rows = {c.id: c for c in report.candidates}
    assert {"int8 minmax per-channel", "int8 minmax per-tensor", SIXTEEN_BY_EIGHT} <= set(rows)
    built = [c for c in report.candidates if c.status != "skipped"]
    assert all(c.status == "error" or c.latency_p50_ms is not None for c in built)
    assert [c.id for c in report.candidates if c.status == "chosen"] == [report.chosen]
    assert rows[SIXTEEN_BY_EIGHT].settings["activations"] == "int16"
    assert result.reports["coral"].is_file() and SIXTEEN_BY_EIGHT in result.reports["coral"].read_text()
    notes = validation.notes
    assert "frozen: static input shapes images=1x3x64x64" in notes  # from the calibration data's H/W
    assert any(n.startswith("frozen: onnxslim constant folding and simplification: ") for n in notes)
    assert sum(n.startswith("onnx2tf float conversion vs ONNX Runtime") for n in notes) == 1  # converted once
    assert manifest.signature.inputs[0].shape == (1, 3, 64, 64)
    assert manifest.artifact_signature.inputs[0].shape == (1, 64, 64, 3)
    steps = [step for step in manifest.provenance if step.kind != "prepare"]
    kinds = ["fix_shapes", "simplify", "rename_nodes", "convert", "quantize", "select"]
    assert [step.kind for step in steps] == kinds and steps[5].settings["candidate"] == report.chosen
    assert steps[0].settings == {"images": "1x3x64x64"} and steps[1].tool.startswith("onnxslim ")
    assert steps[1].settings["shape_ops_left"] == "0" and steps[1].after is not None and steps[1].after > 0.9999
    assert steps[3].tool.startswith("onnx2tf ") and steps[4].settings["activations"] == manifest.precision.activations
    served = load_model(model_dir, manifest, LiteRtOptions(threads=1))
    try:
        x = sample_inputs(1, size=64, seed=31)
        got = served.infer({"images": x})["output0"]
    finally:
        served.close()
    want = _ort(yolo, {"images": x})[0]
    assert got.shape == want.shape == (1, 7, 84) and _cosines(got, want)[0] > 0.98


# -- mixed precision: ops kept in float ----------------------------------------------------------------


@pytest.fixture(scope="module")
def outlier(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    """A model whose first layer's output has one outlier channel (x1000) that the next layer
    scales back down: plain int8 rounds every other channel of that activation to nothing."""
    from tests.optimize.models import outlier_mlp

    model = outlier_mlp(tmp_path_factory.mktemp("coral-outlier") / "outlier.onnx")
    calib = {"x": np.random.default_rng(0).standard_normal((120, 16)).astype(np.float32)}
    return model, calib


@pytest.fixture(scope="module")
def outlier_float(outlier: tuple[Path, dict[str, np.ndarray]], tmp_path_factory: pytest.TempPathFactory) -> object:
    from edgekit.compress.onnx2tflite import to_float

    model, calib = outlier
    return to_float(model, tmp_path_factory.mktemp("coral-outlier-float"), {"x": (1, 16)}, ["y"], calib, 64)


def test_coral_percentile_ranges_are_narrower_than_minmax_on_outlier_activations(outlier_float: object) -> None:
    from tensorflow.lite.tools import flatbuffer_utils

    from edgekit.compress.tflite_quant import calibrate, with_percentile_ranges

    minmax = calibrate(outlier_float)  # type: ignore[arg-type]  # a FloatConversion
    clipped = with_percentile_ranges(minmax, outlier_float, 99.0)  # type: ignore[arg-type]  # a FloatConversion

    def ranges(model: bytes) -> dict[str, tuple[float, float]]:
        m = flatbuffer_utils.read_model_from_bytearray(bytearray(model))
        return {
            t.name.decode(): (float(t.quantization.min[0]), float(t.quantization.max[0]))
            for t in m.subgraphs[0].tensors
            if t.quantization is not None and t.quantization.min is not None and len(t.quantization.min) == 1
        }

    wide, narrow = ranges(minmax), ranges(clipped)
    assert wide.keys() == narrow.keys() and wide
    assert all(wide[n][0] <= narrow[n][0] <= 0 <= narrow[n][1] <= wide[n][1] for n in wide)
    assert any(narrow[n][1] < 0.9 * wide[n][1] for n in wide)  # some ranges really shrank


def test_coral_sensitivity_ranks_the_layer_that_reads_the_outlier_activation_first(outlier_float: object) -> None:
    from edgekit.compress.tflite_quant import QuantVariant, calibrate, op_outputs, quantize_calibrated, representative
    from edgekit.optimize.tflite_sensitivity import rank_ops

    conv = outlier_float
    quantized = quantize_calibrated(calibrate(conv), QuantVariant())  # type: ignore[arg-type]  # a FloatConversion
    ops = [out for kind, out, _ in op_outputs(quantized) if kind == "FULLY_CONNECTED"]
    assert len(ops) == 3  # layer_a (+Relu), layer_b (+Relu), layer_c
    ranked = rank_ops(conv.float32, quantized, list(representative(conv)))  # type: ignore[attr-defined,arg-type]
    (group, score), *rest = ranked
    # layer_b (reads the outlier tensor) with layer_a (produces it): keeping only b in float would still
    # read the int8 tensor whose range the outlier set
    assert group == (ops[1], ops[0]) and score > 0.5 and all(s < score / 2 for _, s in rest)


@pytest.mark.slow
def test_coral_int8_that_misses_the_gate_is_rescued_by_keeping_ops_in_float(
    outlier: tuple[Path, dict[str, np.ndarray]],
    keypair: tuple[Path, Path],
    open_bundle: Callable[[Path], tuple[Path, Manifest]],
    tmp_path: Path,
) -> None:
    model, calib = outlier
    with no_network():
        result = edgekit.package(
            model, targets=["coral"], precision="int8", calib=calib, key=keypair[0], out_dir=tmp_path,
            mixed_precision=True,
        )  # fmt: skip
    model_dir, manifest = open_bundle(result.bundles["coral"])
    report = manifest.candidates
    assert report is not None
    rows = {c.id: c for c in report.candidates}
    assert rows["int8 minmax per-channel"].status == "failed"  # plain int8 misses the dense gate
    assert rows["int8 minmax per-channel"].cosine is not None and rows["int8 minmax per-channel"].cosine < 0.9
    chosen = rows[report.chosen]
    assert chosen.excluded_nodes and chosen.cosine is not None and chosen.cosine > 0.99
    assert manifest.precision.excluded_nodes == chosen.excluded_nodes and manifest.precision.excluded_reason
    assert manifest.precision.label == "w8a8" and "op(s) kept in float" in manifest.precision.method
    cosine = manifest.validation.cosine
    assert manifest.validation.passed and cosine is not None and cosine > 0.99
    notes = manifest.validation.notes
    assert any(n.startswith("mixed precision:") and "run on the CPU" in n for n in notes)
    placement = manifest.op_placement
    assert placement is not None
    kept = [e for e in placement.entries if "kept in float" in e.node]
    assert {e.node.split(" ")[1] for e in kept} == set(chosen.excluded_nodes)
    assert {e.op for e in placement.entries} >= {"DEQUANTIZE", "QUANTIZE", "FULLY_CONNECTED"}
    assert "Layers kept in float" in result.reports["coral"].read_text()
    served = load_model(model_dir, manifest, LiteRtOptions(threads=1))
    try:
        x = np.random.default_rng(5).standard_normal((8, 16)).astype(np.float32)
        got = np.concatenate([served.infer({"x": x[i : i + 1]})["y"] for i in range(len(x))])
    finally:
        served.close()
    assert np.mean(_cosines(got, _ort(model, {"x": x})[0])) > 0.99


@pytest.fixture(scope="module")
def mixed_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray], object]:
    """A YOLOv8-style head (tests.optimize.models.mixed_scale_head): boxes in the hundreds and 0-1
    scores joined by one Concat, then a Reshape to the output; and its float conversion."""
    from edgekit.compress.onnx2tflite import to_float
    from tests.optimize.models import mixed_scale_head

    folder = tmp_path_factory.mktemp("coral-head")
    model = mixed_scale_head(folder / "head.onnx")
    calib = {"x": np.random.default_rng(2).standard_normal((80, 4, 8, 8)).astype(np.float32)}
    conversion = to_float(model, folder, {"x": (1, 4, 8, 8)}, ["y"], calib, 64)
    return model, calib, conversion


def test_coral_sensitivity_ranks_the_concat_whose_one_scale_crushed_the_scores_first_with_its_tail(
    mixed_head: tuple[Path, dict[str, np.ndarray], object],
) -> None:
    from edgekit.compress.tflite_quant import (
        QuantVariant,
        calibrate,
        op_outputs,
        output_names,
        quantize_calibrated,
        representative,
    )
    from edgekit.optimize.tflite_sensitivity import rank_ops

    model, _, conv = mixed_head
    calibrated = calibrate(conv)  # type: ignore[arg-type]  # a FloatConversion
    plain = quantize_calibrated(calibrated, QuantVariant())
    ops = op_outputs(plain)
    concat = next(out for kind, out, _ in ops if kind == "CONCATENATION")
    (output,) = output_names(plain)
    ranked = rank_ops(conv.float32, plain, list(representative(conv)))  # type: ignore[attr-defined,arg-type]
    (group, score), *rest = ranked
    # the Concat with the ops after it up to the output (the head's tail), far above every conv:
    # the global error alone ranked it below the box conv (the pixel channels dominate the norm)
    assert group[0] == concat and output in group and score > 1.0 and all(s < 0.3 for _, s in rest)
    assert not {kind for kind, out, _ in ops if out in group} & {"CONV_2D", "LOGISTIC"}
    x = np.random.default_rng(7).standard_normal((16, 4, 8, 8)).astype(np.float32)
    want = _ort(model, {"x": x})[0]

    plain_worst = worst_channel(want, served_coral(conv, plain, x, (1, 5, 64)))
    assert plain_worst is not None and plain_worst[0] < 0.9  # plain int8: a score channel crushed
    kept = quantize_calibrated(calibrated, QuantVariant(denylisted=group))
    _, out_details = signature_details(kept)
    assert next(iter(out_details.values()))["dtype"] == np.float32  # the float tail writes a float output
    kept_worst = worst_channel(want, served_coral(conv, kept, x, (1, 5, 64)))
    assert kept_worst is not None and kept_worst[0] > 0.99


@pytest.mark.slow
def test_coral_auto_rescues_int8_that_crushed_the_scores_by_keeping_the_head_concat_tail_in_float(
    mixed_head: tuple[Path, dict[str, np.ndarray], object],
    keypair: tuple[Path, Path],
    open_bundle: Callable[[Path], tuple[Path, Manifest]],
    tmp_path: Path,
) -> None:
    model, calib, _ = mixed_head
    with no_network():
        result = edgekit.package(
            model, targets=["coral"], precision="auto", calib=calib, key=keypair[0], out_dir=tmp_path,
            options={"coral": {"activations": "int8"}},
        )  # fmt: skip
    model_dir, manifest = open_bundle(result.bundles["coral"])
    report = manifest.candidates
    assert report is not None
    rows = {c.id: c for c in report.candidates}
    plain = rows["int8 minmax per-channel"]
    assert plain.status == "failed" and plain.cosine is not None and plain.cosine > 0.96  # global gate passes
    assert "crushed the small ones" in plain.reason  # the channel gate does not
    chosen = rows[report.chosen]
    assert chosen.excluded_nodes and any("concat" in n.lower() for n in chosen.excluded_nodes)
    assert manifest.validation.passed and manifest.validation.channel_cosine is not None
    assert manifest.validation.channel_cosine > 0.99
    assert manifest.artifact_signature is not None and manifest.artifact_signature.outputs[0].quant is None
    assert any(
        n.startswith("output(s) ") and "float32: written by ops kept in float" in n for n in manifest.validation.notes
    )
    served = load_model(model_dir, manifest, LiteRtOptions(threads=1))
    try:
        x = np.random.default_rng(9).standard_normal((8, 4, 8, 8)).astype(np.float32)
        got = np.concatenate([served.infer({"x": x[i : i + 1]})["y"] for i in range(len(x))])
    finally:
        served.close()
    worst = worst_channel(_ort(model, {"x": x})[0], got)
    assert worst is not None and worst[0] > 0.99


@pytest.mark.slow
def test_coral_16x8_keeps_int16_activations_on_the_cpu_and_says_the_edgetpu_cannot_run_it(
    classifier: Path,
    keypair: tuple[Path, Path],
    open_bundle: Callable[[Path], tuple[Path, Manifest]],
    tmp_path: Path,
    packaged: tuple[PackageResult, list[object]],
) -> None:
    with no_network():
        result = edgekit.package(
            classifier, targets=["coral"], precision="int8", calib={"input": CALIB}, key=keypair[0], out_dir=tmp_path,
            options={"coral": {"activations": "int16"}},
        )  # fmt: skip
    _, manifest = open_bundle(result.bundles["coral"])
    assert manifest.precision.label == "w8a16" and manifest.precision.activations == "int16"
    assert "16x8" in manifest.precision.method and manifest.validation.passed
    (art_in,), (art_out,) = manifest.artifact_signature.inputs, manifest.artifact_signature.outputs
    assert art_in.dtype == art_out.dtype == "int16" and art_in.quant is not None and art_in.quant.zero_point == 0
    assert manifest.compatibility.accelerator is None
    assert any("the Edge TPU runs int8 only" in n for n in manifest.validation.notes)
    assert manifest.op_placement is not None and "16x8: the Edge TPU runs int8 only" in manifest.op_placement.tool
    x = sample_inputs(20, seed=11) * 3.0
    want = _ort(classifier, {"input": x})[0]

    def served(bundle: Path) -> np.ndarray:
        directory, m = open_bundle(bundle)
        runner = load_model(directory, m, LiteRtOptions(threads=1))
        try:
            return np.concatenate([runner.infer({"input": x[i : i + 1]})["probs"] for i in range(len(x))])
        finally:
            runner.close()

    got16, got8 = served(result.bundles["coral"]), served(packaged[0].bundles["coral"])
    assert np.mean(got16.argmax(1) == want.argmax(1)) == 1.0
    # int16 activations are closer to FP32 than the int8 build of the same model
    assert np.mean(_cosines(got16, want)) > max(0.995, float(np.mean(_cosines(got8, want))))


def test_coral_refuses_16x8_for_the_edgetpu() -> None:
    with pytest.raises(ConfigError, match=r"coral\.activations=int16: the Edge TPU runs int8 activations only"):
        CoralOptions(activations="int16", edgetpu=True)


# -- the Edge TPU path, with a stand-in for edgetpu_compiler ---------------------------------------------

# edgetpu_compiler is not installable here (x86-64 Debian package from Coral's own repository). This
# stand-in writes what the real one writes (``<stem>_edgetpu.tflite`` and its operation log, same
# table layout) and maps ops by Coral's documented rule: int8 ops run on the Edge TPU up to the first
# op that is not (a float op, e.g. DEQUANTIZE); that op and every op after it stay on the CPU
# (coral.ai/docs/edgetpu/models-intro). It does not compile anything: the copied model is what the
# host validates anyway (the uncompiled int8 model), and the bundle is never run on an Edge TPU here.
FAKE_COMPILER = """\
import shutil, sys
from pathlib import Path
import numpy as np
from ai_edge_litert.interpreter import Interpreter
args = sys.argv[1:]
out = Path(args[args.index("-o") + 1])
src = Path(args[-1])
shutil.copyfile(src, out / f"{src.stem}_edgetpu.tflite")
it = Interpreter(model_path=str(src))
rows, on_cpu = [], False
for op in it._get_ops_details():
    dtype = it._get_tensor_details(op["outputs"][0], 0)["dtype"]
    on_cpu = on_cpu or op["op_name"] == "DEQUANTIZE" or np.dtype(dtype) == np.float32
    rows.append((op["op_name"], "More than one subgraph is not supported" if on_cpu else "Mapped to Edge TPU"))
table = ["Operator                       Count      Status", ""]
table += [f"{name:<30} 1          {status}" for name, status in rows]
(out / f"{src.stem}_edgetpu.log").write_text("Edge TPU Compiler version 0.stand-in\\n\\n" + "\\n".join(table) + "\\n")
print("Edge TPU Compiler version 0.stand-in")
"""


@pytest.mark.slow
def test_coral_with_the_edgetpu_ranks_by_cpu_fallback_and_does_not_time_here(
    outlier: tuple[Path, dict[str, np.ndarray]],
    keypair: tuple[Path, Path],
    open_bundle: Callable[[Path], tuple[Path, Manifest]],
    tmp_path: Path,
) -> None:
    import sys

    compiler = tmp_path / "edgetpu_compiler"
    compiler.write_text(f"#!{sys.executable}\n{FAKE_COMPILER}")
    compiler.chmod(0o755)
    model, calib = outlier
    with no_network():
        result = edgekit.package(
            model, targets=["coral"], precision="auto", calib=calib, key=keypair[0], out_dir=tmp_path,
            options={"coral": {"edgetpu": True, "edgetpu_compiler": str(compiler)}},
        )  # fmt: skip
    _, manifest = open_bundle(result.bundles["coral"])
    assert manifest.compatibility.accelerator == "edgetpu"
    assert {f.path: f.role for f in manifest.files if f.role != "golden"} == {
        "model_edgetpu.tflite": "artifact", "model_edgetpu.log": "report",
    }  # fmt: skip
    report = manifest.candidates
    assert report is not None and not report.latency_measured
    rows = {c.id: c for c in report.candidates}
    assert all(c.latency_p50_ms is None for c in report.candidates)  # the Edge TPU is not here
    assert rows[SIXTEEN_BY_EIGHT].status == "skipped" and "int8 activations only" in rows[SIXTEEN_BY_EIGHT].reason
    assert rows["int8 minmax per-channel"].status == "failed"
    chosen = rows[report.chosen]
    assert chosen.excluded_nodes and manifest.validation.passed  # rescued by ops kept in float
    assert any("expected fastest on the device" in n and "latency not measured here" in n for n in report.notes)
    assert "Edge TPU latency: not measured here" in manifest.validation.notes
    assert manifest.validation.measured_on.startswith("intermediate (uncompiled int8 .tflite")
    placement = manifest.op_placement
    assert placement is not None and placement.tool == "edgetpu_compiler" and placement.log_file == "model_edgetpu.log"
    # the first layer stays float here (it produces the outlier): it and everything after it run on the CPU
    assert placement.fallback == len(placement.entries) and placement.accelerated == 0
    assert {e.device for e in placement.entries if e.op == "DEQUANTIZE"} == {"CPU"}
    data = json.loads(result.reports["coral"].with_suffix(".json").read_text())
    ranks = {c["name"]: c["device_rank"] for c in data["candidates"]}
    assert ranks["int8 minmax per-channel"] == ranks["int8 minmax per-tensor"] == 0  # fully int8
    # ops of the graph from the first one kept in float on: all four (3 FULLY_CONNECTED, RESHAPE)
    assert ranks[report.chosen] == 4


def _plan_ctx(tmp_path: Path, precision: str, **options: object) -> BuildContext:
    from edgekit.bundle.manifest import Signature, TensorSpec

    served = Signature(
        inputs=(TensorSpec("input", "float32", ("n", 3, 16, 16), layout="NCHW"),),
        outputs=(TensorSpec("probs", "float32", ("n", 10)),),
    )
    return BuildContext(
        model_path=tmp_path / "never-read.onnx", served=served, precision=precision, calib={},
        static_shapes={"input": (1, 3, 16, 16)}, out_dir=tmp_path, work_dir=tmp_path,
        options=CoralOptions(**options), progress=lambda _m: None,  # type: ignore[arg-type]  # typed fields
    )  # fmt: skip


def test_coral_candidates_follow_the_options_that_pin_them(tmp_path: Path) -> None:
    def names(precision: str, **options: object) -> tuple[list[str], list[str], list[str]]:
        plan = CoralTarget().candidates(_plan_ctx(tmp_path, precision, edgetpu=False, **options))
        return [c.name for c in plan.first], [r.candidate.name for r in plan.refinements], [n for n, _ in plan.skipped]

    assert names("auto") == (
        ["int8 minmax per-channel", "int8 minmax per-tensor", SIXTEEN_BY_EIGHT],
        ["int8 percentile per-channel 99.99", "int8 percentile per-tensor 99.99"],
        [],
    )
    assert names("int8") == (names("auto")[0][:2], names("auto")[1], [])  # 16x8 only under auto or when asked
    assert names("auto", per_channel="on", calibration="percentile", percentile=99.9) == (
        ["int8 percentile per-channel 99.9"], [], [SIXTEEN_BY_EIGHT]
    )  # fmt: skip
    assert names("int8", activations="int16") == ([SIXTEEN_BY_EIGHT], [], [])
    assert names("auto", activations="int8")[0] == ["int8 minmax per-channel", "int8 minmax per-tensor"]


def test_coral_candidates_for_the_edgetpu_skip_16x8_and_carry_a_device_rank(tmp_path: Path) -> None:
    compiler = tmp_path / "edgetpu_compiler"
    compiler.write_text("#!/bin/sh\nexit 1\n")  # never run: candidates are only described here
    compiler.chmod(0o755)
    plan = CoralTarget().candidates(_plan_ctx(tmp_path, "auto", edgetpu=True, edgetpu_compiler=str(compiler)))
    assert [c.name for c in plan.first] == ["int8 minmax per-channel", "int8 minmax per-tensor"]
    ((name, why),) = plan.skipped
    assert name == SIXTEEN_BY_EIGHT and "the Edge TPU runs int8 activations only" in why
    assert [c.device_rank for c in plan.first] == [0, 0]  # fully int8: nothing falls back to the CPU
    off = CoralTarget().candidates(_plan_ctx(tmp_path, "auto", edgetpu=False))
    assert all(c.device_rank is None for c in off.first)  # timed here instead


# -- a detector's head decode kept in float -------------------------------------------------------------

HEAD = "int8 minmax per-channel, detect head in float"


def _yolo_ctx(yolo: Path, tmp_path: Path, **options: object) -> BuildContext:
    from edgekit.bundle.manifest import Signature, TensorSpec

    served = Signature(
        inputs=(TensorSpec("images", "float32", ("batch", 3, "height", "width"), layout="NCHW"),),
        outputs=(TensorSpec("output0", "float32", ("batch", 7, "anchors")),),
    )
    return BuildContext(
        model_path=yolo, served=served, precision="auto", calib={}, static_shapes={"images": (1, 3, 64, 64)},
        out_dir=tmp_path, work_dir=tmp_path, options=CoralOptions(**options),  # type: ignore[arg-type]  # typed fields
        progress=lambda _m: None, heads={"output0": "detect:yolo"},
    )  # fmt: skip


def test_coral_auto_offers_int8_with_the_detect_head_in_float_for_a_yolo_head(yolo: Path, tmp_path: Path) -> None:
    plan = CoralTarget().candidates(_yolo_ctx(yolo, tmp_path, edgetpu=False))
    names = [c.name for c in plan.first]
    assert names == ["int8 minmax per-channel", "int8 minmax per-tensor", HEAD, SIXTEEN_BY_EIGHT]
    head = plan.first[2]
    assert head.exclude is not None and head.rank_layers is not None and head.device_rank is None
    # the converter's calibrator runs one static batch (here one sample) per call: the memory
    # bound counts that call's tensors, not ONNX Runtime's 16-sample chunk
    assert all(c.calib_call_samples == 1 for c in plan.first)
    assert head.exclude(("op",)).name == f"{HEAD} + 1 layer(s)"  # mixed precision on top keeps the head in float
    # with the compiler, the decode and everything after it run on the CPU: ranked behind fully-int8
    compiler = tmp_path / "edgetpu_compiler"
    compiler.write_text("#!/bin/sh\nexit 1\n")  # never run: candidates are only described here
    compiler.chmod(0o755)
    tpu = CoralTarget().candidates(_yolo_ctx(yolo, tmp_path, edgetpu=True, edgetpu_compiler=str(compiler)))
    ranks = {c.name: c.device_rank for c in tpu.first}
    assert ranks["int8 minmax per-channel"] == 0 and (ranks[HEAD] or 0) > 0
    # nothing offered without a head, nor where a precision other than auto was asked
    assert HEAD not in [c.name for c in CoralTarget().candidates(replace(_yolo_ctx(yolo, tmp_path), heads={})).first]
    int8 = CoralTarget().candidates(replace(_yolo_ctx(yolo, tmp_path, edgetpu=False), precision="int8"))
    assert HEAD not in [c.name for c in int8.first]


def test_coral_records_why_no_head_is_kept_in_float_where_the_outputs_have_no_decode(tmp_path: Path) -> None:
    from edgekit.bundle.manifest import Signature, TensorSpec

    w = np.ones((4, 3, 1, 1), dtype=np.float32)
    graph = helper.make_graph(  # a Conv writes the output: no decode after the last compute layer
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        "conv_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, 8, 8])],
        [onnx.numpy_helper.from_array(w, "w")],
    )
    model = tmp_path / "conv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(model))
    served = Signature(
        inputs=(TensorSpec("x", "float32", (1, 3, 8, 8), layout="NCHW"),),
        outputs=(TensorSpec("y", "float32", (1, 4, 8, 8)),),
    )
    ctx = replace(_yolo_ctx(model, tmp_path, edgetpu=False), served=served, heads={"y": "detect"})
    plan = CoralTarget().candidates(replace(ctx, static_shapes={"x": (1, 3, 8, 8)}))
    assert HEAD not in [c.name for c in plan.first]
    assert (HEAD, "no decode ops between the detect outputs and their last compute layers") in plan.skipped


@pytest.mark.slow
def test_coral_head_candidate_keeps_the_tflite_decode_in_float_dfl_included(yolo: Path, tmp_path: Path) -> None:
    from edgekit.compress.tflite_quant import op_outputs
    from edgekit.optimize.candidates import BuildSpace
    from edgekit.optimize.head_scope import tflite_head_scope

    ctx = _yolo_ctx(yolo, tmp_path, edgetpu=False, activations="int8")
    head = next(c for c in CoralTarget().candidates(ctx).first if c.name == HEAD)
    space = BuildSpace(tmp_path, {"images": sample_inputs(24, size=64, seed=8)}, ctx.served, 1, lambda _m: None)
    built = head.build(space)
    float_model = built.detail.converted.float32
    ops = op_outputs(float_model)
    kinds = {out: kind for kind, out, _ in ops}
    kept = built.excluded_nodes
    # the walk on the float TFLite: the class LOGISTIC, the DFL's SOFTMAX and its 0..R-1 projection
    # (the one CONV_2D taken in), the anchor/stride arithmetic and the joins up to the output
    assert {"LOGISTIC", "SOFTMAX", "CONV_2D", "CONCATENATION", "SUB", "ADD", "MUL"} <= {kinds[n] for n in kept}
    assert sum(kinds[n] == "CONV_2D" for n in kept) == 1 and ops[-1][1] in kept
    assert len(kept) < len(ops) / 4  # the head's decode, not the network
    outputs = [link.artifact for link in built.detail.converted.outputs]
    assert tflite_head_scope(float_model, outputs, ctx.heads).nodes == kept
    assert list(kept) == [out for _, out, _ in ops if out in set(kept)]  # in execution order
    assert any(n.endswith("decode ops of the detect head kept in float (on the float TFLite)") for n in built.notes)
    _, out_details = signature_details(built.detail.converted.quantized)
    assert next(iter(out_details.values()))["dtype"] == np.float32  # the float tail writes a float output
    rest = {kind for kind, out, _ in op_outputs(built.detail.converted.quantized) if out not in set(kept)}
    assert {"CONV_2D", "DEQUANTIZE"} <= rest  # the convs before the head stay int8, dequantized into it
