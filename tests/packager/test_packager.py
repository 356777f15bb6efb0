"""edgekit.package end to end for the cpu target, and every argument it must refuse."""

from __future__ import annotations

import re
from datetime import datetime, timedelta, timezone
from pathlib import Path

import numpy as np
import pytest

from device_agents.runtimes import load_model
from edgekit.bundle import TrustStore, extract, read_verified_manifest
from edgekit.errors import (
    CalibrationDataError,
    ConfigError,
    ModelFormatError,
    UnsupportedOpError,
    ValidationFailedError,
)
from edgekit.packaging.result import PackageValidationError
from tests.factories import confident_inputs, sample_inputs, tiny_classifier, tiny_dense
from tests.factories import package_small_data as package


def _extract(bundle: Path, pub: Path, dest: Path):
    verified = read_verified_manifest(bundle, TrustStore.from_files([pub]))
    return verified.manifest, extract(bundle, verified, dest)


def _tried(notes: tuple[str, ...]) -> list[str]:
    """The INT8 candidates tried (the FP32 baseline, always measured alongside, left out)."""
    return [n for n in notes if n.startswith("tried ") and not n.startswith("tried ort fp32")]


# -- the happy path -----------------------------------------------------------------------


def test_package_cpu_int8_writes_a_signed_bundle_named_after_name_target_version(int8_package, keypair) -> None:
    result, _ = int8_package
    bundle = result.bundles["cpu"]
    assert bundle.name == "tiny-cpu-v2.ekb"
    manifest, _ = _extract(bundle, keypair[1], bundle.parent / "x1")
    assert manifest == result.manifests["cpu"]
    assert (manifest.name, manifest.version, manifest.target) == ("tiny", 2, "cpu")
    assert manifest.compatibility.runtime == "onnxruntime"
    assert manifest.source.filename == "tiny.onnx" and manifest.source.opset == 13
    assert manifest.signer_key_id == next(iter(TrustStore.from_files([keypair[1]]).keys))


def test_package_cpu_int8_records_search_precision_and_validation(int8_package) -> None:
    result, _ = int8_package
    m = result.manifests["cpu"]
    assert (m.precision.weights, m.precision.label) == ("int8", "w8a8")
    assert m.precision.method.startswith("ort-static ")
    assert m.precision.activations in ("uint8", "int8")
    tried = _tried(m.validation.notes)
    assert 2 <= len(tried) <= 6
    assert any(n.startswith(f"chose {m.precision.method}: ") for n in m.validation.notes)
    assert any(n.startswith("tried ort fp32: ") for n in m.validation.notes)  # the baseline, measured alongside
    v = m.validation
    assert v.passed and v.kind == "classifier"
    assert v.samples == 12  # every 5th of 60 calibration samples held out
    assert v.top1_agreement is not None and v.top1_agreement >= 0.98
    assert v.size_bytes == m.file("model.onnx").size_bytes
    assert v.latency_p50_ms is not None and v.fp32_latency_p50_ms is not None
    assert v.measured_on.startswith("host onnxruntime")


def test_package_cpu_records_op_placement_from_onnxruntime(int8_package) -> None:
    m = int8_package[0].manifests["cpu"]
    op = m.op_placement
    assert op is not None and op.tool.startswith("onnxruntime ") and "profile" in op.tool
    assert op.accelerated == len(op.entries) > 0 and op.fallback == 0
    assert {e.device for e in op.entries} == {"CPUExecutionProvider"}
    # quantized kernels show up as ORT ran them (QDQ fused into QLinear*, or QOperator nodes)
    assert any(e.op.startswith(("QLinear", "QGemm", "DynamicQuantize")) for e in op.entries)


