"""The ``jetson`` target (TensorRT-ready ONNX, candidates on the optimisation engine) and the
``tensorrt`` device runtime.

TensorRT needs an NVIDIA GPU; none here. What runs here: the Q/DQ structure TensorRT takes, the
calibration cache format, the engine-cache key and store, the ONNX Runtime CPU intermediate the
packager validates, the runtime's errors without tensorrt, and ``edgekit.package`` end to end.
Engine builds and TensorRT numerics are ``requires_gpu`` (and ``hil/gpu/check_tensorrt.sh``).
"""

from __future__ import annotations

import importlib.util
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device_agents.errors import IncompatibleError
from device_agents.runtimes import load_model
from device_agents.runtimes.options import TensorRtOptions
from device_agents.runtimes.tensorrt import EngineCache, EngineKey, workspace_bound_mb
from edgekit.bundle.codec import from_data
from edgekit.bundle.manifest import Tolerance
from edgekit.compress.qdq_structure import QdqStructureError, check_tensorrt_qdq
from edgekit.compress.trt_calibration_table import format_table, parse_table, scales_from_ranges, trt_version_number
from edgekit.errors import CalibrationDataError, ConfigError, MissingSDKError, ModelFormatError, UnsupportedOpError
from edgekit.optimize.run import build as build_with_engine
from edgekit.targets.base import BuildContext
from edgekit.targets.jetson import JetsonOptions, JetsonTarget
from edgekit.targets.op_support import TargetOpError
from edgekit.validate.ort_runner import ort_cpu_runner
from tests.factories import sample_inputs, tiny_classifier
from tests.packager.conftest import confident_inputs

HAS_TENSORRT = importlib.util.find_spec("tensorrt") is not None


def _gpu_ready() -> bool:
    if not HAS_TENSORRT:
        return False
    import torch

    return bool(torch.cuda.is_available())


# -- fixtures -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory):
    from edgekit.compress.onnx_prep import prepare_model

    root = tmp_path_factory.mktemp("jetson-src")
    return prepare_model(tiny_classifier(root / "tiny.onnx"), root / "prepared")


def _ctx(prepared, root: Path, precision: str, options: JetsonOptions | None = None, evaluate=None) -> BuildContext:
    out, work = root / "out", root / "work"
    out.mkdir(parents=True)
    work.mkdir(parents=True)
    return BuildContext(
        model_path=prepared.path,
        served=prepared.served,
        precision=precision,
        calib={"input": sample_inputs(48)},
        static_shapes={"input": (1, 3, 16, 16)},
        out_dir=out,
        work_dir=work,
        options=options or JetsonOptions(),
        progress=lambda _msg: None,
        evaluate=evaluate,
    )


@pytest.fixture(scope="module")
def builds(prepared, tmp_path_factory: pytest.TempPathFactory):
    """One build per precision (int8: entropy, Q/DQ on the inputs of weighted ops only): (context, result)."""
    out = {}
    for precision in ("int8", "fp16", "fp32"):
        options = (
            JetsonOptions(qdq_placement="weighted-inputs", int8_calibration="entropy") if precision == "int8" else None
        )
        ctx = _ctx(prepared, tmp_path_factory.mktemp(f"jetson-{precision}"), precision, options)
        out[precision] = (ctx, build_with_engine(JetsonTarget(), ctx))
    return out


def _onnx(path: Path):
    import onnx

    return onnx.load(str(path))


# -- calibration cache ------------------------------------------------------------------------


def test_calibration_table_writes_trt_header_and_big_endian_float_bits() -> None:
    text = format_table({"input": 0.01, "conv1_out": 2.0}, method="entropy", trt_version="10.3.0")
    assert text.splitlines() == ["TRT-100300-EntropyCalibration2", "input: 3c23d70a", "conv1_out: 40000000"]
    assert struct.unpack(">f", bytes.fromhex("3c23d70a"))[0] == np.float32(0.01)


