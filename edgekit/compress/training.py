"""Knowledge distillation: train a student module to reproduce the original model (the teacher).

Used by distillation proper and as the fine-tuning after pruning and low-rank factorisation. The
teacher's outputs are computed once with ONNX Runtime on the ORIGINAL model (the exact function
the gate compares against). Loss, on the first output:

- class scores: ``alpha * CE(student, labels) + (1 - alpha) * T^2 * KL(softmax(teacher/T) || softmax(student/T))``;
  without labels the KL term alone (the teacher's soft labels are the targets);
- anything else (maps, boxes, embeddings, regression): mean squared error to the teacher.

A model that ends in a softmax (its outputs are probabilities) is distilled on ``log p`` as its
logits (``softmax(log p / T) = softmax(z / T)``), so the temperature softens its targets too.

Augmentation (``augment``, on by default where the teacher can be asked and the input is an
image batch ``[N, C, H, W]``): every batch is redrawn with small shifts, contrast and brightness
changes, noise and, without labels, mixes of two samples, and the teacher labels the redrawn
batch (ONNX Runtime on the original), so a few hundred samples teach like several thousand and
no labels are needed. Early stopping watches agreement on the held-out samples plus teacher-
labelled redrawn copies of them (more samples near the decision boundary), ties broken by the
divergence from the teacher: the best student state is kept; training stops after ``patience``
epochs without improvement.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import ConfigError


@dataclass(frozen=True)
class TrainSettings:
    epochs: int = 30
    batch_size: int = 64
    lr: float = 5e-4
    alpha: float = 0.5  # weight of the hard-label term; ignored without labels
    temperature: float = 4.0
    patience: int = 6
    seed: int = 0
    weight_decay: float = 1e-4
    augment: bool = True  # redraw image batches, labelled by the teacher (needs the teacher; 4-D float input)

    def __post_init__(self) -> None:
        if self.epochs < 0 or self.batch_size < 1 or not 0.0 <= self.alpha <= 1.0 or self.temperature <= 0:
            raise ConfigError(
                f"training settings out of range: epochs {self.epochs} (>= 0), batch_size {self.batch_size} (>= 1), "
                f"alpha {self.alpha} (0..1), temperature {self.temperature} (> 0)"
            )


@dataclass(frozen=True)
class TrainReport:
    epochs_run: int
    best_epoch: int
    metric: str  # "top1_agreement" or "mse"
    before: float  # on the evaluation split, before training
    best: float
    history: tuple[float, ...] = field(default_factory=tuple)


def teacher_session(model: Path, names: Sequence[str], batch: int = 64) -> Callable[[Sequence[np.ndarray]], np.ndarray]:
    """The ORIGINAL model's first output as a function of a batch of inputs (ONNX Runtime, CPU)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    first = session.get_outputs()[0].name

    def run(inputs: Sequence[np.ndarray]) -> np.ndarray:
        n = int(inputs[0].shape[0])
        parts = []
        for start in range(0, n, batch):
            feed = {name: np.ascontiguousarray(x[start : start + batch]) for name, x in zip(names, inputs, strict=True)}
            parts.append(np.asarray(session.run([first], feed)[0]))
        return np.concatenate(parts, axis=0)

    return run


def teacher_outputs(model: Path, inputs: Sequence[np.ndarray], names: Sequence[str], batch: int = 64) -> np.ndarray:
    """The ORIGINAL model's first output on ``inputs`` (ONNX Runtime, CPU)."""
    return teacher_session(model, names, batch)(inputs)


def is_class_scores(outputs: np.ndarray) -> bool:
    """One score vector per sample (rank 2, more than one class)."""
    return outputs.ndim == 2 and outputs.shape[1] > 1


def is_probabilities(outputs: np.ndarray) -> bool:
    """Class scores that are already probabilities (the model ends in a softmax): non-negative
    rows summing to 1."""
    return bool(is_class_scores(outputs) and outputs.min() >= 0 and np.allclose(outputs.sum(-1), 1.0, atol=1e-3))


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple | list) else out


def _predict(student: Any, inputs: Sequence[np.ndarray], batch: int = 128) -> np.ndarray:
    import torch

    student.eval()
    preds = []
    with torch.no_grad():
        for start in range(0, int(inputs[0].shape[0]), batch):
            xs = [torch.from_numpy(np.ascontiguousarray(x[start : start + batch])) for x in inputs]
            preds.append(_first(student(*xs)).float().numpy())
    return np.concatenate(preds, axis=0)


