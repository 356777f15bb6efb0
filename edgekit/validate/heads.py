"""Detector and text-detector heads recognised from the FP32 outputs, and judged by what they
decode to when the bundle has no post-processing of its own.

- A YOLO-style head: ``[S, 4+C, N]`` or ``[S, N, 4+C]`` with many anchors (``N >= MIN_ANCHORS``
  and at least 4x the ``4 + C`` values), the first four values box-like (widths and heights >= 0,
  centres no further outside than a box), the ``C`` class scores in [0, 1] (sigmoid inside the
  model, as Ultralytics exports) and at least one of them above ``YOLO_SCORE`` (something
  detected). Both outputs are decoded as ``--postprocess boxes=yolo`` would (the agent's decoder
  and class-wise NMS, ``device_agents.processing.post``) and matched at IoU 0.5
  (``validate.detections``): F1 >= 0.95.
- A DBNet-style map: ``[S, 1, H, W]`` at the image input's resolution or a quarter of it (any size
  when the input's is dynamic), values in [0, 1], some at or above ``DBNET_THRESHOLD`` and some
  below. Both maps are thresholded at ``DBNET_THRESHOLD`` (DBNet's binarisation) and compared by
  their mask IoU, the mean over samples (1 where neither has a pixel): >= ``MASK_MIN_IOU``.

Recognised heads are carried in the output's task (``YOLO_TASK`` / ``DBNET_TASK``, a refinement of
``detect`` / ``segment``); ``--task`` on an output leaves it as given. The worst-channel cosine does
not veto a recognised head's output: its decoded outputs do.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from edgekit.bundle.manifest import ProcessingStep, TensorSpec
from edgekit.validate.detections import DETECTION_MIN_F1, MATCH_IOU, detection_agreement

YOLO_TASK = "detect:yolo"
DBNET_TASK = "segment:dbnet"
MIN_ANCHORS = 100
MAX_CLASSES = 1000
# the decode of ``--postprocess boxes=yolo``'s defaults (``validate.postprocess.Postprocess``)
YOLO_SCORE = 0.25
YOLO_IOU = 0.45
YOLO_MAX_BOXES = 300
DBNET_THRESHOLD = 0.3
MASK_MIN_IOU = 0.9
_EPS = 1e-6


DETECTION_F1 = "detection F1"  # HeadCheck.measure and Comparison.task_measures names
MASK_IOU = "mask IoU"


@dataclass(frozen=True)
class HeadCheck:
    """What a recognised head's decoded outputs showed: ``text`` for the report, ``failure`` when
    the gate failed (None: passed)."""

    output: str
    text: str
    failure: str | None
    # a YOLO head's decoded detections per sample: (matched, fp32's, the candidate's)
    detection_counts: tuple[tuple[int, int, int], ...] = ()
    measure: str = ""  # what gated it: DETECTION_F1 or MASK_IOU
    value: float | None = None


def base_task(task: str) -> str:
    """``detect`` for ``detect:yolo``: the task a recognised head refines."""
    return task.partition(":")[0]


def head_outputs(tasks: Mapping[str, str], given: Mapping[str, str]) -> dict[str, str]:
    """The outputs of ``tasks`` (``validate.metrics.output_tasks``) that are a detector's or
    segmenter's head: recognised here, or ``detect`` / ``segment`` as ``given`` by ``--task`` (a
    rank-3 or rank-4 output's task inferred from its shape alone is not a head)."""
    return {
        name: task
        for name, task in tasks.items()
        if task in (YOLO_TASK, DBNET_TASK) or (name in given and base_task(task) in ("detect", "segment"))
    }