def test_calibration_table_round_trips_and_names_each_calibrator() -> None:
    scales = {"a": 0.125, "b/with:colon": 3.5e-4}
    header, parsed = parse_table(format_table(scales, method="minmax", trt_version="8.6.1"))
    assert header == "TRT-8601-MinMaxCalibration"
    assert parsed == {k: float(np.float32(v)) for k, v in scales.items()}
    assert format_table(scales, method="percentile", trt_version="10.0.0").startswith("TRT-100000-LegacyCalibration\n")
    assert (trt_version_number("10.3.0"), trt_version_number("8.6.1"), trt_version_number("10")) == (
        100300,
        8601,
        100000,
    )


def test_calibration_scales_are_symmetric_amax_over_127_and_refuse_bad_ranges() -> None:
    scales = scales_from_ranges({"x": (-2.54, 1.0), "relu": (0.0, 1.27), "dead": (0.0, 0.0)})
    assert scales["x"] == pytest.approx(0.02) and scales["relu"] == pytest.approx(0.01)
    assert scales["dead"] == pytest.approx(1 / 127)  # an always-zero tensor still gets a positive scale
    with pytest.raises(CalibrationDataError, match=r"'x'.*not finite"):
        scales_from_ranges({"x": (0.0, float("inf"))})
    with pytest.raises(ModelFormatError, match="line 2"):
        parse_table("TRT-100000-EntropyCalibration2\ninput 3c23d70a\n")
    with pytest.raises(ModelFormatError, match="must start with"):
        parse_table("input: 3c23d70a\n")


# -- int8 build: the Q/DQ model TensorRT takes -----------------------------------------------------


def test_jetson_int8_is_symmetric_int8_qdq_with_per_channel_weights_and_float_bias(builds) -> None:
    ctx, result = builds["int8"]
    model = _onnx(ctx.out_dir / "model.onnx")
    summary = check_tensorrt_qdq(model)
    assert set(summary.quantized_ops) == {"conv1", "conv2", "fc"}
    assert summary.per_channel_weights == 3 and summary.float_ops == ()
    ops = [n.op_type for n in model.graph.node]
    assert ops.count("Conv") == 2 and "Relu" in ops  # activations kept explicit
    # Q/DQ only on inputs of weighted ops: no QuantizeLinear reads a Conv/Gemm output directly
    producer = {o: n for n in model.graph.node for o in n.output}
    assert all(
        producer.get(n.input[0]) is None or producer[n.input[0]].op_type not in ("Conv", "Gemm")
        for n in model.graph.node
        if n.op_type == "QuantizeLinear"
    )
    assert (result.precision.weights, result.precision.activations, result.precision.label) == ("int8", "int8", "w8a8")
    assert "symmetric per-channel" in result.precision.method
    assert result.target_options["builder_flags"] == ["int8", "fp16"]
    assert result.files == {"model.onnx": "artifact", "calibration.cache": "calibration"}


def test_jetson_int8_ships_a_calibration_cache_for_every_fp32_tensor(builds) -> None:
    ctx, _ = builds["int8"]
    header, scales = parse_table((ctx.out_dir / "calibration.cache").read_text())
    assert header == "TRT-100000-EntropyCalibration2"
    fp32 = _onnx(ctx.model_path)
    tensors = {"input"} | {o for n in fp32.graph.node for o in n.output}
    assert set(scales) == tensors
    assert all(s > 0 for s in scales.values())
    # the input's activation scale in the Q/DQ model comes from the same calibration pass
    from onnx import numpy_helper

    qdq_inits = {i.name: numpy_helper.to_array(i) for i in _onnx(ctx.out_dir / "model.onnx").graph.initializer}
    assert float(qdq_inits["input_scale"]) == pytest.approx(scales["input"], rel=1e-6)


def test_jetson_validates_through_ort_cpu_intermediate_and_reports_device_numbers_missing(builds, prepared) -> None:
    _, result = builds["int8"]
    assert result.runnable_here is False and result.static is True
    assert result.intermediate_name == "ONNX Runtime CPU on the TensorRT Q/DQ ONNX"
    assert result.op_placement is None
    assert any(n.startswith("TensorRT layer info: not measured here") for n in result.notes)
    assert "TensorRT latency: not measured here" in result.notes
    assert [s.shape for s in result.artifact_signature.inputs] == [(1, 3, 16, 16)]
    assert [s.shape for s in result.artifact_signature.outputs] == [(1, 10)]
    x = confident_inputs(prepared.path, 32, seed=7)
    ref = ort_cpu_runner(prepared.path)({"input": x})["probs"]
    got = np.concatenate([result.intermediate({"input": x[i : i + 1]})["probs"] for i in range(len(x))])
    assert not np.allclose(got, ref, atol=1e-6)  # it really runs the quantized graph
    assert np.mean(got.argmax(1) == ref.argmax(1)) >= 0.9