def test_package_golden_vectors_pass_on_the_device_runtime(int8_package, keypair, tmp_path: Path) -> None:
    manifest, model_dir = _extract(int8_package[0].bundles["cpu"], keypair[1], tmp_path / "x")
    with np.load(model_dir / manifest.golden.file) as g:
        golden = {k: g[k] for k in g.files}
    assert sorted(golden) == ["in_input", "out_probs"]
    assert manifest.golden.count == golden["in_input"].shape[0] == 4
    assert manifest.golden.atol >= manifest.validation.max_abs_error  # rounded up, never below what was seen
    served = load_model(model_dir, manifest)
    try:
        out = served.infer({"input": golden["in_input"]})["probs"]
    finally:
        served.close()
    np.testing.assert_allclose(out, golden["out_probs"], atol=manifest.golden.atol, rtol=manifest.golden.rtol)


def test_package_progress_lines_and_summary_table(int8_package) -> None:
    result, lines = int8_package
    assert lines[0] == "preparing tiny.onnx"
    assert "[cpu] building int8" in lines
    assert "[cpu] candidate 1: ort fp32" in lines
    assert any(re.fullmatch(r"\[cpu\] candidate 2: ort-static .*", x) for x in lines)
    table = result.table().splitlines()
    assert table[0].split() == [
        "target",
        "precision",
        "size",
        "size",
        "vs",
        "fp32",
        "accuracy",
        "vs",
        "fp32",
        "p50",
        "/",
        "p90",
        "(IQR)",
        "speed",
        "vs",
        "fp32",
        "result",
    ]
    assert re.match(
        r"cpu\s+int8 \(w8a8\) \u2192 .+ on onnxruntime"
        r"\s+\d+\.\d KB\s+\d\.\d\dx\s+top-1 agree \d+\.\d%\s+\d\.\d{3} / \d\.\d{3} ms \(\d\.\d{3}\)"
        r"\s+\d\.\d\dx\s+passed(, slower than fp32)?$",
        table[2],
    )


@pytest.mark.parametrize("precision", ["fp32", "fp16", "int8", "int8-weights", "int4-weights"])
def test_package_dense_model_every_cpu_precision(precision: str, keypair, tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "dense.onnx")
    result = package(
        model,
        targets="cpu",
        precision=precision,
        calib={"image": sample_inputs(30)},
        key=keypair[0],
        name="dense",
        out_dir=tmp_path,
    )
    m = result.manifests["cpu"]
    assert m.validation.kind == "dense" and m.validation.passed
    assert m.validation.cosine is not None and m.validation.cosine >= 0.96
    assert m.validation.top1_agreement is None
    assert [o.name for o in m.signature.outputs] == ["mask", "embedding"]
    expected = {
        "fp32": ("fp32", "fp32"),
        "fp16": ("fp16", "fp16"),
        "int8": ("int8", None),
        "int8-weights": ("int8", "uint8"),
        "int4-weights": ("int4", None),  # fp32 compute, or int8 at accuracy level 4: whichever measured faster
    }[precision]
    assert m.precision.weights == expected[0]
    assert expected[1] is None or m.precision.activations == expected[1]
    if precision == "int4-weights":
        assert (m.precision.activations == "int8") == ("accuracy level 4" in m.precision.method)
    ops = {e.op for e in m.op_placement.entries}
    if precision == "int4-weights":
        assert "MatMulNBits" in ops
    if precision == "int8-weights":
        assert "MatMulInteger" in ops or "DynamicQuantizeMatMul" in ops


def test_package_opset11_dynamic_axes_per_channel_int8(keypair, tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "o11.onnx", opset=11, dynamic_size=True)
    x = confident_inputs(model, 40, size=20)
    result = package(
        model,
        targets="cpu",
        precision="int8",
        calib={"input": x},
        key=keypair[0],
        name="o11",
        out_dir=tmp_path,
        options={"cpu": {"per_channel": "on", "activations": "uint8"}},
    )
    m = result.manifests["cpu"]
    assert m.source.opset == 11
    assert m.signature.inputs[0].shape == ("batch", 3, "height", "width")
    assert "per-channel" in m.precision.method and "u8s8" in m.precision.method
    assert "prepared: opset 11->13" in m.validation.notes
    _, model_dir = _extract(result.bundles["cpu"], keypair[1], tmp_path / "x")
    served = load_model(model_dir, m)
    try:  # dynamic axes stay dynamic: another batch and spatial size run
        assert served.infer({"input": sample_inputs(3, size=28)})["probs"].shape == (3, 10)
    finally:
        served.close()


