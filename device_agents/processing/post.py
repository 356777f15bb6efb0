"""A manifest's post-processing steps: a model's raw outputs to what a client wants.

- classifiers: ``softmax`` / ``sigmoid`` then ``topk``: ``classes`` INT32 [k], ``scores`` FP32
  [k] (best first) and, with a labels file, ``labels`` BYTES [k];
- detectors: ``boxes`` (``box_format`` "yolo": ``[1, 4+C, N]`` or ``[1, N, 4+C]``, cx, cy, w, h
  in input pixels then C class scores): the best class per candidate, a score filter, class-wise
  greedy NMS, at most ``max_boxes``, mapped through the pre-processing ``Geometry`` into the
  original image's pixels: ``boxes`` FP32 [N, 4] (x1, y1, x2, y2), ``scores`` FP32 [N],
  ``classes`` INT32 [N] and, with a labels file, ``labels`` BYTES [N].

BYTES outputs are numpy object arrays of ``bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np

from device_agents.processing.signature import WireTensor, processed_outputs
from device_agents.processing.transforms import Geometry
from edgekit.bundle.errors import InferenceInputError, ManifestError
from edgekit.bundle.manifest import ProcessingStep, TensorSpec

DEFAULT_MAX_BOXES = 300
# candidates past the score filter that NMS looks at, best first (a bound on its O(n^2) work)
MAX_NMS_CANDIDATES = 30_000
_POST_OPS = ("softmax", "sigmoid", "topk", "boxes", "cast", "argmax")


def read_labels(data: bytes, what: str) -> tuple[str, ...]:
    """Class names, one per line (UTF-8; blank lines at the end ignored)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(f"{what}: labels file is not UTF-8 ({exc})") from exc
    labels = tuple(line.strip() for line in text.rstrip("\n").splitlines())
    if not labels or any(not label for label in labels):
        raise ManifestError(f"{what}: labels file needs one non-empty class name per line")
    return labels


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = x - x.max(axis=axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=axis, keepdims=True)  # type: ignore[no-any-return]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))  # type: ignore[no-any-return]