def test_jetson_fp16_ships_fp32_onnx_with_fp16_flag_and_emulates_fp16_weights(builds, prepared) -> None:
    ctx, result = builds["fp16"]
    assert (ctx.out_dir / "model.onnx").read_bytes() == Path(prepared.path).read_bytes()
    assert result.target_options["builder_flags"] == ["fp16"]
    assert (result.precision.label, result.files) == ("w16a16", {"model.onnx": "artifact"})
    x = sample_inputs(4, seed=3)
    fp32 = ort_cpu_runner(prepared.path)({"input": x})["probs"]
    fp16 = np.concatenate([result.intermediate({"input": x[i : i + 1]})["probs"] for i in range(4)])
    assert 0 < np.abs(fp16 - fp32).max() < 1e-2
    _, plain = builds["fp32"]
    assert plain.target_options["builder_flags"] == [] and plain.precision.label == "w32a32"


def test_jetson_int8_tries_every_calibration_of_every_placement_when_none_meets_the_gate(prepared, tmp_path) -> None:
    from edgekit.optimize.run import EngineSettings, optimize

    impossible = Tolerance(min_top1_agreement=1.01)  # no candidate can pass: every refinement is built
    ctx = _ctx(prepared, tmp_path, "int8")
    searched = optimize(JetsonTarget(), ctx, EngineSettings(tolerance=impossible)).search
    built = {o.name: o for o in searched.outcomes if o.status in ("failed", "chosen")}
    for placement in ("weighted-inputs", "all"):
        for method in ("entropy", "percentile 99.999", "minmax"):
            assert f"tensorrt int8 q/dq {placement} {method}" in built
    assert all(o.latency is None and o.device_rank == 0 for o in built.values() if o.precision == "int8")
    assert "most accurate" in searched.why  # none passed: the most accurate is kept and the gate reports it


def test_jetson_all_ops_placement_quantizes_pooling_and_activation_outputs_too(prepared, tmp_path) -> None:
    ctx = _ctx(prepared, tmp_path, "int8", JetsonOptions(qdq_placement="all", int8_calibration="minmax"))
    result = build_with_engine(JetsonTarget(), ctx)
    model = _onnx(ctx.out_dir / "model.onnx")
    summary = check_tensorrt_qdq(model)  # still what TensorRT takes: symmetric int8, float biases
    assert set(summary.quantized_ops) == {"conv1", "conv2", "fc"}
    producer = {o: n for n in model.graph.node for o in n.output}
    fed = {
        producer[n.input[0]].op_type
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] in producer
    }
    assert fed - {"Conv", "Gemm", "Relu"}  # Q/DQ also after ops that are not weighted (pooling, reshape)
    assert "Q/DQ placement all" in result.precision.method and "minmax" in result.precision.method


def test_qdq_check_refuses_asymmetric_uint8_and_quantized_bias(prepared, tmp_path: Path) -> None:
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    from edgekit.compress.ort_quant import ArrayCalibrationReader

    calib = {"input": sample_inputs(8)}

    def quantize(name: str, activations, **extra) -> Path:
        path = tmp_path / name
        quantize_static(
            str(prepared.path),
            str(path),
            ArrayCalibrationReader(calib),
            quant_format=QuantFormat.QDQ,
            per_channel=True,
            activation_type=activations,
            weight_type=QuantType.QInt8,
            extra_options=extra,
        )
        return path

    with pytest.raises(QdqStructureError, match="zero point is UINT8; TensorRT takes INT8"):
        check_tensorrt_qdq(_onnx(quantize("u8.onnx", QuantType.QUInt8, QuantizeBias=False)))
    with pytest.raises(QdqStructureError, match="zero point is not 0; TensorRT needs symmetric"):
        check_tensorrt_qdq(_onnx(quantize("asym.onnx", QuantType.QInt8, QuantizeBias=False)))
    with pytest.raises(QdqStructureError, match=r"int32 \(quantized\) bias; TensorRT needs float biases"):
        check_tensorrt_qdq(_onnx(quantize("bias.onnx", QuantType.QInt8, ActivationSymmetric=True)))
    with pytest.raises(QdqStructureError, match="not INT8"):
        check_tensorrt_qdq(_onnx(prepared.path))