@pytest.mark.parametrize("opset", [12, 14, 16, 18])
def test_package_int8_across_opsets_keeps_the_source_interface(keypair, tmp_path: Path, opset: int) -> None:
    model = tiny_classifier(tmp_path / f"o{opset}.onnx", opset=opset)
    result = package(
        model,
        targets="cpu",
        precision="int8",
        calib={"input": confident_inputs(model, 40)},
        key=keypair[0],
        name=f"o{opset}",
        out_dir=tmp_path,
    )
    m = result.manifests["cpu"]
    assert m.source.opset == opset and m.validation.passed
    assert m.precision.weights == "int8"
    assert [s.name for s in m.signature.inputs] == ["input"] and m.signature.inputs[0].shape[0] == "batch"
    _, model_dir = _extract(result.bundles["cpu"], keypair[1], tmp_path / "x")
    served = load_model(model_dir, m)
    try:
        assert served.infer({"input": sample_inputs(2)})["probs"].shape == (2, 10)
    finally:
        served.close()


def test_package_with_eval_and_labels_records_accuracy(keypair, tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "m.onnx")
    x_eval = sample_inputs(20, seed=9)
    import onnxruntime as ort

    labels = ort.InferenceSession(str(model)).run(None, {"input": x_eval})[0].argmax(1)
    labels[:2] = (labels[:2] + 1) % 10  # fp32 accuracy 0.9, so the drop is measured against it
    result = package(
        model,
        targets="cpu",
        precision="fp32",
        calib={"input": sample_inputs(10)},
        eval={"input": x_eval},
        labels=labels,
        key=keypair[0],
        name="m",
        out_dir=tmp_path,
    )
    v = result.manifests["cpu"].validation
    assert v.samples == 20
    assert v.fp32_top1_accuracy == pytest.approx(0.9) and v.top1_accuracy == pytest.approx(0.9)


def test_package_search_bounded_and_restricted_by_options(keypair, tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "m.onnx")
    result = package(
        model,
        targets="cpu",
        precision="int8",
        calib={"input": sample_inputs(30)},
        key=keypair[0],
        name="m",
        out_dir=tmp_path,
        options={"cpu": {"activations": "int8", "per_channel": "off", "quant_format": "qdq", "calibration": "minmax"}},
        allow_failed=True,
    )
    m = result.manifests["cpu"]
    assert _tried(m.validation.notes) == [
        n for n in m.validation.notes if n.startswith("tried ort-static qdq s8s8 per-tensor minmax")
    ]
    assert len(_tried(m.validation.notes)) == 1
    assert m.target_options["activations"] == "int8"


def test_package_tries_other_calibration_methods_when_minmax_fails(keypair, tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "m.onnx")
    x = sample_inputs(200)
    x[0, 0, 0, 0] = 300.0  # one outlier stretches MinMax ranges until accuracy fails
    result = package(
        model,
        targets="cpu",
        precision="int8",
        calib={"input": x},
        eval={"input": sample_inputs(30, seed=7)},
        key=keypair[0],
        name="m",
        out_dir=tmp_path,
        allow_failed=True,
    )
    notes = result.manifests["cpu"].validation.notes
    tried = _tried(notes)
    assert len(tried) == 6
    assert [("percentile" in t, "entropy" in t) for t in tried[-2:]] == [(True, False), (False, True)]
    # none passed on the selection samples: the most accurate there is the one the gate then judges
    agreements = {
        t.split(":")[0].removeprefix("tried "): float(re.search(r"agreement (\d\.\d+)", t).group(1)) for t in tried
    }
    chosen = next(n for n in notes if n.startswith("chose ")).split(":")[0].removeprefix("chose ")
    assert agreements[chosen] == max(agreements.values())