def recognise(values: np.ndarray, inputs: Sequence[TensorSpec] = ()) -> tuple[str, str] | None:
    """(task, why) when the FP32 ``values`` of one output (samples on axis 0) are a YOLO-style
    head or a DBNet-style map; ``inputs``: the model's, whose image size a DBNet map matches."""
    v = np.asarray(values)
    if v.size == 0 or not np.issubdtype(v.dtype, np.floating) or not np.all(np.isfinite(v)):
        return None
    if v.ndim == 3:
        axis = yolo_axis(tuple(v.shape))
        if axis is None:
            return None
        rows = np.moveaxis(v, axis, -1)  # [S, N, 4+C]
        box, scores = rows[..., :4], rows[..., 4:]
        wh_min, wh_max = float(box[..., 2:4].min()), float(box[..., 2:4].max())
        if wh_min < 0 or wh_max <= 0 or float(box[..., :2].min()) < -wh_max:
            return None
        if float(scores.min()) < -_EPS or float(scores.max()) > 1 + _EPS or float(scores.max()) <= YOLO_SCORE:
            return None
        classes, anchors = rows.shape[-1] - 4, rows.shape[-2]
        return YOLO_TASK, (
            f"a YOLO-style head ({anchors} anchors of 4 box values and {classes} class scores in [0, 1]) recognised "
            "from its shape and fp32 values"
        )
    if v.ndim == 4 and v.shape[1] == 1 and min(v.shape[2:]) >= 8:
        if float(v.min()) < -_EPS or float(v.max()) > 1 + _EPS:
            return None
        above = v >= DBNET_THRESHOLD
        if not above.any() or above.all():
            return None
        size = tuple(int(d) for d in v.shape[2:])
        sizes = _image_sizes(inputs)
        if sizes and not any(size in (hw, (hw[0] // 4, hw[1] // 4)) for hw in sizes):
            return None
        where = "its input's resolution or a quarter of it" if sizes else "an input of dynamic size"
        return DBNET_TASK, (
            f"a DBNet-style probability map ({size[0]}x{size[1]} at {where}, values in [0, 1]) recognised from its "
            "shape and fp32 values"
        )
    return None


def yolo_axis(shape: tuple[int, ...]) -> int | None:
    """The axis (1 or 2) of a rank-3 output's ``4 + C`` values, when the other holds many anchors."""
    if len(shape) != 3:
        return None
    for axis, other in ((1, 2), (2, 1)):
        per, anchors = int(shape[axis]), int(shape[other])
        if 5 <= per <= 4 + MAX_CLASSES and anchors >= MIN_ANCHORS and anchors >= 4 * per:
            return axis
    return None


def gate_text(task: str) -> str:
    """How a recognised head is judged, for the report's gate note."""
    if task == YOLO_TASK:
        return (
            f"decoded with class-wise NMS (score {YOLO_SCORE:g}, IoU {YOLO_IOU:g}) and its detections matched to "
            f"fp32's at IoU {MATCH_IOU:g}, F1 >= {DETECTION_MIN_F1:g}; its worst channel's cosine does not veto"
        )
    return (
        f"thresholded at {DBNET_THRESHOLD:g} and its mask matched to fp32's, mean IoU >= {MASK_MIN_IOU:g}; its mean "
        "cosine still gates"
    )


def check_heads(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    tasks: Mapping[str, str] | None,
    skip: str | None = None,
) -> tuple[HeadCheck, ...]:
    """Judge each output whose task is a recognised head (``skip``: one the bundle's own
    post-processing judges) by its decoded outputs."""
    found: list[HeadCheck] = []
    for name, task in (tasks or {}).items():
        if name == skip or name not in reference or name not in candidate:
            continue
        if task == YOLO_TASK:
            found.append(_yolo_check(name, np.asarray(reference[name]), np.asarray(candidate[name])))
        elif task == DBNET_TASK:
            found.append(_mask_check(name, np.asarray(reference[name]), np.asarray(candidate[name])))
    return tuple(found)


def _yolo_check(name: str, ref: np.ndarray, cand: np.ndarray) -> HeadCheck:
    from device_agents.processing.post import Postprocessor

    axis = yolo_axis(tuple(ref.shape))
    if axis is None:  # recognised on other samples of another shape: nothing to decode here
        return HeadCheck(name, f"output {name!r}: not a YOLO-style shape {list(ref.shape)}", None)
    step = ProcessingStep(
        op="boxes",
        tensor=name,
        box_format="yolo",
        axis=axis,
        score_threshold=YOLO_SCORE,
        iou_threshold=YOLO_IOU,
        max_boxes=YOLO_MAX_BOXES,
    )
    spec = TensorSpec(name, "float32", ("n", *(int(d) for d in ref.shape[1:])))
    post = Postprocessor((step,), (spec,), lambda _path: b"")
    got = detection_agreement({name: ref}, {name: cand}, post)
    text = f"output {name!r} decoded as a YOLO head: {got.text()}"
    failure = None
    if got.f1 < DETECTION_MIN_F1:
        failure = f"{text}, needs F1 >= {DETECTION_MIN_F1:g}: the decoded detections differ from fp32's"
    return HeadCheck(name, text, failure, got.per_sample, DETECTION_F1, got.f1)


def mask_iou(reference: np.ndarray, candidate: np.ndarray, threshold: float = DBNET_THRESHOLD) -> float:
    """Mean over samples (axis 0) of the IoU of the two maps thresholded at ``threshold``; a
    sample where neither has a pixel above it counts 1."""
    r = np.asarray(reference).reshape(reference.shape[0], -1) >= threshold
    c = np.asarray(candidate).reshape(candidate.shape[0], -1) >= threshold
    inter = np.logical_and(r, c).sum(axis=1)
    union = np.logical_or(r, c).sum(axis=1)
    per = np.where(union > 0, inter / np.maximum(union, 1), 1.0)
    return float(per.mean()) if per.size else 1.0


def _mask_check(name: str, ref: np.ndarray, cand: np.ndarray) -> HeadCheck:
    if ref.shape != cand.shape:
        raise ValueError(f"output {name!r}: candidate shape {list(cand.shape)} != {list(ref.shape)}")
    iou = mask_iou(ref, cand)
    share = float(np.mean(ref >= DBNET_THRESHOLD))
    text = (
        f"output {name!r} thresholded at {DBNET_THRESHOLD:g} as a DBNet map: mask IoU {iou:.3f} vs fp32 "
        f"(fp32 mask {share:.1%} of pixels)"
    )
    failure = None
    if iou < MASK_MIN_IOU:
        failure = f"{text}, needs >= {MASK_MIN_IOU:g}: the thresholded map differs from fp32's"
    return HeadCheck(name, text, failure, measure=MASK_IOU, value=iou)


def _image_sizes(inputs: Sequence[TensorSpec]) -> list[tuple[int, int]]:
    """(H, W) of each rank-4 input with static spatial dims (NCHW, or NHWC where the last axis is
    1-4 channels)."""
    sizes: list[tuple[int, int]] = []
    for spec in inputs:
        shape = spec.shape
        if len(shape) != 4:
            continue
        nhwc = spec.layout == "NHWC" or (spec.layout is None and isinstance(shape[3], int) and shape[3] <= 4)
        hw = (shape[1], shape[2]) if nhwc else (shape[2], shape[3])
        if isinstance(hw[0], int) and isinstance(hw[1], int):
            sizes.append((hw[0], hw[1]))
    return sizes
