"""The device-profile round trip: ``package --keep-candidates`` writes the candidates, ``bench
--profile`` times them with the device runtime, ``package --device-profile`` chooses by those
latencies; a profile for another model or another target is refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from edgekit.cli import main
from edgekit.errors import ConfigError
from tests.factories import confident_inputs, tiny_classifier
from tests.factories import package_small_data as package

CPU = {"cpu": {"openvino": False, "activations": "uint8"}}  # three ORT INT8 layouts, no OpenVINO


@pytest.fixture(scope="module")
def kept(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]) -> dict:
    """The tiny classifier packaged for cpu int8 with its candidates kept, and their profile timed
    here through ``edgekit bench --profile`` (ONNX Runtime is the cpu target's device runtime)."""
    root = tmp_path_factory.mktemp("profile")
    model = tiny_classifier(root / "tiny.onnx")
    calib = {"input": confident_inputs(model, 60)}
    result = package(
        model,
        targets=["cpu"],
        precision="int8",
        calib=calib,
        key=keypair[0],
        name="tiny",
        out_dir=root / "out",
        options=CPU,
        keep_candidates=root / "kept",
    )
    profile = root / "profile.json"
    argv = ["bench", "--profile", str(root / "kept"), "--out", str(profile), "--warmup", "1", "--repeats", "10"]
    assert main([*argv, "--budget-s", "0.3"]) == 0
    return {"root": root, "model": model, "calib": calib, "result": result, "profile": profile}


def _repackage(kept: dict, keypair, profile: Path, out: str, targets=("cpu",), precision="int8"):
    return package(
        kept["model"], targets=list(targets), precision=precision, calib=kept["calib"], key=keypair[0], name="tiny",
        out_dir=kept["root"] / out, options=CPU if "cpu" in targets else None, device_profile=profile,
    )  # fmt: skip


def test_keep_candidates_writes_each_passing_candidate_and_bench_profile_times_it_on_its_runtime(kept) -> None:
    index = json.loads((kept["root"] / "kept" / "candidates.json").read_text())
    m = kept["result"].manifests["cpu"]
    assert index["source_sha256"] == m.source.sha256 and index["model"] == "tiny"
    passed = {c.id for c in m.candidates.candidates if c.status in ("passed", "chosen")}
    assert {c["candidate"] for c in index["candidates"]} == passed | {"ort fp32"}
    folder = kept["root"] / "kept" / index["candidates"][1]["dir"]
    assert sorted(p.name for p in folder.iterdir()) == ["golden.npz", "manifest.json", "model.onnx"]
    assert "never install it" in json.loads((folder / "manifest.json").read_text())["validation"]["notes"][0]
    profile = json.loads(kept["profile"].read_text())
    assert profile["source_sha256"] == m.source.sha256 and "onnxruntime" in profile["measured_on"]
    assert [r["status"] for r in profile["candidates"]] == ["timed"] * len(index["candidates"])
    assert all(r["p50_ms"] > 0 and r["calls"] >= 5 for r in profile["candidates"])


def test_device_profile_changes_the_choice_to_what_the_device_measured_fastest(kept, keypair, tmp_path) -> None:
    host_choice = kept["result"].manifests["cpu"].candidates.chosen
    profile = json.loads(kept["profile"].read_text())
    others = [r for r in profile["candidates"] if r["candidate"] not in (host_choice, "ort fp32")]
    assert others, "needs a second passing int8 candidate"
    fastest = others[0]["candidate"]
    for r in profile["candidates"]:  # what a device that runs this layout fastest would have written
        r["p50_ms"], r["p90_ms"] = (0.01, 0.012) if r["candidate"] == fastest else (1.0, 1.1)
    r_path = tmp_path / "device.json"
    r_path.write_text(json.dumps(profile))
    result = _repackage(kept, keypair, r_path, "out-profiled")
    m = result.manifests["cpu"]
    assert m.candidates.chosen == fastest != host_choice
    assert m.validation.latency_p50_ms == 0.01 and m.validation.fp32_latency_p50_ms == 1.0  # the device's, both
    report = json.loads(result.reports["cpu"].with_suffix(".json").read_text())
    by_name = {c["name"]: c for c in report["candidates"]}
    assert by_name[fastest]["latency_from"].startswith("device profile device.json (")
    assert any(
        n.startswith("latency of 4 candidate(s) from the device profile device.json") for n in m.validation.notes
    )
    assert "Latency from the device profile device.json" in result.reports["cpu"].read_text()
    # the table's ratio already is to the target's own FP32 on the device: no second ratio, and
    # nothing in the report calls it ONNX Runtime FP32 on the host
    assert result.rows[0].own_fp32 is None and not any(n.startswith("speed: ") for n in m.validation.notes)
    text = result.reports["cpu"].read_text()
    assert "speed vs the target's fp32 on the device" in text and "x ORT fp32 (source)" not in text
    assert "Speed of the chosen on the device (device profile device.json" in text


def test_device_profile_for_another_model_is_refused(kept, keypair, tmp_path) -> None:
    profile = json.loads(kept["profile"].read_text())
    profile["source_sha256"] = "0" * 64
    path = tmp_path / "other.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ConfigError, match=r"was measured for model 'tiny' \(source sha256 0000000000000000\.\.\.\)"):
        _repackage(kept, keypair, path, "out-other-model")


def test_device_profile_for_another_target_is_refused(kept, keypair, tmp_path) -> None:
    profile = json.loads(kept["profile"].read_text())
    for r in profile["candidates"]:
        r["target"] = "intel"
    path = tmp_path / "intel.json"
    path.write_text(json.dumps(profile))
    with pytest.raises(ConfigError, match="has device timings for intel, not for cpu"):
        _repackage(kept, keypair, path, "out-other-target")
    path.write_text("{}")
    with pytest.raises(ConfigError, match="not a device profile"):
        _repackage(kept, keypair, path, "out-not-a-profile")


def test_jetson_device_profile_replaces_the_documented_order(kept, keypair, tmp_path) -> None:
    """TensorRT does not run here: ``bench --profile`` records why for each candidate; a profile
    from a Jetson that measured FP16 fastest makes ``auto`` ship FP16 instead of INT8 (rank 0)."""
    keep = tmp_path / "kept-jetson"
    first = package(
        kept["model"],
        targets=["jetson"],
        precision="auto",
        calib=kept["calib"],
        key=keypair[0],
        name="tiny",
        out_dir=tmp_path / "a",
        keep_candidates=keep,
    )
    assert first.manifests["jetson"].precision.weights == "int8"
    out = tmp_path / "jetson.json"
    assert main(["bench", "--profile", str(keep), "--out", str(out), "--warmup", "0", "--repeats", "1"]) == 0
    profile = json.loads(out.read_text())
    assert {r["status"] for r in profile["candidates"]} == {"error"}
    assert all("tensorrt" in r["reason"] for r in profile["candidates"])
    for r in profile["candidates"]:  # what the Jetson would have written
        fp16 = r["candidate"] == "tensorrt fp16"
        r.update(status="timed", calls=50, p50_ms=0.5 if fp16 else 2.0, p90_ms=0.6 if fp16 else 2.2)
    out.write_text(json.dumps(profile))
    result = _repackage(kept, keypair, out, "b", targets=("jetson",), precision="auto")
    m = result.manifests["jetson"]
    assert m.candidates.chosen == "tensorrt fp16" and m.candidates.latency_measured
    assert m.target_options["builder_flags"] == ["fp16"]
    assert "fastest within the budget" in next(n for n in m.candidates.notes if n.startswith("chose "))