# -- refusals -----------------------------------------------------------------------------


@pytest.mark.parametrize("content", [b"", b"hello, I am not a model\n", bytes(range(256)) * 4, b"PK\x03\x04torch"])
def test_package_non_onnx_file_raises_model_format_error(content: bytes, keypair, tmp_path: Path) -> None:
    model = tmp_path / "model.pt"
    model.write_bytes(content)
    with pytest.raises(ModelFormatError, match=r"model\.pt is not (an|a valid) ONNX model") as exc:
        package(
            model,
            targets="cpu",
            precision="int8",
            calib={"input": sample_inputs(4)},
            key=keypair[0],
            name="m",
            out_dir=tmp_path,
        )
    assert exc.value.exit_code == 2
    assert not list(tmp_path.glob("*.ekb"))


def test_package_missing_model_file(keypair, tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="does not exist"):
        package(
            tmp_path / "nope.onnx",
            targets="cpu",
            precision="fp32",
            calib={"input": sample_inputs(4)},
            key=keypair[0],
            out_dir=tmp_path,
        )


@pytest.mark.parametrize(
    ("calib", "message"),
    [
        ({"images": sample_inputs(4)}, "calibration data: array 'images' is not a model input (inputs: input)"),
        ({}, "calibration data: no array for input 'input' (given: none)"),
        (
            {"input": sample_inputs(4, size=8)},
            r"input 'input' has shape [4, 3, 8, 8], expected [N, 3, 16, 16] (axis 2 is 8, the model fixes it to 16)",
        ),
        ({"input": sample_inputs(4)[0]}, "input 'input' has shape [3, 16, 16], expected [N, 3, 16, 16]"),
        ({"input": sample_inputs(4).astype(np.int32)}, "input 'input' is int32, expected float32"),
        ({"input": np.zeros((0, 3, 16, 16), np.float32)}, "input 'input' has no samples"),
        ({"input": sample_inputs(1)}, "calibration data has 1 sample; give at least 2"),
    ],
)
def test_package_bad_calibration_data_names_the_input(
    calib, message: str, keypair, tiny_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(CalibrationDataError, match=re.escape(message)) as exc:
        package(tiny_model, targets="cpu", precision="int8", calib=calib, key=keypair[0], name="m", out_dir=tmp_path)
    assert exc.value.exit_code == 2


def test_package_calibration_float64_is_converted(keypair, tiny_model: Path, tmp_path: Path) -> None:
    result = package(
        tiny_model,
        targets="cpu",
        precision="fp32",
        calib={"input": sample_inputs(10).astype(np.float64)},
        key=keypair[0],
        name="m",
        out_dir=tmp_path,
    )
    assert result.manifests["cpu"].validation.passed


def test_package_bad_calibration_files(keypair, tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(CalibrationDataError, match=r"calibration data .*missing.npz does not exist"):
        package(
            tiny_model,
            targets="cpu",
            precision="int8",
            calib=tmp_path / "missing.npz",
            key=keypair[0],
            out_dir=tmp_path,
        )
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not numpy")
    with pytest.raises(CalibrationDataError, match=r"is not a readable .npz file"):
        package(tiny_model, targets="cpu", precision="int8", calib=junk, key=keypair[0], out_dir=tmp_path)


def test_package_eval_and_labels_checked(keypair, tiny_model: Path, tmp_path: Path) -> None:
    kw = {"calib": {"input": sample_inputs(10)}, "key": keypair[0], "out_dir": tmp_path}
    with pytest.raises(CalibrationDataError, match=re.escape("evaluation data: input 'input' is int64")):
        package(tiny_model, targets="cpu", precision="fp32", eval={"input": np.zeros((2, 3, 16, 16), np.int64)}, **kw)
    with pytest.raises(CalibrationDataError, match="labels: 3 labels for 10 evaluation samples"):
        package(
            tiny_model, targets="cpu", precision="fp32", eval={"input": sample_inputs(10)}, labels=np.arange(3), **kw
        )
    with pytest.raises(CalibrationDataError, match="labels: expected a 1-D integer array"):
        package(tiny_model, targets="cpu", precision="fp32", labels=np.zeros(10, np.float32), **kw)


def test_package_failing_tolerance_writes_no_bundle(keypair, tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "dense.onnx")
    with pytest.raises(ValidationFailedError) as exc:
        package(
            model,
            targets="cpu",
            precision="int8",
            calib={"image": sample_inputs(20)},
            key=keypair[0],
            name="d",
            out_dir=tmp_path,
            tolerance={"max_relative_error": 1e-7},
        )
    message = str(exc.value)
    assert message.startswith("cpu int8 failed validation on 4 held-out samples: relative error to fp32 ")
    assert "needs <= 1e-07 (off by" in message and "--allow-failed" in message and "--tolerance" in message
    assert exc.value.exit_code == 3
    assert isinstance(exc.value, PackageValidationError)
    assert exc.value.result.bundles == {} and not exc.value.result.rows[0].passed
    assert not list(tmp_path.glob("*.ekb"))


def test_package_allow_failed_writes_a_bundle_marked_failed(keypair, tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "dense.onnx")
    result = package(
        model,
        targets="cpu",
        precision="fp16",
        calib={"image": sample_inputs(20)},
        key=keypair[0],
        name="d",
        out_dir=tmp_path,
        tolerance={"min_cosine": 1.5},
        allow_failed=True,
    )
    assert not result.passed and not result.to_dict()["passed"]
    m = result.manifests["cpu"]
    assert not m.validation.passed
    assert m.validation.tolerance.min_cosine == 1.5
    assert [f.split(" 1.5")[0] for f in m.validation.failures] == ["mean cosine to fp32 1, needs >="]
    assert result.bundles["cpu"].exists()


@pytest.mark.parametrize(
    ("precision", "message"),
    [
        (
            "int9",
            "--precision 'int9' is not one of fp32, fp16, bf16, int8, int8-weights, int4-weights, palettize6, "
            "palettize4, auto; "
            "did you mean 'int8'?",
        ),
        (
            "palettize4",
            "--precision 'palettize4' is not available for target 'cpu' "
            "(it builds fp32, fp16, int8, int8-weights, int4-weights, auto)",
        ),
    ],
)
def test_package_bad_precision_lists_choices(
    precision: str, message: str, keypair, tiny_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        package(
            tiny_model,
            targets="cpu",
            precision=precision,
            calib={"input": sample_inputs(4)},
            key=keypair[0],
            out_dir=tmp_path,
        )


def test_package_unknown_target_suggests_nearest(keypair, tiny_model: Path, tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=re.escape("unknown target 'cpus' (choose from cpu, intel, coral, jetson, apple); did you mean 'cpu'?"),
    ):
        package(
            tiny_model,
            targets="cpus",
            precision="int8",
            calib={"input": sample_inputs(4)},
            key=keypair[0],
            out_dir=tmp_path,
        )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"cpu": {"activation": "uint8"}}, "targets.cpu.activation: unknown option (known: "),
        ({"cpu": {"max_candidates": "many"}}, "targets.cpu.max_candidates: expected an integer, got 'many'"),
        ({"cpu": {"activations": "int4"}}, "targets.cpu.activations: 'int4' is not one of 'auto', 'uint8', 'int8'"),
        ({"cpu": {"max_candidates": 0}}, "targets.cpu: max_candidates must be >= 1, got 0"),
        ({"intel": {"device": "GPU"}}, "targets.intel: options given for a target not being packaged (packaging: cpu)"),
    ],
)
def test_package_bad_target_options_name_their_path(
    options, message: str, keypair, tiny_model: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        package(
            tiny_model,
            targets="cpu",
            precision="int8",
            calib={"input": sample_inputs(4)},
            key=keypair[0],
            out_dir=tmp_path,
            options=options,
        )


def test_package_int8_weights_without_matmul_refused(keypair, tmp_path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.ones((2, 3, 3, 3), np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="conv")],
        "conv_only",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3, 8, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2, 6, 6])],
        [w],
    )
    model = tmp_path / "conv.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), str(model))
    with pytest.raises(
        UnsupportedOpError, match=r"int8-weights quantizes MatMul/Gemm weights, .* \(ops: Conv\); use --precision int8"
    ):
        package(
            model,
            targets="cpu",
            precision="int8-weights",
            calib={"x": np.ones((4, 3, 8, 8), np.float32)},
            key=keypair[0],
            out_dir=tmp_path,
        )