def test_qdq_check_refuses_per_channel_scales_on_the_wrong_axis(builds) -> None:
    from onnx import helper

    ctx, _ = builds["int8"]
    model = _onnx(ctx.out_dir / "model.onnx")
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == "w1_quantized")
    del dq.attribute[:]
    dq.attribute.append(helper.make_attribute("axis", 1))
    with pytest.raises(QdqStructureError, match=r"axis 1 .*output-channel axis 0"):
        check_tensorrt_qdq(model)


# -- check_model ------------------------------------------------------------------------------------


def _model_with(tmp_path: Path, op: str, domain: str = "") -> Path:
    import onnx
    from onnx import TensorProto, helper

    node = helper.make_node(op, ["x"], ["y"], name="the_node", domain=domain)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    path = tmp_path / f"{op}.onnx"
    onnx.save(model, str(path))
    return path


def test_jetson_check_model_names_op_node_and_targets_that_take_it(tmp_path: Path) -> None:
    with pytest.raises(TargetOpError) as err:
        JetsonTarget().check_model(_model_with(tmp_path, "Unique"))
    text = str(err.value)
    assert "'jetson' cannot take op Unique (node 'the_node')" in text
    assert "cpu" in err.value.alternatives  # ONNX Runtime's cpu target takes it
    with pytest.raises(UnsupportedOpError, match=r"com\.example\.MyPlugin \(node 'the_node'\)"):
        JetsonTarget().check_model(_model_with(tmp_path, "MyPlugin", "com.example"))


def test_jetson_check_model_accepts_the_tiny_classifier(prepared) -> None:
    JetsonTarget().check_model(prepared.path)


# -- tensorrt runtime: pure-python parts ------------------------------------------------------------


def _key(**changes) -> EngineKey:
    fields = dict(
        artifact_sha256="ab" * 32,
        gpu_name="Orin",
        compute_capability="8.7",
        tensorrt_version="10.3.0",
        builder_flags=("int8", "fp16"),
        input_shapes=(("input", (1, 3, 16, 16)),),
    )
    return EngineKey(**(fields | changes))


def test_engine_key_changes_with_gpu_capability_tensorrt_flags_shapes_and_artifact() -> None:
    base = _key()
    variants = [
        _key(gpu_name="RTX 4090"),
        _key(compute_capability="8.9"),
        _key(tensorrt_version="10.4.0"),
        _key(builder_flags=("fp16",)),
        _key(input_shapes=(("input", (2, 3, 16, 16)),)),
        _key(artifact_sha256="cd" * 32),
    ]
    digests = {base.digest, *(v.digest for v in variants)}
    assert len(digests) == 7
    assert base.digest == _key().digest and base.file_name.startswith("abababababababab-")


def test_engine_cache_builds_once_then_hits_and_rebuilds_when_the_key_changes(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path / "engines")
    built: list[str] = []

    def build(tag: str):
        def make() -> bytes:
            built.append(tag)
            return tag.encode()

        return make

    assert cache.load_or_build(_key(), build("orin")) == (b"orin", "built")
    assert cache.load_or_build(_key(), build("orin-again")) == (b"orin", "hit")
    moved = _key(gpu_name="RTX 4090", compute_capability="8.9")
    assert cache.load_or_build(moved, build("rtx")) == (b"rtx", "built")
    assert built == ["orin", "rtx"]
    # the engine for the other GPU is gone: it can never load here again
    assert sorted(p.name for p in (tmp_path / "engines").glob("*.engine")) == [moved.file_name]
    (tmp_path / "engines" / moved.file_name).with_suffix(".json").write_text('{"gpu_name": "edited"}')
    assert cache.load(moved) is None  # a key that does not match its record is not trusted
    assert EngineCache(None).load_or_build(_key(), build("x")) == (b"x", "built, not cached")


