"""coral ``auto`` when no int8 layout meets the gate: the float32 TFLite fallback ships as fp32
(LiteRT CPU), passes the gate, and the litert runtime serves it; never an int8 label on a float
artifact, never a failed run when a float artifact would pass. Before, a MobileNetV3 whose held-out
decisions were too close for int8 left coral with no bundle (release check: 0.875-0.94)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnxruntime as ort

import edgekit
from device_agents.runtimes import load_model
from device_agents.runtimes.options import LiteRtOptions
from edgekit.bundle.manifest import Manifest
from edgekit.optimize.flip_risk import top1_margins
from edgekit.targets.coral import FLOAT_FALLBACK
from tests.optimize.models import mobilenet_v3_block
from tests.targets.conftest import no_network


def _scores(model: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return np.concatenate([session.run(None, {"input": x[i : i + 8]})[0] for i in range(0, len(x), 8)])


def test_coral_auto_ships_the_float_fallback_when_no_int8_meets_the_classifier_gate(
    keypair: tuple[Path, Path], open_bundle: Callable[[Path], tuple[Path, Manifest]], tmp_path: Path
) -> None:
    model = mobilenet_v3_block(tmp_path / "mnv3.onnx", size=32)
    x = np.random.default_rng(5).standard_normal((600, 3, 32, 32)).astype(np.float32)
    margins = top1_margins(_scores(model, x))
    order = np.argsort(margins)
    calib = x[order[-96:]]  # confident samples, like training data
    held = x[order[:48]]  # decisions close to the boundary, like held-out data
    with no_network():
        result = edgekit.package(
            model, targets=["coral"], precision="auto", calib={"input": calib}, eval={"input": held},
            key=keypair[0], out_dir=tmp_path / "out",
        )  # fmt: skip
    model_dir, manifest = open_bundle(result.bundles["coral"])
    assert manifest.validation.passed and manifest.precision.label == "w32a32"
    assert manifest.precision.method.startswith("onnx2tf float32 TFLite, not quantized")
    assert any(
        n.startswith("float32 fallback: no int8 candidate met the accuracy budget") for n in manifest.validation.notes
    )
    report = manifest.candidates
    assert report is not None and report.chosen == FLOAT_FALLBACK
    rows = {c.id: c for c in report.candidates}
    int8 = [c for c in rows.values() if c.settings.get("activations") == "int8" and c.status != "skipped"]
    assert int8 and all(c.status == "failed" for c in int8)
    (art_in,), (art_out,) = manifest.artifact_signature.inputs, manifest.artifact_signature.outputs
    assert art_in.dtype == art_out.dtype == "float32" and art_in.quant is None and art_out.quant is None
    served = load_model(model_dir, manifest, LiteRtOptions(threads=1))
    try:
        got = np.concatenate([served.infer({"input": held[i : i + 1]})["probs"] for i in range(len(held))])
    finally:
        served.close()
    assert np.mean(got.argmax(1) == _scores(model, held).argmax(1)) >= 0.98
