"""Without post-processing, a YOLO-style head and a DBNet-style map are recognised from the FP32
outputs and judged by what they decode to (``validate.heads``); a classifier is not mistaken for
either."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.bundle.manifest import Signature, TensorSpec, Tolerance
from edgekit.validate.heads import DBNET_TASK, YOLO_TASK, mask_iou, recognise
from edgekit.validate.metrics import compare, output_tasks
from edgekit.validate.ort_runner import ort_cpu_runner
from tests.factories import tiny_classifier


def _served(model: Path) -> Signature:
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])

    def specs(items: list[object]) -> tuple[TensorSpec, ...]:
        return tuple(TensorSpec(i.name, "float32", tuple(i.shape)) for i in items)  # type: ignore[attr-defined]

    return Signature(inputs=specs(session.get_inputs()), outputs=specs(session.get_outputs()))


def _run(model: Path, name: str, images: np.ndarray) -> dict[str, np.ndarray]:
    run = ort_cpu_runner(model)
    parts = [run({name: images[i : i + 1]}) for i in range(len(images))]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def _fake_int8(y: np.ndarray) -> np.ndarray:
    """One int8 scale for the whole tensor, as a per-tensor quantized head concat has."""
    scale = float(np.abs(y).max()) / 127
    return (np.clip(np.round(y / scale), -127, 127) * scale).astype(np.float32)


def _detector_outputs(tmp_path: Path) -> tuple[Signature, dict[str, np.ndarray]]:
    """A colour detector (128x128, 256 anchors) on images with a faint green tint everywhere
    (class 1 scores 0.1: live, never above the 0.25 score threshold) and red squares on the
    cells (class 0 scores 1: the detections)."""
    from examples.detector import colour_detector

    model = colour_detector(tmp_path / "det.onnx", size=128)
    rng = np.random.default_rng(0)
    images = np.zeros((6, 3, 128, 128), np.float32)
    images[:, 1] = rng.uniform(0.05, 0.15, (6, 128, 128))
    for i in range(6):
        for y0, x0 in rng.integers(0, 15, (2, 2)) * 8:
            images[i, 0, y0 : y0 + 16, x0 : x0 + 16] = 1.0
    return _served(model), _run(model, "images", images)


def test_compare_passes_a_yolo_head_that_keeps_every_detection_though_a_never_firing_class_is_crushed(
    tmp_path: Path,
) -> None:
    served, ref = _detector_outputs(tmp_path)
    tasks, notes = output_tasks(served, ref)
    assert tasks == {"output0": YOLO_TASK}
    assert notes[0].startswith(
        "gate: output 'output0' judged as detect (decoded with class-wise NMS (score 0.25, IoU 0.45) and its "
        "detections matched to fp32's at IoU 0.5, F1 >= 0.95"
    )
    assert "a YOLO-style head (256 anchors of 4 box values and 3 class scores in [0, 1])" in notes[0]
    cand = {"output0": _fake_int8(ref["output0"])}
    assert not cand["output0"][:, 5].any()  # the green class, 0.1 everywhere, rounds to 0
    plain = compare(ref, cand, "dense", Tolerance())
    assert not plain.passed and plain.channel_cosine is not None and plain.channel_cosine < 0.5
    got = compare(ref, cand, "dense", Tolerance(), tasks=tasks)
    assert got.passed, got.failures
    assert got.detections is not None
    assert got.detections.startswith("output 'output0' decoded as a YOLO head: detections F1 1.000 vs fp32 (")
    assert " 0 of " not in got.detections


def test_selection_margin_leaves_out_the_worst_channel_of_a_decoded_yolo_head(tmp_path: Path) -> None:
    from edgekit.optimize.margin import selection_margin

    served, ref = _detector_outputs(tmp_path)
    tasks, _ = output_tasks(served, ref)
    cand = {"output0": _fake_int8(ref["output0"])}
    got = compare(ref, cand, "dense", Tolerance(), tasks=tasks)
    assert got.passed and got.decoded == ("output0",)
    assert selection_margin(ref, cand, got) == ""  # channel 5's cosine 0 would have made it marginal


def test_compare_fails_a_yolo_head_whose_live_class_scores_were_crushed(tmp_path: Path) -> None:
    served, ref = _detector_outputs(tmp_path)
    tasks, _ = output_tasks(served, ref)
    crushed = _fake_int8(ref["output0"])
    crushed[:, 4] = 0.0  # the red class, which holds every detection
    got = compare(ref, {"output0": crushed}, "dense", Tolerance(min_channel_cosine=None), tasks=tasks)
    assert not got.passed
    (failure,) = [f for f in got.failures if "YOLO head" in f]
    assert failure.startswith("output 'output0' decoded as a YOLO head: detections F1 0.000 vs fp32 (0 of ")
    assert failure.endswith("needs F1 >= 0.95: the decoded detections differ from fp32's")


def test_recognise_a_yolo_head_with_anchors_first() -> None:
    from edgekit.validate.heads import yolo_axis
    from examples.detector import reference_outputs

    images = np.zeros((1, 3, 128, 128), np.float32)
    images[0, 2, 32:48, 64:80] = 1.0
    last = reference_outputs(images, channels_last=True).astype(np.float32)  # [1, 256, 7]
    got = recognise(last)
    assert got is not None and got[0] == YOLO_TASK and yolo_axis(last.shape) == 2
    assert "256 anchors of 4 box values and 3 class scores" in got[1]


def test_output_tasks_leaves_a_yolo_head_to_task_when_given(tmp_path: Path) -> None:
    served, ref = _detector_outputs(tmp_path)
    tasks, notes = output_tasks(served, ref, {"output0": "embed"})
    assert tasks == {"output0": "embed"} and notes[0].endswith("; given by --task")


def _text_detector(path: Path, size: int = 64) -> Path:
    """A DBNet-style text detector: ``x`` [1, 3, S, S] -> the channels' mean pooled over 4x4
    cells -> Sigmoid(8 (v - 0.5)) -> ``maps`` [1, 1, S/4, S/4]."""
    from onnx import TensorProto, helper, numpy_helper

    from tests.factories import _save

    inits = [
        numpy_helper.from_array(np.array(8.0, np.float32), "gain"),
        numpy_helper.from_array(np.array(0.5, np.float32), "mid"),
    ]
    nodes = [
        helper.make_node("ReduceMean", ["x"], ["grey"], axes=[1], keepdims=1),
        helper.make_node("AveragePool", ["grey"], ["cells"], kernel_shape=[4, 4], strides=[4, 4]),
        helper.make_node("Sub", ["cells", "mid"], ["centred"]),
        helper.make_node("Mul", ["centred", "gain"], ["logits"]),
        helper.make_node("Sigmoid", ["logits"], ["maps"]),
    ]
    graph = helper.make_graph(
        nodes,
        "text_detector",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("maps", TensorProto.FLOAT, [1, 1, size // 4, size // 4])],
        inits,
    )
    return _save(graph, path, 13)


def test_compare_judges_a_dbnet_map_by_its_thresholded_mask_iou(tmp_path: Path) -> None:
    model = _text_detector(tmp_path / "text.onnx")
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 0.3, (6, 3, 64, 64)).astype(np.float32)
    for i in range(6):  # a bright text line in each image
        row = int(rng.integers(0, 48))
        images[i, :, row : row + 12, 8:56] = rng.uniform(0.6, 1.0, (3, 12, 48))
    served = _served(model)
    ref = _run(model, "x", images)
    tasks, notes = output_tasks(served, ref)
    assert tasks == {"maps": DBNET_TASK}
    assert notes[0].startswith(
        "gate: output 'maps' judged as segment (thresholded at 0.3 and its mask matched to fp32's, mean IoU >= 0.9"
    )
    assert "a DBNet-style probability map (16x16 at its input's resolution or a quarter of it" in notes[0]
    near = {"maps": _fake_int8(ref["maps"])}
    got = compare(ref, near, "dense", Tolerance(), tasks=tasks)
    assert got.passed, got.failures
    assert got.detections is not None and got.detections.startswith(
        "output 'maps' thresholded at 0.3 as a DBNet map: mask IoU 1.000 vs fp32"
    )
    # probabilities pulled down: every text pixel falls under the threshold
    dimmed = {"maps": (ref["maps"] * 0.25).astype(np.float32)}
    assert mask_iou(ref["maps"], dimmed["maps"]) == 0.0
    failed = compare(ref, dimmed, "dense", Tolerance(max_relative_error=None), tasks=tasks)
    (failure,) = failed.failures
    assert failure.startswith("output 'maps' thresholded at 0.3 as a DBNet map: mask IoU 0.000 vs fp32")
    without = compare(ref, dimmed, "dense", Tolerance(max_relative_error=None))
    assert without.passed  # the map's cosine alone does not see it


def test_recognise_leaves_a_classifier_and_other_outputs_alone(tmp_path: Path) -> None:
    model = tiny_classifier(tmp_path / "cls.onnx")
    rng = np.random.default_rng(0)
    served = _served(model)
    ref = _run(model, served.inputs[0].name, rng.uniform(0, 1, (8, 3, 16, 16)).astype(np.float32))
    tasks, notes = output_tasks(served, ref)
    assert tasks == {"probs": "classify"} and "recognised" not in notes[0]
    # rank 3 and 4 outputs that are not such heads
    assert recognise(rng.standard_normal((4, 84, 400)).astype(np.float32)) is None  # negative widths, scores
    quiet = np.abs(rng.standard_normal((4, 7, 400))).astype(np.float32)
    quiet[:, 4:] *= 0.01  # scores in [0, 1] but never above 0.25: nothing detected
    assert recognise(quiet) is None
    few = np.abs(rng.standard_normal((4, 7, 20))).astype(np.float32) * 0.1  # 20 anchors: a feature map
    assert recognise(few) is None
    logits = rng.standard_normal((4, 1, 16, 16)).astype(np.float32)  # a map of unbounded values
    assert recognise(logits) is None
    probs = 1 / (1 + np.exp(-logits))
    image = (TensorSpec("x", "float32", (1, 3, 40, 40)),)
    assert recognise(probs, image) is None  # 16x16 is neither 40x40 nor 10x10
    assert recognise(probs, (TensorSpec("x", "float32", (1, 3, 64, 64)),)) is not None


def test_package_judges_a_raw_yolo_head_by_its_decoded_detections(keypair: tuple[Path, Path], tmp_path: Path) -> None:
    from examples.detector import colour_detector
    from tests.factories import package_small_data as package

    model = colour_detector(tmp_path / "det.onnx", size=128)
    rng = np.random.default_rng(0)
    images = np.zeros((40, 3, 128, 128), np.float32)
    images[:, 1] = rng.uniform(0.05, 0.15, (40, 128, 128))  # a green tint: class 1 never fires
    for i in range(40):
        for y0, x0 in rng.integers(0, 15, (2, 2)) * 8:
            images[i, 0, y0 : y0 + 16, x0 : x0 + 16] = 1.0

    def run(task: str | None, out: str) -> dict[str, tuple[str, str]]:
        result = package(
            model,
            targets=["cpu"],
            precision="auto",
            calib={"images": images[:30]},
            eval={"images": images[30:]},
            key=keypair[0],
            name="det",
            out_dir=tmp_path / out,
            options={"cpu": {"openvino": False}},
            task=task,
        )
        v = result.manifests["cpu"].validation
        assert v.passed, v.failures
        if task is None:
            assert any(
                n.startswith("gate: output 'output0' judged as detect (decoded with class-wise NMS") for n in v.notes
            )
            prefix = "held-out output 'output0' decoded as a YOLO head: detections F1 "
            (held,) = [n for n in v.notes if n.startswith(prefix)]
            matched, total = held.split("(")[1].split(" fp32 detections")[0].split(" of ")
            assert int(total) > 0 and int(matched) >= 0.95 * int(total)
        rows = result.manifests["cpu"].candidates.candidates
        # the plain layouts (the head kept in float is a candidate of its own: optimize.head_scope)
        plain = [c for c in rows if c.id.startswith("ort-static") and "minmax" in c.id and "head in float" not in c.id]
        return {c.id: (c.status, c.reason) for c in plain}

    # ORT's static int8 puts the concat under one scale: the green class (0.1) rounds to 0
    plain = run("output0=detect", "plain")
    assert plain and all(s == "failed" and "channel 5 cosine 0.00" in r for s, r in plain.values()), plain
    decoded = run(None, "decoded")
    assert decoded.keys() == plain.keys()
    assert all(s in ("passed", "chosen") for s, _ in decoded.values()), decoded


def test_package_names_the_mask_gate_of_a_dbnet_map_and_its_held_out_iou(
    keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    from tests.factories import package_small_data as package

    model = _text_detector(tmp_path / "text.onnx")
    rng = np.random.default_rng(0)
    images = rng.uniform(0, 0.3, (40, 3, 64, 64)).astype(np.float32)
    for i in range(40):
        row = int(rng.integers(0, 48))
        images[i, :, row : row + 12, 8:56] = rng.uniform(0.6, 1.0, (3, 12, 48))
    result = package(
        model,
        targets=["cpu"],
        precision="auto",
        calib={"x": images[:30]},
        eval={"x": images[30:]},
        key=keypair[0],
        name="text",
        out_dir=tmp_path / "out",
        options={"cpu": {"openvino": False}},
    )
    v = result.manifests["cpu"].validation
    assert v.passed, v.failures
    assert any(n.startswith("gate: output 'maps' judged as segment (thresholded at 0.3") for n in v.notes)
    (held,) = [n for n in v.notes if n.startswith("held-out output 'maps' thresholded at 0.3 as a DBNet map")]
    assert float(held.split("mask IoU ")[1].split()[0]) >= 0.9