def test_package_other_bad_arguments(keypair, tiny_model: Path, tmp_path: Path) -> None:
    kw = {"calib": {"input": sample_inputs(10)}, "out_dir": tmp_path}
    with pytest.raises(ConfigError, match="a signing key is required"):
        package(tiny_model, targets="cpu", precision="fp32", **kw)
    with pytest.raises(ConfigError, match="does not exist; make one with `edgekit keygen`"):
        package(tiny_model, targets="cpu", precision="fp32", key=tmp_path / "none.key", **kw)
    with pytest.raises(ConfigError, match="--version must be an integer >= 1, got 0"):
        package(tiny_model, targets="cpu", precision="fp32", key=keypair[0], version=0, **kw)
    with pytest.raises(ConfigError, match="--name 'a b'"):
        package(tiny_model, targets="cpu", precision="fp32", key=keypair[0], name="a b", **kw)
    with pytest.raises(ConfigError, match="is in the past"):
        package(
            tiny_model,
            targets="cpu",
            precision="fp32",
            key=keypair[0],
            expires=datetime(2020, 1, 1, tzinfo=timezone.utc),
            **kw,
        )
    with pytest.raises(ConfigError, match=r"tolerance.min_cosin: unknown key .*did you mean 'min_cosine'"):
        package(tiny_model, targets="cpu", precision="fp32", key=keypair[0], tolerance={"min_cosin": 0.9}, **kw)
    with pytest.raises(
        ConfigError, match="--input-shape image=1x3x16x16: the model has no input 'image' \\(inputs: input\\)"
    ):
        package(
            tiny_model, targets="cpu", precision="fp32", key=keypair[0], input_shapes={"image": (1, 3, 16, 16)}, **kw
        )
    with pytest.raises(CalibrationDataError, match="int8 needs calibration data"):
        package(tiny_model, targets="cpu", precision="int8", key=keypair[0], out_dir=tmp_path)