def test_workspace_is_bounded_by_agent_setting_bundle_and_memory_budget(jetson_bundle) -> None:
    _, packaged, _ = jetson_bundle
    assert workspace_bound_mb(TensorRtOptions(), packaged) == 1024  # JetsonOptions.workspace_mb, from the bundle
    manifest = packaged.with_updates(target_options=packaged.target_options | {"workspace_mb": 512})
    assert workspace_bound_mb(TensorRtOptions(), manifest) == 512
    assert workspace_bound_mb(TensorRtOptions(workspace_mb=2048), manifest) == 2048
    assert workspace_bound_mb(TensorRtOptions(workspace_mb=2048, memory_budget_mb=300), manifest) == 300
    with pytest.raises(
        ConfigError, match=r"agent\.runtimes\.tensorrt\.memory_budget_mb: expected an integer, got 'lots'"
    ):
        from_data(TensorRtOptions, {"memory_budget_mb": "lots"}, "agent.runtimes.tensorrt", ConfigError)


# -- edgekit.package end to end ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def jetson_bundle(package_tiny):
    return package_tiny("jetson", "int8", samples=60)


def test_package_jetson_int8_writes_a_verified_bundle_validated_on_the_intermediate(jetson_bundle) -> None:
    result, manifest, extracted = jetson_bundle
    assert manifest == result.manifests["jetson"]
    assert (manifest.target, manifest.compatibility.runtime, manifest.compatibility.accelerator) == (
        "jetson",
        "tensorrt",
        "cuda",
    )
    assert {f.path: f.role for f in manifest.files} == {
        "model.onnx": "artifact",
        "calibration.cache": "calibration",
        "golden.npz": "golden",
    }
    v = manifest.validation
    assert v.passed and v.top1_agreement >= 0.98
    assert v.measured_on == "intermediate (ONNX Runtime CPU on the TensorRT Q/DQ ONNX) on the host"
    assert v.latency_p50_ms is None  # TensorRT latency is not measured here
    assert [s.shape for s in manifest.artifact_signature.inputs] == [(1, 3, 16, 16)]
    check_tensorrt_qdq(_onnx(extracted / "model.onnx"))
    assert parse_table((extracted / "calibration.cache").read_text())[0] == "TRT-100000-EntropyCalibration2"


def test_jetson_auto_rescues_int8_that_misses_the_dense_gate_by_leaving_layers_without_qdq(keypair, tmp_path) -> None:
    from tests.factories import package_small_data as package
    from tests.optimize.models import outlier_mlp

    model = outlier_mlp(tmp_path / "outlier.onnx")  # plain INT8 loses the outlier channel's neighbours
    x = np.random.default_rng(1).standard_normal((80, 16)).astype(np.float32)
    # MinMax: the outlier sets layer_a's output range (entropy clips it instead, a different failure)
    result = package(
        model, targets=["jetson"], precision="auto", calib={"x": x}, key=keypair[0], out_dir=tmp_path / "out",
        options={"jetson": {"int8_calibration": "minmax"}},
    )  # fmt: skip
    m = result.manifests["jetson"]
    assert m.validation.passed and m.precision.weights == "int8"
    assert m.precision.excluded_nodes == ("layer_b", "layer_a") and "sensitivity" in m.precision.excluded_reason
    assert m.target_options["builder_flags"] == ["int8", "fp16"]  # the layers without Q/DQ run FP16 there
    rows = {c.id: c for c in m.candidates.candidates}
    plain = [c for c in rows.values() if c.settings["precision"] == "int8" and not c.excluded_nodes]
    assert plain and all(c.status == "failed" and c.cosine < 0.5 for c in plain)
    assert rows["tensorrt fp16"].status == "passed"  # FP16 passes too, but ranks after (mixed) INT8
    assert rows[m.candidates.chosen].excluded_nodes == ("layer_b", "layer_a")
    assert any("left without Q/DQ run in FP16 on the device" in n for n in m.validation.notes)
    assert m.validation.measured_on.endswith("(layers without Q/DQ: weights rounded to FP16)) on the host")
    report = result.reports["jetson"].read_text()
    assert "Layers kept in float (mixed precision): layer_b, layer_a" in report


