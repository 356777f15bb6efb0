"""The optimisation engine end to end through ``edgekit.package``: failed candidates are recorded,
mixed precision rescues an INT8 model that misses the gate, NNCF gets the original graph."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from edgekit.packaging.result import PackageValidationError
from tests.factories import package_small_data as package
from tests.optimize.models import confident, mobilenet_v3_block, outlier_mlp, token_classifier

ORT_ONLY = {"quant_format": "qdq", "activations": "uint8", "per_channel": "on"}


def _report(result, target: str = "cpu") -> dict:
    return json.loads(result.reports[target].with_name(result.reports[target].name.replace(".md", ".json")).read_text())


def test_engine_mixed_precision_rescues_int8_that_misses_the_dense_gate(keypair, tmp_path: Path) -> None:
    model = outlier_mlp(tmp_path / "outlier.onnx")
    x = np.random.default_rng(1).standard_normal((80, 16)).astype(np.float32)
    result = package(
        model, targets=["cpu"], precision="int8", calib={"x": x}, key=keypair[0], out_dir=tmp_path / "out",
        options={"cpu": ORT_ONLY}, mixed_precision=True,
    )  # fmt: skip
    m = result.manifests["cpu"]
    assert m.validation.passed and m.precision.method.endswith("layer(s) in float")
    report = _report(result)
    plain = next(c for c in report["candidates"] if c["name"] == "ort-static qdq u8s8 per-channel minmax")
    assert plain["status"] == "failed" and "cosine" in plain["reason"]
    chosen = next(c for c in report["candidates"] if c["status"] == "chosen")
    # the outlier tensor sits between layer_a and layer_b: both stay float, layer_c stays int8
    assert chosen["excluded_nodes"] == ["layer_b", "layer_a"]
    assert m.precision.excluded_nodes == ("layer_b", "layer_a") and "sensitivity" in m.precision.excluded_reason
    assert m.candidates is not None and m.candidates.chosen == chosen["name"]
    assert (
        m.calibration is not None and m.calibration.samples == 64 and len(m.calibration.sha256) == 64
    )  # a third held out
    assert any(n.startswith("layer sensitivity (most sensitive first): layer_b+layer_a") for n in report["notes"])
    # a miss on cosine / relative error: the local ranking measures that error already, nothing is rebuilt
    assert not any(n.startswith("layers ranked by ") for n in report["notes"])


def test_engine_plain_int8_never_keeps_layers_in_float(keypair, tmp_path: Path) -> None:
    model = outlier_mlp(tmp_path / "outlier.onnx")
    x = np.random.default_rng(1).standard_normal((80, 16)).astype(np.float32)
    with pytest.raises(PackageValidationError) as info:
        package(model, targets=["cpu"], precision="int8", calib={"x": x}, key=keypair[0], out_dir=tmp_path / "out",
                options={"cpu": ORT_ONLY})  # fmt: skip
    assert info.value.result.bundles == {}
    report = _report(info.value.result)
    assert all(not c["excluded_nodes"] for c in report["candidates"])
    # chosen (for the gate to report) is the most accurate of those that missed the budget
    assert {c["name"] for c in report["candidates"] if "cosine" in c["reason"]} == {
        "ort-static qdq u8s8 per-channel minmax",
        "ort-static qdq u8s8 per-channel percentile 99.999",
        "ort-static qdq u8s8 per-channel entropy",
    }


def test_engine_int32_input_model_records_the_raising_ort_candidate_and_ships_another(keypair, tmp_path: Path) -> None:
    model = token_classifier(tmp_path / "tokens.onnx")
    tokens = np.random.default_rng(2).integers(0, 256, (400, 16)).astype(np.int32)
    calib = confident(model, tokens, 60, margin=0.1)
    result = package(
        model, targets=["cpu"], precision="auto", calib={"tokens": calib}, key=keypair[0], out_dir=tmp_path / "out",
        options={"cpu": {"openvino": False}},
    )  # fmt: skip
    m = result.manifests["cpu"]
    assert m.validation.passed and result.bundles["cpu"].is_file()
    report = _report(result)
    by_name = {c["name"]: c for c in report["candidates"]}
    raised = by_name["ort-static qdq u8s8 per-channel minmax"]
    assert raised["status"] == "error" and raised["reason"].startswith("ValueError: The truth value of an array")
    assert by_name[report["chosen"]]["status"] == "chosen"
    recorded = {c.id: c for c in m.candidates.candidates}  # the same record, in the signed manifest
    assert recorded["ort-static qdq u8s8 per-channel minmax"].status == "error"
    assert recorded["ort-static qdq u8s8 per-channel minmax"].reason == raised["reason"]
    assert m.validation.latency_p90_ms is not None and m.validation.latency_iqr_ms is not None
    assert m.validation.slower_than_fp32 is not None
    assert any(
        n.startswith("tried ort-static qdq u8s8 per-channel minmax: (failed: ValueError") for n in m.validation.notes
    )


@pytest.mark.slow  # three NNCF builds, one with accuracy control: about a minute on a busy 2-core host
def test_engine_mobilenet_v3_style_graph_gets_intel_int8_within_the_gate(keypair, tmp_path: Path) -> None:
    model = mobilenet_v3_block(tmp_path / "mnv3.onnx")
    rng = np.random.default_rng(3)
    # noise around a per-sample colour: what global pooling keeps apart
    x = (rng.standard_normal((3000, 3, 32, 32)) + 2 * rng.standard_normal((3000, 3, 1, 1))).astype(np.float32)
    data = confident(model, x, 200, margin=0.5)
    result = package(
        model,
        targets=["intel"],
        precision="int8",
        calib={"input": data[:100]},
        eval={"input": data[100:]},
        key=keypair[0],
        out_dir=tmp_path / "out",
    )
    m = result.manifests["intel"]
    assert m.validation.passed and m.validation.samples == 100 and m.validation.top1_agreement == 1.0
    assert m.precision.method.startswith("nncf ") and m.compatibility.runtime == "openvino"
    report = _report(result, "intel")
    assert report["candidates"][0]["name"] == "openvino fp32 ir" and report["candidates"][0]["baseline"]
    # NNCF's defaults miss the gate on this graph; its accuracy-control refinement meets it
    statuses = {c["name"]: c["status"] for c in report["candidates"]}
    assert statuses["nncf int8 preset=performance bias_correction=fast"] == "failed"
    assert statuses["nncf int8 preset=performance bias_correction=fast accuracy-control"] == "chosen"


def test_engine_table_prints_the_ratio_to_the_targets_own_fp32_that_decides(keypair, tmp_path: Path) -> None:
    # intel's FP32 is OpenVINO FP32 IR, another measurement than the table's ONNX Runtime FP32:
    # the table prints both, from the one final round the choice used
    from edgekit.validate.table import format_table
    from tests.factories import confident_inputs, tiny_classifier

    model = tiny_classifier(tmp_path / "tiny.onnx")
    x = confident_inputs(model, 40)
    result = package(
        model, targets=["intel"], precision="fp16", calib={"input": x}, key=keypair[0], out_dir=tmp_path / "out"
    )
    m = result.manifests["intel"]
    assert m.candidates is not None
    rows = {c.id: c for c in m.candidates.candidates}
    chosen, base = rows[m.candidates.chosen], rows["openvino fp32 ir"]
    assert chosen.id == "openvino fp16 ir" and base.status == "passed"
    assert m.validation.latency_p50_ms == chosen.latency_p50_ms  # the p50 the choice used
    assert chosen.latency_p50_ms is not None and base.latency_p50_ms is not None
    own = base.latency_p50_ms / chosen.latency_p50_ms
    assert result.rows[0].own_fp32 == ("openvino fp32 ir", own)
    vs_source = m.validation.fp32_latency_p50_ms / m.validation.latency_p50_ms
    line = format_table(result.rows).splitlines()[2]
    assert f"  {vs_source:.2f}x ({own:.2f}x vs openvino fp32 ir)  " in line
    note = f"speed: {own:.2f}x openvino fp32 ir (the target's fp32 on openvino"
    assert any(n.startswith(note) for n in m.validation.notes)
    assert m.validation.slower_than_fp32 is (own < 1.0)


def test_engine_int8_weights_searches_dynamic_layouts_and_the_transformer_fused_graph(keypair, tmp_path: Path) -> None:
    from bench.transformer import build_encoder

    model = build_encoder(tmp_path / "encoder.onnx", seq=16, dim=32, hidden=64, blocks=2, heads=4)
    x = np.random.default_rng(4).standard_normal((40, 16, 32)).astype(np.float32)
    result = package(
        model, targets=["cpu"], precision="int8-weights", calib={"x": x}, key=keypair[0], out_dir=tmp_path / "out"
    )
    m = result.manifests["cpu"]
    assert m.validation.passed and m.precision.method.startswith("ort-dynamic MatMul/Gemm ")
    rows = {c.id: c for c in m.candidates.candidates}
    fused = rows["ort dynamic int8 transformer-fused"]
    # residual + LayerNorm and bias + GELU: what ORT's transformer optimizer fuses
    assert fused.status in ("passed", "chosen") and "SkipLayerNormalization" in fused.settings["fused"]
    assert fused.latency_p50_ms is not None
    assert rows["ort dynamic int8 per-channel"].settings["per_channel"] == "True"
    fused_pc = rows["ort dynamic int8 transformer-fused per-channel"]  # the fused form in both layouts
    assert fused_pc.settings["per_channel"] == "True" and "Attention" in fused_pc.settings["fused"]
    assert fused_pc.status in ("passed", "chosen") and fused_pc.latency_p50_ms is not None
    assert rows["ort dynamic int8 (MatMul/Gemm weights)"].status in ("passed", "chosen")
    seven_bit = rows["ort dynamic int8 reduce-range"]  # a refinement: built only for a layout that missed
    assert (seven_bit.status, seven_bit.reason) == (
        "skipped",
        "ort dynamic int8 (MatMul/Gemm weights) is already within the budget",
    )
    assert m.provenance[-1].settings["candidate"] == m.candidates.chosen


def test_engine_int8_weights_says_why_there_is_no_transformer_fused_candidate(keypair, tmp_path: Path) -> None:
    model = outlier_mlp(tmp_path / "mlp.onnx")  # MatMul + Relu only: nothing for the optimizer to fuse
    x = np.random.default_rng(1).standard_normal((80, 16)).astype(np.float32)
    result = package(
        model,
        targets=["cpu"],
        precision="int8-weights",
        calib={"x": x},
        key=keypair[0],
        out_dir=tmp_path / "out",
        allow_failed=True,
    )
    rows = {c.id: c for c in result.manifests["cpu"].candidates.candidates}
    assert rows["ort dynamic int8 transformer-fused"].status == "skipped"
    assert rows["ort dynamic int8 transformer-fused"].reason == (
        "onnxruntime's transformer optimizer fused nothing (no attention / LayerNorm / GELU)"
    )


def test_engine_int4_weights_measures_float_and_int8_compute_accuracy_levels(keypair, tmp_path: Path) -> None:
    from bench.transformer import build_encoder

    model = build_encoder(tmp_path / "encoder.onnx", seq=16, dim=64, hidden=128, blocks=1, heads=4)
    x = np.random.default_rng(5).standard_normal((40, 16, 64)).astype(np.float32)
    result = package(
        model,
        targets=["cpu"],
        precision="int4-weights",
        calib={"x": x},
        key=keypair[0],
        out_dir=tmp_path / "out",
        allow_failed=True,
    )
    m = result.manifests["cpu"]
    rows = {c.id: c for c in m.candidates.candidates}
    level4 = rows["ort MatMulNBits int4 block 32 accuracy-level 4"]
    assert level4.settings["accuracy_level"] == "4" and level4.status != "error"
    assert rows["ort MatMulNBits int4 block 32"].status != "error"
    assert m.candidates.chosen in rows and m.precision.weights == "int4"


def test_engine_never_ships_int8_whose_one_scale_crushed_the_small_channels(keypair, tmp_path: Path) -> None:
    from tests.optimize.models import mixed_scale_head

    model = mixed_scale_head(tmp_path / "head.onnx")
    x = np.random.default_rng(2).standard_normal((80, 4, 8, 8)).astype(np.float32)
    with pytest.raises(PackageValidationError) as info:
        package(model, targets=["cpu"], precision="int8", calib={"x": x}, key=keypair[0], out_dir=tmp_path / "plain",
                options={"cpu": ORT_ONLY})  # fmt: skip
    report = _report(info.value.result)
    # every static INT8 candidate missed on the channel gate (the most accurate is "chosen" to report it)
    static = [c for c in report["candidates"] if c["name"].startswith("ort-static") and c["status"] != "skipped"]
    assert static and all(c["cosine"] > 0.96 for c in static)  # the global gate alone would have shipped them
    assert all("crushed the small ones" in c["reason"] for c in static if c["status"] == "failed")
    assert "channel 2 cosine 0.00 (< 0.9)" in str(info.value)
    result = package(
        model, targets=["cpu"], precision="auto", calib={"x": x}, key=keypair[0], out_dir=tmp_path / "auto"
    )
    m = result.manifests["cpu"]
    assert m.validation.passed and m.validation.channel_cosine is not None and m.validation.channel_cosine >= 0.9


def test_engine_mixed_precision_keeps_the_concat_that_crushed_the_scores_in_float_with_its_tail(
    keypair, tmp_path: Path
) -> None:
    from tests.optimize.models import mixed_scale_head

    model = mixed_scale_head(tmp_path / "head.onnx")
    x = np.random.default_rng(2).standard_normal((80, 4, 8, 8)).astype(np.float32)
    result = package(model, targets=["cpu"], precision="int8", calib={"x": x}, key=keypair[0], out_dir=tmp_path / "out",
                     options={"cpu": ORT_ONLY}, mixed_precision=True)  # fmt: skip
    m = result.manifests["cpu"]
    report = _report(result)
    plain = next(c for c in report["candidates"] if c["name"] == "ort-static qdq u8s8 per-channel minmax")
    assert plain["status"] == "failed" and "crushed the small ones" in plain["reason"]
    # percentile / entropy move the one output range; they cannot split it: not built, mixed precision instead
    refined = [c for c in report["candidates"] if c["name"].startswith("ort-static qdq u8s8 per-channel ")
               and c["name"] != plain["name"] and "in float" not in c["name"]]  # fmt: skip
    assert refined and all(c["status"] == "skipped" and "does not split it" in c["reason"] for c in refined)
    chosen = next(c for c in report["candidates"] if c["status"] == "chosen")
    # the Concat and the Reshape after it (ORT would requantize the joined tensor there); both convs stay int8
    assert chosen["excluded_nodes"] == ["head_concat", "as_anchors"]
    ranked = "layer sensitivity (most sensitive first): head_concat+as_anchors"
    assert any(n.startswith(ranked) for n in report["notes"])
    assert m.validation.passed and m.precision.weights == "int8"
    assert m.validation.channel_cosine is not None and m.validation.channel_cosine > 0.99
