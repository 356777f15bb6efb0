"""Knowledge distillation: train a student module to reproduce the original model (the teacher).

Used by distillation proper and as the fine-tuning after pruning and low-rank factorisation. The
teacher's outputs are computed once with ONNX Runtime on the ORIGINAL model (the exact function
the gate compares against). Loss, on the first output:

- class scores: ``alpha * CE(student, labels) + (1 - alpha) * T^2 * KL(softmax(teacher/T) || softmax(student/T))``;
  without labels the KL term alone (the teacher's soft labels are the targets);
- anything else (maps, boxes, embeddings, regression): mean squared error to the teacher.

Early stopping on the evaluation split: the student state with the best top-1 agreement with the
teacher (class scores) or the lowest error (otherwise) is kept; training stops after
``patience`` epochs without improvement.
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
    epochs: int = 12
    batch_size: int = 64
    lr: float = 2e-3
    alpha: float = 0.5  # weight of the hard-label term; ignored without labels
    temperature: float = 4.0
    patience: int = 4
    seed: int = 0
    weight_decay: float = 1e-4

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


def teacher_outputs(model: Path, inputs: Sequence[np.ndarray], names: Sequence[str], batch: int = 64) -> np.ndarray:
    """The ORIGINAL model's first output on ``inputs`` (ONNX Runtime, CPU)."""
    import onnxruntime as ort

    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    first = session.get_outputs()[0].name
    n = int(inputs[0].shape[0])
    parts = []
    for start in range(0, n, batch):
        feed = {name: np.ascontiguousarray(x[start : start + batch]) for name, x in zip(names, inputs, strict=True)}
        parts.append(np.asarray(session.run([first], feed)[0]))
    return np.concatenate(parts, axis=0)


def is_class_scores(outputs: np.ndarray) -> bool:
    """One score vector per sample (rank 2, more than one class)."""
    return outputs.ndim == 2 and outputs.shape[1] > 1


def is_probabilities(outputs: np.ndarray) -> bool:
    """Class scores that are already probabilities (the model ends in a softmax): non-negative
    rows summing to 1."""
    return bool(is_class_scores(outputs) and outputs.min() >= 0 and np.allclose(outputs.sum(-1), 1.0, atol=1e-3))


def _first(out: Any) -> Any:
    return out[0] if isinstance(out, tuple | list) else out


def evaluate(student: Any, inputs: Sequence[np.ndarray], teacher: np.ndarray, batch: int = 128) -> float:
    """Top-1 agreement with the teacher (class scores) or mean squared error (otherwise)."""
    import torch

    student.eval()
    preds = []
    with torch.no_grad():
        for start in range(0, int(inputs[0].shape[0]), batch):
            xs = [torch.from_numpy(np.ascontiguousarray(x[start : start + batch])) for x in inputs]
            preds.append(_first(student(*xs)).float().numpy())
    pred = np.concatenate(preds, axis=0)
    if is_class_scores(teacher):
        return float(np.mean(pred.argmax(-1) == teacher.argmax(-1)))
    return float(np.mean((pred.reshape(teacher.shape) - teacher) ** 2))


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
) -> TrainReport:
    """Train ``student`` in place towards ``teacher`` (and ``labels`` where given); keep its best state.

    ``after_step`` runs after every optimiser step (e.g. to re-apply a sparsity mask)."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(settings.seed)
    rng = np.random.default_rng(settings.seed)
    classes = is_class_scores(teacher)
    # a model ending in a softmax: its outputs are probabilities, compared as log-probabilities
    probabilities = is_probabilities(teacher)
    better: Callable[[float, float], bool] = (lambda a, b: a > b) if classes else (lambda a, b: a < b)
    metric = "top1_agreement" if classes else "mse"
    before = best = evaluate(student, eval_inputs, eval_teacher)
    best_state, best_epoch, stale, history = copy.deepcopy(student.state_dict()), 0, 0, []
    if labels is not None and len(labels) != len(teacher):
        raise ConfigError(f"{len(labels)} labels for {len(teacher)} training samples: give one label per sample")
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
            xs = [torch.from_numpy(np.ascontiguousarray(x[idx])) for x in inputs]
            out = _first(student(*xs)).float()
            tgt = target[idx]
            if probabilities:
                log_p = torch.log(out.clamp_min(1e-8))
                soft = F.kl_div(log_p, tgt, reduction="batchmean")
                loss = (
                    soft
                    if hard is None
                    else settings.alpha * F.nll_loss(log_p, hard[idx]) + (1 - settings.alpha) * soft
                )
            elif classes:
                soft = F.kl_div(F.log_softmax(out / t, -1), F.softmax(tgt / t, -1), reduction="batchmean") * t * t
                loss = (
                    soft
                    if hard is None
                    else settings.alpha * F.cross_entropy(out, hard[idx]) + (1 - settings.alpha) * soft
                )
            else:
                loss = F.mse_loss(out.reshape(tgt.shape), tgt)
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch's Tensor.backward is unannotated
            optimizer.step()
            schedule.step()
            if after_step is not None:
                after_step()
        score = evaluate(student, eval_inputs, eval_teacher)
        history.append(score)
        if progress is not None:
            progress(f"epoch {epoch}/{settings.epochs}: {metric} {score:.4f} (best {best:.4f})")
        if better(score, best) or (epoch == 1 and score == best):
            best, best_epoch, stale = score, epoch, 0
            best_state = copy.deepcopy(student.state_dict())
        else:
            stale += 1
            if stale >= settings.patience and epoch >= settings.epochs // 2:
                break
    student.load_state_dict(best_state)
    student.eval()
    return TrainReport(epoch, best_epoch, metric, before, best, tuple(history))


__all__ = ["TrainReport", "TrainSettings", "distill", "evaluate", "is_class_scores", "teacher_outputs"]