def test_fp16_weights_model_rounds_only_the_layers_named(prepared, tmp_path) -> None:
    from onnx import numpy_helper

    from edgekit.targets.jetson import fp16_weights_model

    src = {i.name: numpy_helper.to_array(i) for i in _onnx(prepared.path).graph.initializer}
    fc_inputs = {i for n in _onnx(prepared.path).graph.node if n.name == "fc" for i in n.input}
    out = fp16_weights_model(prepared.path, tmp_path / "fc16.onnx", ["fc"])
    got = {i.name: numpy_helper.to_array(i) for i in _onnx(out).graph.initializer}
    for name, value in src.items():
        rounded = value.dtype == np.float32 and name in fc_inputs
        expected = value.astype(np.float16).astype(np.float32) if rounded else value
        assert np.array_equal(got[name], expected), name
    assert any(not np.array_equal(got[n], src[n]) for n in fc_inputs if n in src)


def test_jetson_auto_without_timings_ships_int8_by_device_rank_and_says_latency_not_measured(package_tiny) -> None:
    result, manifest, extracted = package_tiny("jetson", "auto", samples=60)
    c = manifest.candidates
    assert c is not None and c.latency_measured is False
    statuses = {r.id: r.status for r in c.candidates}
    assert statuses["tensorrt fp32"] == "passed" and statuses["tensorrt fp16"] == "passed"
    assert manifest.precision.weights == "int8" and statuses[c.chosen] == "chosen"
    assert all(r.latency_p50_ms is None for r in c.candidates)
    assert any("latency not measured here" in n and "rank 0" in n for n in c.notes)
    assert manifest.validation.latency_p50_ms is None
    report = result.reports["jetson"].read_text()
    assert "Latency: not measured here" in report and "expected fastest on the device" in report
    check_tensorrt_qdq(_onnx(extracted / "model.onnx"))


@pytest.mark.skipif(HAS_TENSORRT, reason="checks the behaviour without the tensorrt package")
def test_tensorrt_runtime_without_sdk_names_the_extra_or_the_missing_fallback_provider(jetson_bundle) -> None:
    _, manifest, extracted = jetson_bundle
    with pytest.raises(MissingSDKError, match=r"tensorrt is not installed.*pip install 'edgekit\[tensorrt\]'"):
        load_model(extracted, manifest)
    with pytest.raises(IncompatibleError, match="needs ONNX Runtime's TensorrtExecutionProvider"):
        load_model(extracted, manifest, TensorRtOptions(fallback="ort-trt"))
    with pytest.raises(IncompatibleError, match="CUDAExecutionProvider"):
        load_model(extracted, manifest, TensorRtOptions(fallback="ort-cuda"))
    with pytest.raises(ConfigError, match="fallback: 'ort-cpu' is not one of '', 'ort-trt', 'ort-cuda'"):
        from_data(TensorRtOptions, {"fallback": "ort-cpu"}, "agent.runtimes.tensorrt", ConfigError)


# -- on a GPU ----------------------------------------------------------------------------------------


@pytest.mark.requires_gpu
@pytest.mark.skipif(not _gpu_ready(), reason="needs the tensorrt package and a CUDA GPU (none here)")
def test_tensorrt_builds_caches_and_runs_the_engine_close_to_fp32(jetson_bundle, tmp_path: Path) -> None:
    _, manifest, extracted = jetson_bundle
    options = TensorRtOptions(cache_dir=tmp_path / "engines", workspace_mb=256)
    golden = np.load(extracted / "golden.npz")
    first = load_model(extracted, manifest, options)
    try:
        assert first.runner.describe()["engine_cache"] == "built"
        runner: Any = first.runner  # the TensorRtRunner
        layers = runner.layer_information()
        assert layers and layers.get("Layers")
        x = golden["in_input"]
        got = np.concatenate([first.infer({"input": x[i : i + 1]})["probs"] for i in range(len(x))])
    finally:
        first.close()
    assert np.mean(got.argmax(1) == golden["out_probs"].argmax(1)) >= 0.75
    second = load_model(extracted, manifest, options)
    try:
        assert second.runner.describe()["engine_cache"] == "hit"
    finally:
        second.close()
