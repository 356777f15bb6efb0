"""A detector judged by its detections after the bundle's post-processing (``validate.detections``):
a candidate that keeps every detection passes though a class channel's cosine is poor (noise
below the score threshold), one whose class scores were crushed fails."""

from __future__ import annotations

import numpy as np

from device_agents.processing.post import Postprocessor
from edgekit.bundle.manifest import Signature, TensorSpec, Tolerance
from edgekit.validate.metrics import compare
from edgekit.validate.postprocess import Postprocess

SERVED = Signature(
    inputs=(TensorSpec("images", "float32", ("n", 3, 320, 320)),), outputs=(TensorSpec("y", "float32", ("n", 7, 400)),)
)


def _outputs(seed: int = 0) -> np.ndarray:
    """[8, 4 + 3, 400]: boxes (cx, cy, w, h in pixels) and 3 class scores per anchor; two anchors
    per sample fire (0.9), every other score is ~1e-3."""
    rng = np.random.default_rng(seed)
    y = np.zeros((8, 7, 400), np.float32)
    y[:, 0:2] = rng.uniform(40, 280, (8, 2, 400))
    y[:, 2:4] = rng.uniform(20, 40, (8, 2, 400))
    y[:, 4:] = rng.uniform(0, 1e-3, (8, 3, 400))
    for i in range(8):
        y[i, 4 + i % 3, [10, 200]] = 0.9
    return y


def _post(y: np.ndarray) -> Postprocessor:
    steps = Postprocess.parse("boxes=yolo,score=0.25,iou=0.45").to_steps(SERVED, None, {"y": y[:1]})
    return Postprocessor(steps, SERVED.outputs, lambda _path: b"")


def test_compare_passes_a_detector_that_keeps_every_detection_though_a_channel_cosine_is_poor() -> None:
    ref = _outputs()
    cand = ref.copy()
    cand[:, :4] += np.random.default_rng(1).normal(0, 0.5, cand[:, :4].shape)  # boxes half a pixel off
    cand[:, 4] += np.random.default_rng(2).uniform(0, 0.2, cand[:, 4].shape).astype(np.float32)  # noise < 0.25
    plain = compare({"y": ref}, {"y": cand}, "dense", Tolerance())
    assert not plain.passed and plain.channel_cosine is not None and plain.channel_cosine < 0.9  # the channel vetoes
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance(), post=_post(ref))
    assert got.passed, got.failures
    assert got.detections is not None and got.detections.startswith("detections F1 1.000 vs fp32 (16 of 16 fp32")


def test_compare_fails_a_detector_whose_class_scores_were_crushed() -> None:
    ref = _outputs()
    cand = ref.copy()
    cand[:, 4:] = 0.0  # every score rounded to 0: no detection left
    got = compare({"y": ref}, {"y": cand}, "dense", Tolerance(min_channel_cosine=None), post=_post(ref))
    assert not got.passed
    assert any(f.startswith("detections F1 0.000 vs fp32 (0 of 16 fp32 detections matched") for f in got.failures)


def test_package_gates_a_detector_with_boxes_post_processing_on_its_detections(keypair, tmp_path) -> None:
    from examples.detector import colour_detector
    from tests.factories import package_small_data as package

    model = colour_detector(tmp_path / "det.onnx")
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 1, (40, 3, 64, 64)).astype(np.float32)
    images[:, 0, 8:32, 8:32] = 1.0  # a red square in every image: something to detect
    result = package(
        model,
        targets=["cpu"],
        precision="auto",
        calib={"images": images[:30]},
        eval={"images": images[30:]},
        key=keypair[0],
        name="det",
        out_dir=tmp_path / "out",
        postprocess="boxes=yolo,score=0.25,iou=0.45",
        options={"cpu": {"openvino": False}},
    )
    v = result.manifests["cpu"].validation
    assert v.passed, v.failures
    assert any(
        n.startswith("gate: output 'output0' judged by its detections after the post-processing") for n in v.notes
    )
    (held,) = [n for n in v.notes if n.startswith("held-out detections F1 ")]
    matched, total = held.split("(")[1].split(" fp32 detections")[0].split(" of ")
    assert int(total) > 0 and int(matched) >= 0.95 * int(total)
    # on these noisy images int8 moves near-threshold scores across 0.25: its detections differ
    rows = {c.id: c for c in result.manifests["cpu"].candidates.candidates}
    assert any("detections F1" in c.reason and c.status == "failed" for c in rows.values())
