"""``edgekit.compress.tflite_quant``: ops kept in float (the MLIR quantizer's denylist) on a real
onnx2tf conversion of a tiny YOLOv8-style head whose sigmoid scores are tiny. Marked ``slow``:
TensorFlow and onnx2tf take tens of seconds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from edgekit.validate.metrics import worst_channel
from tests.optimize.models import served_coral

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def score_head(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object, bytes]:
    """tests.optimize.models.tiny_score_head, its float conversion and its calibrated model."""
    from edgekit.compress.onnx2tflite import to_float
    from edgekit.compress.tflite_quant import calibrate
    from tests.optimize.models import tiny_score_head

    folder = tmp_path_factory.mktemp("score-head")
    model = tiny_score_head(folder / "head.onnx")
    calib = {"x": np.random.default_rng(2).standard_normal((64, 4, 8, 8)).astype(np.float32)}
    conversion = to_float(model, folder, {"x": (1, 4, 8, 8)}, ["y"], calib, 64)
    return model, conversion, calibrate(conversion)


def _score_cosine(want: np.ndarray, got: np.ndarray) -> float:
    """The worst cosine over the score channels (2-4) of [N, 5, 128]."""
    a = want[:, 2:].transpose(1, 0, 2).reshape(3, -1).astype(np.float64)
    b = got[:, 2:].transpose(1, 0, 2).reshape(3, -1).astype(np.float64)
    cos = (a * b).sum(1) / np.maximum(np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1), 1e-30)
    return float(cos.min())


def test_quantize_calibrated_denylisted_sigmoid_and_concat_keep_tiny_scores_in_float(
    score_head: tuple[Path, object, bytes],
) -> None:
    from edgekit.compress.tflite_quant import QuantVariant, op_outputs, output_names, quantize_calibrated

    model, conversion, calibrated = score_head
    x = np.random.default_rng(7).standard_normal((16, 4, 8, 8)).astype(np.float32)
    want = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    assert 0 < want[:, 2:].max() < 1e-3  # the scores are far below LOGISTIC's int8 step (1/256)

    plain = quantize_calibrated(calibrated, QuantVariant())
    # int8: the score channels crushed (all below 1e-3 beside boxes in pixels, so the gate's worst
    # live channel skips them as never firing; their own cosine shows the damage)
    assert _score_cosine(want, served_coral(conversion, plain, x, (1, 5, 128))) < 0.5

    ops = op_outputs(plain)
    sigmoid = next(out for kind, out, _ in ops if kind == "LOGISTIC")
    (concat,) = output_names(plain)
    assert any(kind == "CONCATENATION" and out == concat for kind, out, _ in ops)
    kept = quantize_calibrated(calibrated, QuantVariant(denylisted=(sigmoid, concat)))
    got = served_coral(conversion, kept, x, (1, 5, 128))
    assert _score_cosine(want, got) > 0.99  # was 0.00: the scores still went through 1/256
    kept_worst = worst_channel(want, got)
    assert kept_worst is not None and kept_worst[0] > 0.99
    # the float sigmoid feeds the float Concat directly: no QUANTIZE (1/256) -> DEQUANTIZE between
    assert [kind for kind, _, ins in op_outputs(kept) if sigmoid in ins] == ["CONCATENATION"]