def test_package_existing_bundle_refused_unless_overwrite(keypair, tiny_model: Path, tmp_path: Path) -> None:
    kw = {"calib": {"input": sample_inputs(10)}, "key": keypair[0], "name": "m", "out_dir": tmp_path}
    first = package(tiny_model, targets="cpu", precision="fp32", **kw).bundles["cpu"]
    with pytest.raises(ConfigError, match=r"m-cpu-v1.ekb already exists; publish a higher --version"):
        package(tiny_model, targets="cpu", precision="fp32", **kw)
    assert package(tiny_model, targets="cpu", precision="fp32", overwrite=True, **kw).bundles["cpu"] == first


def test_package_expires_recorded(keypair, tiny_model: Path, tmp_path: Path) -> None:
    result = package(
        tiny_model,
        targets="cpu",
        precision="fp32",
        calib={"input": sample_inputs(10)},
        key=keypair[0],
        out_dir=tmp_path,
        expires=timedelta(days=2),
    )
    expires = datetime.fromisoformat(result.manifests["cpu"].expires.replace("Z", "+00:00"))
    assert timedelta(days=1, hours=23) < expires - datetime.now(timezone.utc) <= timedelta(days=2)


def test_package_several_targets_share_one_preparation_and_report_unmeasured(keypair, tmp_path: Path) -> None:
    # jetson's TensorRT artifact cannot run here: it is gated through the target's intermediate.
    model = tiny_classifier(tmp_path / "m.onnx")
    lines: list[str] = []
    result = package(
        model,
        targets="cpu,jetson",
        precision="int8",
        calib={"input": confident_inputs(model, 40)},
        key=keypair[0],
        name="m",
        out_dir=tmp_path,
        progress=lines.append,
    )
    assert lines.count("preparing m.onnx") == 1
    assert sorted(result.bundles) == ["cpu", "jetson"] and [r.target for r in result.rows] == ["cpu", "jetson"]
    jetson = result.manifests["jetson"]
    v = jetson.validation
    assert v.measured_on.startswith("intermediate (") and v.latency_p50_ms is None
    assert jetson.signature.inputs[0].shape == (1, 3, 16, 16) and jetson.signature.outputs[0].shape == (1, 10)
    g = jetson.golden
    assert (g.count, g.min_cosine, g.min_top1_agreement) == (4, 0.96, 0.98)  # 4 batches of the static batch 1
    row = result.table().splitlines()[3]
    assert row.startswith("jetson ") and row.count("not measured here") == 2
    assert result.manifests["cpu"].signature.inputs[0].shape == ("batch", 3, 16, 16)