def _log_probs(scores: np.ndarray, probabilities: bool) -> np.ndarray:
    if probabilities:
        logs: np.ndarray = np.log(np.clip(scores, 1e-8, None))
        return logs
    shifted = scores - scores.max(-1, keepdims=True)
    out: np.ndarray = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    return out


def scores(student: Any, inputs: Sequence[np.ndarray], teacher: np.ndarray) -> tuple[float, float]:
    """(top-1 agreement with the teacher, KL(teacher || student) per sample) for class scores;
    (-mean squared error, mean squared error) otherwise: the first is better when higher, the
    second breaks ties (lower is better)."""
    pred = _predict(student, inputs)
    if is_class_scores(teacher):
        probabilities = is_probabilities(teacher)
        lt, ls = _log_probs(teacher, probabilities), _log_probs(pred, probabilities)
        kl = float(np.mean(np.sum(np.exp(lt) * (lt - ls), axis=-1)))
        return float(np.mean(pred.argmax(-1) == teacher.argmax(-1))), kl
    mse = float(np.mean((pred.reshape(teacher.shape) - teacher) ** 2))
    return -mse, mse


def evaluate(student: Any, inputs: Sequence[np.ndarray], teacher: np.ndarray, batch: int = 128) -> float:
    """Top-1 agreement with the teacher (class scores) or mean squared error (otherwise)."""
    pred = _predict(student, inputs, batch)
    if is_class_scores(teacher):
        return float(np.mean(pred.argmax(-1) == teacher.argmax(-1)))
    return float(np.mean((pred.reshape(teacher.shape) - teacher) ** 2))


Teacher = Callable[[Sequence[np.ndarray]], np.ndarray]


def augmentable(inputs: Sequence[np.ndarray]) -> bool:
    """One float image batch ``[N, C, H, W]``: what ``redraw`` knows how to vary."""
    return len(inputs) == 1 and inputs[0].ndim == 4 and np.issubdtype(inputs[0].dtype, np.floating)