def topk(scores: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Indices and values of the ``k`` largest of a 1-D ``scores``, largest first (ties: lower index)."""
    k = min(k, scores.shape[0])
    part = np.argpartition(-scores, k - 1)[:k] if k < scores.shape[0] else np.arange(scores.shape[0])
    order = part[np.lexsort((part, -scores[part]))]
    return order.astype(np.int32), scores[order].astype(np.float32)


def yolo_candidates(output: np.ndarray, axis: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A YOLO head's output (one image) to boxes x1, y1, x2, y2 [N, 4], best score [N], class [N]."""
    rows = output.reshape(output.shape[-2:]) if output.ndim == 3 else output
    if axis == 1:  # [4+C, N]
        rows = rows.T
    xywh, cls = rows[:, :4].astype(np.float32), rows[:, 4:]
    classes = cls.argmax(axis=1).astype(np.int32)
    scores = cls[np.arange(cls.shape[0]), classes].astype(np.float32)
    half = xywh[:, 2:] / 2
    boxes = np.concatenate([xywh[:, :2] - half, xywh[:, :2] + half], axis=1)
    return boxes, scores, classes


def nms(boxes: np.ndarray, scores: np.ndarray, classes: np.ndarray, iou: float, max_boxes: int) -> np.ndarray:
    """Indices kept by class-wise greedy NMS (a box suppresses same-class boxes it overlaps by
    more than ``iou``), best score first, at most ``max_boxes``."""
    order = np.argsort(-scores, kind="stable")[:MAX_NMS_CANDIDATES]
    if order.size == 0:
        return order
    # boxes of different classes never overlap once each class is moved to its own region
    span = float(np.abs(boxes).max()) * 2 + 1
    shifted = boxes[order] + (classes[order].astype(np.float32) * span)[:, None]
    x1, y1, x2, y2 = shifted.T
    areas = np.maximum(x2 - x1, 0) * np.maximum(y2 - y1, 0)
    keep: list[int] = []
    alive = np.ones(order.size, dtype=bool)
    for i in range(order.size):
        if not alive[i]:
            continue
        keep.append(i)
        if len(keep) >= max_boxes:
            break
        rest = np.flatnonzero(alive[i + 1 :]) + i + 1
        if rest.size == 0:
            break
        w = np.maximum(np.minimum(x2[i], x2[rest]) - np.maximum(x1[i], x1[rest]), 0)
        h = np.maximum(np.minimum(y2[i], y2[rest]) - np.maximum(y1[i], y1[rest]), 0)
        inter = w * h
        union = areas[i] + areas[rest] - inter
        overlap = np.divide(inter, union, out=np.zeros_like(inter), where=union > 0)
        alive[rest[overlap > iou]] = False
    return order[np.asarray(keep, dtype=np.intp)]


class Postprocessor:
    """The post-processing of one model (its served ``outputs``); ``read_file`` reads a bundle
    file (the labels) by its manifest path."""

    def __init__(
        self, steps: Sequence[ProcessingStep], outputs: Sequence[TensorSpec], read_file: Callable[[str], bytes]
    ) -> None:
        self.steps = tuple(steps)
        for step in self.steps:
            if step.op not in _POST_OPS:
                raise ManifestError(f"postprocess: {step.op!r} is not a post-processing op ({', '.join(_POST_OPS)})")
        finals = [s for s in self.steps if s.op in ("topk", "boxes")]
        if len(finals) != 1 or finals[-1] is not self.steps[-1]:
            raise ManifestError("postprocess: one topk or boxes step, last")
        self.final = finals[0]
        names = [o.name for o in outputs]
        self.tensor = self.final.tensor or names[0]
        if self.tensor not in names:
            raise ManifestError(f"postprocess: {self.final.op} reads output {self.tensor!r}; the model has {names}")
        spec = next(o for o in outputs if o.name == self.tensor)
        self.labels: tuple[str, ...] | None = None
        if self.final.labels_file is not None:
            self.labels = read_labels(read_file(self.final.labels_file), self.final.labels_file)
            self._label_bytes = np.array([label.encode() for label in self.labels] + [b""], dtype=object)
        classes = _class_count(self.final, spec)
        if self.labels is not None and classes is not None and classes != len(self.labels):
            raise ManifestError(
                f"postprocess: {self.final.labels_file} has {len(self.labels)} labels for {classes} classes "
                f"of output {self.tensor!r} {list(spec.shape)}"
            )
        self.max_boxes = self.final.max_boxes or DEFAULT_MAX_BOXES

    def outputs(self) -> tuple[WireTensor, ...]:
        """The processed outputs, as v2 metadata shows them."""
        return processed_outputs(self.steps)

    def run(self, outputs: Mapping[str, np.ndarray], geometry: Geometry | None) -> dict[str, np.ndarray]:
        """One image's model outputs to the processed outputs; ``geometry``: the pre-processing's,
        for boxes (None: boxes stay in the model input's pixels)."""
        x = np.asarray(outputs[self.tensor])
        if x.shape[0] != 1:
            raise InferenceInputError(
                f"output {self.tensor!r} holds {x.shape[0]} results; its post-processing takes one image per request"
            )
        for step in self.steps[:-1]:
            if step.op == "softmax":
                x = softmax(x.astype(np.float32), -1 if step.axis is None else step.axis)
            elif step.op == "sigmoid":
                x = sigmoid(x.astype(np.float32))
            elif step.op == "cast" and step.dtype is not None:
                x = x.astype(step.dtype)
        if self.final.op == "topk":
            classes, scores = topk(x.reshape(-1), int(self.final.k or 1))
            out = {"scores": scores, "classes": classes}
        else:
            boxes, scores, classes = yolo_candidates(x, int(self.final.axis or 1))
            passed = np.flatnonzero(scores > (self.final.score_threshold or 0.0))
            boxes, scores, classes = boxes[passed], scores[passed], classes[passed]
            kept = nms(boxes, scores, classes, float(self.final.iou_threshold or 0.0), self.max_boxes)
            boxes = boxes[kept]
            out = {
                "boxes": geometry.to_original(boxes) if geometry is not None else boxes.astype(np.float32),
                "scores": scores[kept],
                "classes": classes[kept],
            }
        if self.labels is not None:
            index = np.where((out["classes"] >= 0) & (out["classes"] < len(self.labels)), out["classes"], -1)
            out["labels"] = self._label_bytes[index]
        return out


def _class_count(step: ProcessingStep, spec: TensorSpec) -> int | None:
    """How many classes ``spec`` scores (None where a dim is dynamic)."""
    if step.op == "topk":
        count = 1
        for d in spec.shape[1:]:
            if not isinstance(d, int):
                return None
            count *= d
        return count
    axis = step.axis or 1
    if len(spec.shape) != 3 or axis not in (1, 2):
        raise ManifestError(
            f"postprocess: boxes=yolo reads [1, 4+C, N] or [1, N, 4+C]; output {spec.name!r} is {list(spec.shape)}"
        )
    d = spec.shape[axis]
    return d - 4 if isinstance(d, int) else None