def test_package_frozen_bundle_serves_the_concrete_output_shapes_the_artifact_produces(keypair, tmp_path) -> None:
    # a YOLOv8-style head [batch, 4 + classes, anchors]: "anchors" is no input's dim, yet frozen at
    # 64x64 the artifact always gives 84 anchors; the served signature (and v2 metadata) says so
    from tests.factories import tiny_yolo

    model = tiny_yolo(tmp_path / "yolo.onnx")
    result = package(
        model,
        targets="jetson",
        precision="fp32",
        calib={"images": sample_inputs(10, size=64)},
        key=keypair[0],
        out_dir=tmp_path / "o",
    )
    m = result.manifests["jetson"]
    assert m.signature.inputs[0].shape == (1, 3, 64, 64)
    assert m.signature.outputs[0].shape == (1, 7, 84) and m.signature.outputs[0].v2_shape == [1, 7, 84]


def test_package_size_ratio_counts_the_source_models_external_data(keypair, tmp_path: Path) -> None:
    # A model saved with external data is a small .onnx plus a data file; the fp32 baseline is both.
    import onnx

    model = tmp_path / "ext.onnx"
    onnx.save(
        onnx.load(str(tiny_classifier(tmp_path / "m.onnx"))),
        str(model),
        save_as_external_data=True,
        location="ext.data",
        size_threshold=0,
    )
    assert (tmp_path / "ext.data").stat().st_size > 4 * model.stat().st_size
    result = package(
        model,
        targets="cpu",
        precision="fp32",
        calib={"input": confident_inputs(model, 20)},
        key=keypair[0],
        out_dir=tmp_path / "o",
    )
    ratio = result.manifests["cpu"].validation.size_ratio
    assert ratio is not None and 0.8 < ratio < 1.3


def test_package_static_batch_validates_an_evaluation_set_it_does_not_divide(keypair, tmp_path: Path) -> None:
    # --input-shape fixes batch 4; 35 samples leave 7 held out: the last batch is padded, not fed short.
    pytest.importorskip("coremltools")
    model = tiny_classifier(tmp_path / "m.onnx")
    result = package(
        model,
        targets="apple",
        precision="fp16",
        calib={"input": confident_inputs(model, 35)},
        key=keypair[0],
        out_dir=tmp_path,
        input_shapes={"input": (4, 3, 16, 16)},
        options={"apple": {"weight_threshold": 0}},
    )
    m = result.manifests["apple"]
    assert m.validation.samples == 7 and m.validation.passed
    assert m.signature.inputs[0].shape == (4, 3, 16, 16) and m.golden.count == 4