def redraw(x: np.ndarray, rng: np.random.Generator, *, mix: bool) -> np.ndarray:
    """A varied copy of the image batch ``x`` [N, C, H, W]: each sample shifted by up to 1/16 of
    its height and width (edges repeated), its contrast and brightness changed by up to 25 % and
    15 % of its spread, with noise at 4 % of its spread; with ``mix``, a quarter of the samples
    blended (weight 0.6-1) with another sample of the batch. The teacher labels the result."""
    n, _, h, w = x.shape
    out = np.empty_like(x)
    dy_max, dx_max = max(1, h // 16), max(1, w // 16)
    padded = np.pad(x, ((0, 0), (0, 0), (dy_max, dy_max), (dx_max, dx_max)), mode="edge")
    for i in range(n):
        dy, dx = int(rng.integers(0, 2 * dy_max + 1)), int(rng.integers(0, 2 * dx_max + 1))
        out[i] = padded[i, :, dy : dy + h, dx : dx + w]
    mean = out.mean(axis=(1, 2, 3), keepdims=True)
    spread = out.std(axis=(1, 2, 3), keepdims=True) + 1e-6
    contrast = rng.uniform(0.75, 1.25, (n, 1, 1, 1))
    brightness = rng.uniform(-0.15, 0.15, (n, 1, 1, 1)) * spread
    out = (out - mean) * contrast + mean + brightness + rng.normal(0.0, 0.04, out.shape) * spread
    if mix and n > 1:
        blended = np.asarray(rng.random(n) < 0.25)
        weight = rng.uniform(0.6, 1.0, (n, 1, 1, 1))
        other = out[rng.permutation(n)]
        out = np.where(blended[:, None, None, None], weight * out + (1 - weight) * other, out)
    result: np.ndarray = out.astype(x.dtype)
    return result


def redrawn_copies(
    inputs: Sequence[np.ndarray], teacher: Teacher, copies: int, seed: int
) -> tuple[list[np.ndarray], np.ndarray]:
    """``inputs`` and ``copies`` redrawn versions of them (no mixing), with the teacher's outputs."""
    rng = np.random.default_rng(seed)
    x = inputs[0]
    stacked = np.concatenate([x] + [redraw(x, rng, mix=False) for _ in range(copies)], axis=0)
    return [stacked], teacher([stacked])


def distill(
    student: Any,
    inputs: Sequence[np.ndarray],
    teacher: np.ndarray,
    *,
    labels: np.ndarray | None,
    eval_inputs: Sequence[np.ndarray],
    eval_teacher: np.ndarray,
    settings: TrainSettings,
    progress: Callable[[str], None] | None = None,
    after_step: Callable[[], None] | None = None,
    teacher_fn: Teacher | None = None,
) -> TrainReport:
    """Train ``student`` in place towards ``teacher`` (and ``labels`` where given); keep its best state.

    ``teacher_fn`` (the original model on a batch) lets every batch be redrawn (``settings.augment``)
    and labelled afresh. ``after_step`` runs after every optimiser step (e.g. to re-apply a sparsity mask)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    classes = is_class_scores(teacher)
    # a model ending in a softmax: its outputs are probabilities, compared as log-probabilities
    probabilities = is_probabilities(teacher)
    metric = "top1_agreement" if classes else "mse"
    if labels is not None and len(labels) != len(teacher):
        raise ConfigError(f"{len(labels)} labels for {len(teacher)} training samples: give one label per sample")
    augment = settings.augment and teacher_fn is not None and augmentable(inputs)
    if augment and teacher_fn is not None:
        eval_inputs, eval_teacher = redrawn_copies(eval_inputs, teacher_fn, 3, settings.seed + 1)
    first = scores(student, eval_inputs, eval_teacher)
    before = best = first
    best_state, best_epoch, stale, history = copy.deepcopy(student.state_dict()), 0, 0, []
    optimizer = torch.optim.AdamW(student.parameters(), lr=settings.lr, weight_decay=settings.weight_decay)
    n = int(inputs[0].shape[0])
    # small data sets get smaller batches, so that an epoch still takes a few dozen steps
    batch = max(8, min(settings.batch_size, n // 20))
    steps = max(1, math.ceil(n / batch)) * max(settings.epochs, 1)
    # cosine decay from the full rate: a warm-up would spend the first epochs, which early
    # stopping judges, at a rate too small to move
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
    t = settings.temperature
    target = torch.from_numpy(teacher.astype(np.float32))
    hard = None if labels is None else torch.from_numpy(labels.astype(np.int64))
    epoch = 0
    for epoch in range(1, settings.epochs + 1):
        student.train()
        order = rng.permutation(n)
        for start in range(0, n, batch):
            idx = order[start : start + batch]
            arrays = [np.ascontiguousarray(x[idx]) for x in inputs]
            tgt = target[idx]
            if augment and teacher_fn is not None:
                arrays = [redraw(arrays[0], rng, mix=hard is None)]
                tgt = torch.from_numpy(np.asarray(teacher_fn(arrays), dtype=np.float32))
            out = _first(student(*[torch.from_numpy(x) for x in arrays])).float()
            if classes:
                if probabilities:  # log p as the logits: softmax(log p / T) = softmax(z / T)
                    logits, teacher_logits = torch.log(out.clamp_min(1e-8)), torch.log(tgt.clamp_min(1e-8))
                else:
                    logits, teacher_logits = out, tgt
                soft = (
                    F.kl_div(F.log_softmax(logits / t, -1), F.softmax(teacher_logits / t, -1), reduction="batchmean")
                    * t
                    * t
                )
                loss = (
                    soft
                    if hard is None
                    else settings.alpha * F.cross_entropy(logits, hard[idx]) + (1 - settings.alpha) * soft
                )
            else:
                loss = F.mse_loss(out.reshape(tgt.shape), tgt)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            optimizer.step()
            schedule.step()
            if after_step is not None:
                after_step()
        score = scores(student, eval_inputs, eval_teacher)
        history.append(_shown(score, classes))
        if progress is not None:
            progress(
                f"epoch {epoch}/{settings.epochs}: {metric} {_shown(score, classes):.4f} "
                f"(best {_shown(best, classes):.4f})"
            )
        if score[0] > best[0] or (score[0] == best[0] and score[1] < best[1]):
            best, best_epoch, stale = score, epoch, 0
            best_state = copy.deepcopy(student.state_dict())
        else:
            stale += 1
            if stale >= settings.patience and epoch >= settings.epochs // 3:
                break
    student.load_state_dict(best_state)
    student.eval()
    return TrainReport(epoch, best_epoch, metric, _shown(before, classes), _shown(best, classes), tuple(history))


def _shown(score: tuple[float, float], classes: bool) -> float:
    """The score as reported: agreement for class scores, the mean squared error otherwise."""
    return score[0] if classes else score[1]


__all__ = [
    "TrainReport",
    "TrainSettings",
    "augmentable",
    "distill",
    "evaluate",
    "is_class_scores",
    "redraw",
    "scores",
    "teacher_outputs",
    "teacher_session",
]
