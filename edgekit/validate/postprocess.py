"""Post-processing as data: ``--postprocess boxes=yolo,score=0.25,iou=0.45`` for detectors,
``--postprocess topk=5`` for classifiers, with ``--labels-file classes.txt`` for class names.

``Postprocess`` is the host's side only: parsing the flag and checking it against the model's
output shapes before any conversion. ``to_steps`` gives the manifest's ``postprocess`` steps,
which the agent applies (``device_agents.processing.post``): a detector then serves ``boxes``
FP32 [N, 4] (x1, y1, x2, y2 in the original image's pixels), ``scores`` FP32 [N], ``classes``
INT32 [N] and, with labels, ``labels`` BYTES [N]; a classifier ``classes``, ``scores`` and
``labels`` of its ``k`` best classes.

Keys: ``boxes=yolo`` (``[1, 4+C, N]`` or ``[1, N, 4+C]``: cx, cy, w, h in input pixels then one
score per class; which axis holds the 4 + C values is found from the shape, and from the labels
when both axes could), ``score`` (0.25), ``iou`` (0.45), ``max`` boxes (300); ``topk=K``;
``activation=softmax|sigmoid|none`` applied to the scores first (default: none for boxes; for
top-k, softmax unless the model's outputs already are probabilities, decided on the evaluation
outputs and said in the progress lines).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from edgekit.bundle.errors import ManifestError
from edgekit.bundle.manifest import ProcessingStep, Signature, TensorSpec
from edgekit.errors import ConfigError

LABELS_FILE = "labels.txt"  # the labels file's path inside a bundle
Activation = Literal["softmax", "sigmoid", "none"]
_ACTIVATIONS: tuple[Activation, ...] = ("softmax", "sigmoid", "none")
_KEYS = ("boxes", "topk", "score", "iou", "max", "activation", "output")


@dataclass(frozen=True)
class Postprocess:
    """What ``--postprocess`` asked for: ``boxes`` or ``topk``, not both."""

    boxes: Literal["yolo"] | None = None
    topk: int | None = None
    score: float = 0.25
    iou: float = 0.45
    max: int = 300
    activation: Activation | None = None  # None: the default for the kind (see the module docstring)
    output: str | None = None  # the model output it reads (default: the first)

    def __post_init__(self) -> None:
        if (self.boxes is None) == (self.topk is None):
            raise ConfigError("--postprocess: give boxes=yolo (a detector) or topk=K (a classifier), one of them")
        if self.topk is not None and self.topk < 1:
            raise ConfigError(f"--postprocess topk={self.topk}: expected K >= 1 such as topk=5")
        for key in ("score", "iou"):
            value = getattr(self, key)
            if not 0 <= value <= 1:
                raise ConfigError(f"--postprocess {key}={value:g}: expected a value in [0, 1] such as {key}=0.25")
        if self.max < 1:
            raise ConfigError(f"--postprocess max={self.max}: expected at least 1 box")

    @classmethod
    def parse(cls, text: str) -> Postprocess:
        """``"boxes=yolo,score=0.25,iou=0.45"`` or ``"topk=5,activation=softmax"``."""
        values: dict[str, Any] = {}
        for item in (i.strip() for i in text.split(",") if i.strip()):
            key, sep, raw = (s.strip() for s in item.partition("="))
            if not sep or not raw:
                raise ConfigError(f"--postprocess {item!r}: expected KEY=VALUE such as topk=5 or boxes=yolo")
            if key not in _KEYS:
                near = difflib.get_close_matches(key, _KEYS, n=1)
                hint = f"; did you mean {near[0]!r}?" if near else ""
                raise ConfigError(f"--postprocess {key}: unknown key (known: {', '.join(_KEYS)}){hint}")
            values[key] = _parse_value(key, raw)
        return cls(**values)

    def to_steps(
        self,
        served: Signature,
        labels: tuple[str, ...] | None,
        sample_outputs: dict[str, np.ndarray] | None = None,
        say: Callable[[str], None] = lambda _msg: None,
    ) -> tuple[ProcessingStep, ...]:
        """The manifest's post-processing steps for ``served``'s outputs, checked against their
        shapes (and ``labels``' count). ``sample_outputs``: the model's outputs on a few evaluation
        samples, which decide top-k's default activation."""
        spec = self._output(served)
        labels_file = LABELS_FILE if labels is not None else None
        if self.boxes is not None:
            axis = _yolo_axis(spec, labels)
            steps = [ProcessingStep(op="sigmoid", tensor=spec.name)] if self.activation == "sigmoid" else []
            if self.activation == "softmax":
                raise ConfigError("--postprocess boxes=yolo: activation=softmax is not a per-class score; use sigmoid")
            steps.append(
                ProcessingStep(
                    op="boxes",
                    tensor=spec.name,
                    box_format="yolo",
                    axis=axis,
                    score_threshold=self.score,
                    iou_threshold=self.iou,
                    max_boxes=self.max,
                    labels_file=labels_file,
                )
            )
            return tuple(steps)
        classes = _class_count(spec)
        k = int(self.topk or 1)
        if classes is not None and k > classes:
            raise ConfigError(
                f"--postprocess topk={k}: output {spec.name!r} {list(spec.shape)} scores {classes} classes"
            )
        if labels is not None and classes is not None and len(labels) != classes:
            raise ConfigError(
                f"--labels-file: {len(labels)} labels, but output {spec.name!r} {list(spec.shape)} scores {classes} "
                "classes; give one name per class, in class order"
            )
        activation = self.activation
        if activation is None:
            probs = sample_outputs is not None and _are_probabilities(sample_outputs.get(spec.name))
            activation = "none" if probs else "softmax"
            say(
                f"--postprocess topk: output {spec.name!r} "
                + ("already sums to 1: scores are its values" if probs else "is not probabilities: softmax first")
                + " (set activation= to choose)"
            )
        steps = [] if activation == "none" else [ProcessingStep(op=activation, tensor=spec.name, axis=-1)]
        steps.append(ProcessingStep(op="topk", tensor=spec.name, k=k, axis=-1, labels_file=labels_file))
        return tuple(steps)

    def _output(self, served: Signature) -> TensorSpec:
        names = [o.name for o in served.outputs]
        name = self.output or names[0]
        for o in served.outputs:
            if o.name == name:
                return o
        raise ConfigError(f"--postprocess output={name}: the model's outputs are {', '.join(names)}")


def read_labels_file(path: str | Path) -> tuple[str, ...]:
    """One class name per line; refuses an empty file or an empty line (a shifted class index)."""
    from device_agents.processing.post import read_labels

    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"--labels-file {path}: cannot be read ({exc})") from exc
    try:
        return read_labels(data, f"--labels-file {path}")
    except ManifestError as exc:  # the device's word for a bad bundle file: here it is the user's file
        raise ConfigError(str(exc)) from exc


