"""Mixed precision aimed at the measure that failed (``optimize.aimed``): where INT8 misses on a
task measure (here the decoded detections' F1), the most sensitive layer groups are re-ranked by
what keeping each alone in float does to that measure, so the rescue keeps the layer that breaks
the detections in float, not the one with the largest error of its own."""

from __future__ import annotations

from pathlib import Path

from edgekit.bundle.manifest import Tolerance
from edgekit.compress.onnx_prep import prepare_model
from edgekit.optimize.aimed import aim_of
from edgekit.optimize.run import EngineSettings, optimize
from edgekit.targets.base import BuildContext
from edgekit.targets.cpu import CpuOptions, CpuTarget
from edgekit.validate.heads import YOLO_TASK
from edgekit.validate.metrics import Comparison
from tests.optimize.models import detector_inputs, misleading_detector

ORT_ONLY = CpuOptions(quant_format="qdq", activations="uint8", per_channel="on", calibration="minmax", openvino=False)


def _context(tmp_path: Path, lines: list[str]) -> BuildContext:
    model = misleading_detector(tmp_path / "detector.onnx")
    prepared = prepare_model(model, tmp_path / "prepared")
    for folder in ("out", "work"):
        (tmp_path / folder).mkdir()
    return BuildContext(
        model_path=prepared.path, served=prepared.served, precision="int8", calib={"x": detector_inputs(24)},
        static_shapes={"x": (1, 8, 12, 16)}, out_dir=tmp_path / "out", work_dir=tmp_path / "work", options=ORT_ONLY,
        progress=lines.append, source_path=model,
    )  # fmt: skip


def test_aimed_mixed_precision_keeps_the_layer_that_breaks_the_detections_in_float(tmp_path: Path) -> None:
    lines: list[str] = []
    settings = EngineSettings(mixed_precision=True, tasks=(("output0", YOLO_TASK),), max_memory_gb=float("inf"))
    result = optimize(CpuTarget(), _context(tmp_path, lines), settings).search
    notes = result.notes
    # the local ranking puts conv_h first: INT8 crushes three of its four channels, but they only
    # nudge the boxes by 1e-5; conv_s's weights lose the small ones and every score drops under 0.25
    [local] = [n for n in notes if n.startswith("layer sensitivity (most sensitive first): ")]
    assert local.split(": ")[1].startswith("conv_h 1.41, conv_s ")
    plain = next(o for o in result.outcomes if o.name == "ort-static qdq u8s8 per-channel minmax")
    assert plain.status == "failed" and "detections F1 0.000" in plain.reason
    # measured on the gate's own measure, conv_s alone meets the budget: the ranking stops there
    [aimed] = [n for n in notes if n.startswith("layers ranked by detection F1 (")]
    assert aimed.startswith("layers ranked by detection F1 (2 groups measured, ")
    measured = "; conv_s meets the budget alone; 0 with none in float): conv_h 0, conv_s 1 (meets the budget)"
    assert aimed.endswith(measured)
    assert any(line.endswith("missed on detection F1: measuring it with each of the 4 most sensitive layer groups "
                             "kept in float") for line in lines)  # fmt: skip
    assert any("layers ranked by detection F1 (2 groups measured, " in line for line in lines)
    # one layer in float meets the budget; the local order needed conv_h and conv_s
    assert result.chosen.excluded_nodes == ("conv_s",)
    assert result.excluded_by[result.chosen.name].startswith("layers ranked by detection F1 on the selection samples")
    assert result.chosen.comparison is not None and result.chosen.comparison.passed


def test_aim_of_a_plain_cosine_or_relative_error_failure_keeps_the_local_ranking() -> None:
    t = Tolerance()
    cosine = Comparison("dense", 8, t, cosine=0.9, relative_error=0.3, failures=("mean cosine to fp32 0.9",))
    assert aim_of(cosine) is None
    channel = Comparison("dense", 8, t, cosine=0.99, channel_cosine=0.2, failures=("output 'y' channel 2 cosine 0.20",))
    aim = aim_of(channel)
    assert aim is not None and aim.name == "worst channel cosine" and aim.value(channel) == 0.2
    both = Comparison("dense", 8, t, cosine=0.9, channel_cosine=0.2, failures=(*cosine.failures, *channel.failures))
    assert aim_of(both) is None  # the cosine failed too: the local relative / worst-channel error ranks
    text = "output 'output0' decoded as a YOLO head: detections F1 0.412 vs fp32 (7 of 17 fp32 detections matched)"
    measures = (("output0", "detection F1", 0.412, False), ("mask", "mask IoU", 0.5, False))
    failed = (f"{text}, needs F1 >= 0.95",)
    detected = Comparison("dense", 8, t, detections=text, failures=failed, task_measures=measures)
    aim = aim_of(detected)
    assert aim is not None and aim.name == "detection F1" and aim.value(detected) == 0.412
    masked = Comparison("dense", 8, t, failures=("mask",), task_measures=(("m", "mask IoU", 0.7, False),))
    aim = aim_of(masked)
    assert aim is not None and aim.name == "mask IoU" and aim.value(masked) == 0.7
    # a measure that met its gate is not what failed
    met = Comparison("dense", 8, t, failures=("x",), task_measures=(("output0", "detection F1", 0.99, True),))
    assert aim_of(met) is None