def test_package_static_target_refuses_evaluation_data_of_another_shape(keypair, tmp_path: Path) -> None:
    # Static shapes come from the calibration data (20x20); evaluation samples at 24x24 cannot be fed.
    model = tiny_classifier(tmp_path / "dyn.onnx", dynamic_size=True)
    lines: list[str] = []
    with pytest.raises(ConfigError, match=r"input 'input' has samples of shape \[3, 24, 24\].*\[1, 3, 20, 20\]"):
        package(
            model,
            targets="jetson",
            precision="fp32",
            calib={"input": sample_inputs(10, size=20)},
            eval={"input": sample_inputs(5, size=24)},
            key=keypair[0],
            out_dir=tmp_path,
            progress=lines.append,
        )
    assert not any("building" in line for line in lines), "refused only after converting"


def test_package_golden_vectors_for_an_intermediate_skip_samples_it_disagreed_on(tmp_path: Path) -> None:
    # Golden outputs for an artifact that cannot run here are FP32's; the device must match their top-1,
    # so a sample the validated intermediate got wrong must not be one of them.
    from edgekit.bundle.manifest import Signature, TensorSpec, Tolerance
    from edgekit.packaging.gate import write_golden
    from edgekit.packaging.shared import GOLDEN_FILE, SharedRun
    from edgekit.validate.metrics import compare

    served = Signature(inputs=(TensorSpec("x", "float32", (1, 2)),), outputs=(TensorSpec("p", "float32", (1, 2)),))
    x = np.arange(12, dtype=np.float32).reshape(6, 2)
    reference = {"p": np.tile(np.array([[0.9, 0.1]], np.float32), (6, 1))}
    measured = {"p": reference["p"].copy()}
    measured["p"][0] = [0.1, 0.9]  # the intermediate disagrees with FP32 on sample 0 only
    tol = Tolerance(min_top1_agreement=0.8)
    run = SharedRun(served, "classifier", tol, {"x": x}, {"x": x}, None, reference, lambda f: f, 1, (), print)
    golden = write_golden(tmp_path, run, served, None, compare(reference, measured, "classifier", tol), measured)
    assert golden.count == 4 and golden.min_top1_agreement == 0.8  # 4 batches of the static batch 1
    with np.load(tmp_path / GOLDEN_FILE) as saved:
        np.testing.assert_array_equal(saved["in_x"], x[1:5])  # sample 0 is not among them


class UncheckableTarget:
    """A coral stand-in whose candidates raise ``ValidationFailedError``, as apple's W8A8 does on a real
    MobileNetV3 (its activation quantization ops do not line up with the torch intermediate's)."""

    name = "coral"
    runtime = "litert"
    precisions = ("fp32",)
    Options = type("Options", (), {})
    static_shapes = False

    def check_model(self, model_path: Path) -> None:
        pass

    def candidates(self, ctx: object) -> object:
        raise ValidationFailedError("the package's numerics cannot be checked here: use --precision int8-weights")


def test_package_target_that_cannot_be_validated_fails_alone_and_the_others_ship(
    keypair, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from edgekit import targets

    monkeypatch.setitem(targets.TARGETS, "coral", f"{__name__}:UncheckableTarget")
    with pytest.raises(PackageValidationError) as exc:
        package(
            tiny_model,
            targets=["cpu", "coral"],
            precision="fp32",
            eval={"input": sample_inputs(8)},
            key=keypair[0],
            name="m",
            out_dir=tmp_path,
        )
    assert str(exc.value) == "coral fp32: the package's numerics cannot be checked here: use --precision int8-weights"
    assert exc.value.exit_code == 3
    result = exc.value.result
    assert [r.target for r in result.rows] == ["cpu"] and result.rows[0].passed
    assert set(result.bundles) == {"cpu"} and result.bundles["cpu"].exists()
    assert result.errors == {"coral": str(exc.value).removeprefix("coral fp32: ")} and not result.passed
    assert result.to_dict()["errors"] == result.errors