def _yolo_axis(spec: TensorSpec, labels: tuple[str, ...] | None) -> int:
    shape = spec.shape
    if len(shape) != 3:
        raise ConfigError(
            f"--postprocess boxes=yolo reads [1, 4+C, N] or [1, N, 4+C]; output {spec.name!r} is {list(shape)}"
        )
    fits = [a for a in (1, 2) if isinstance(shape[a], int) and int(shape[a]) > 4]
    if labels is not None:
        fits = [a for a in fits if shape[a] == 4 + len(labels)]
        if not fits:
            raise ConfigError(
                f"--labels-file: {len(labels)} labels, but output {spec.name!r} {list(shape)} has no axis of "
                f"4 + {len(labels)} = {4 + len(labels)} values"
            )
    if len(fits) == 2:  # both could be 4 + C: the smaller one, as detectors have more anchors than classes
        a, b = (int(shape[1]), int(shape[2]))
        if a == b:
            raise ConfigError(
                f"--postprocess boxes=yolo: output {spec.name!r} {list(shape)} could be either layout; give "
                "--labels-file so that the class count decides"
            )
        return 1 if a < b else 2
    if not fits:
        raise ConfigError(
            f"--postprocess boxes=yolo: output {spec.name!r} {list(shape)} has no fixed axis of 4 + C values"
        )
    return fits[0]


def _class_count(spec: TensorSpec) -> int | None:
    count = 1
    for d in spec.shape[1:]:
        if not isinstance(d, int):
            return None
        count *= d
    return count


def _are_probabilities(values: np.ndarray | None) -> bool:
    if values is None or values.size == 0:
        return False
    rows = np.asarray(values, np.float64).reshape(values.shape[0], -1)
    return bool(rows.min() >= 0 and rows.max() <= 1 and np.allclose(rows.sum(axis=1), 1.0, atol=1e-3))


def _parse_value(key: str, raw: str) -> Any:
    try:
        if key == "boxes":
            if raw.lower() != "yolo":
                raise ConfigError(f"--postprocess boxes={raw}: choose from yolo")
            return "yolo"
        if key in ("topk", "max"):
            return int(raw)
        if key in ("score", "iou"):
            return float(raw)
    except ValueError:
        example = {"topk": "5", "max": "300", "score": "0.25", "iou": "0.45"}[key]
        raise ConfigError(f"--postprocess {key}={raw}: expected a value such as {key}={example}") from None
    if key == "output":
        return raw
    for choice in _ACTIVATIONS:
        if raw.lower() == choice:
            return choice
    near = difflib.get_close_matches(raw, _ACTIVATIONS, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else ""
    raise ConfigError(f"--postprocess activation={raw}: choose from {', '.join(_ACTIVATIONS)}{hint}")
