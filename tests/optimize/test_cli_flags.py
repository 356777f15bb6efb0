"""``edgekit package --precision auto`` with the engine's flags, as a user types it."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

from edgekit.bundle import TrustStore, read_verified_manifest
from edgekit.cli import main
from tests.factories import confident_inputs, tiny_classifier


def test_cli_package_auto_with_max_drop_objective_and_calib_samples(tmp_path: Path, capsys) -> None:
    model = tiny_classifier(tmp_path / "tiny.onnx")
    x = confident_inputs(model, 60)
    labels = ort.InferenceSession(str(model)).run(None, {"input": x[40:]})[0].argmax(1)
    np.savez(tmp_path / "calib.npz", input=x[:40])
    np.savez(tmp_path / "eval.npz", input=x[40:], labels=labels)
    assert main(["keygen", "--out", str(tmp_path / "keys"), "--name", "k"]) == 0
    capsys.readouterr()
    code = main([
        "package", str(model), "--target", "cpu", "--precision", "auto", "--calib", str(tmp_path / "calib.npz"),
        "--eval", str(tmp_path / "eval.npz"), "--key", str(tmp_path / "keys" / "k.key"), "--name", "m",
        "--version", "1", "-o", str(tmp_path / "out"), "-q", "--json", "--option", "cpu.openvino=false",
        "--max-drop", "0.05", "--objective", "size", "--calib-samples", "24",
    ])  # fmt: skip
    doc = json.loads(capsys.readouterr().out)
    assert code == 0 and doc["passed"]
    assert doc["rows"][0]["validation"]["tolerance"]["max_top1_drop"] == 0.05
    m = read_verified_manifest(Path(doc["bundles"]["cpu"]), TrustStore.from_files([tmp_path / "keys" / "k.pub"]))
    assert m.manifest.candidates is not None and m.manifest.candidates.objective == "size"
    assert m.manifest.calibration is not None and m.manifest.calibration.samples == 24
    report = json.loads((tmp_path / "out" / "m-cpu-v1.report.json").read_text())
    assert report["objective"] == "size" and report["chosen"] == m.manifest.candidates.chosen
