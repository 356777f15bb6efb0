"""Numerical comparison of an artifact's outputs with the FP32 source model's, and the gate.

Classifiers (first output is one 1-D score vector per sample, i.e. rank 2) are judged by top-1
agreement with FP32 and, with labels, by the drop in top-1 accuracy (with its paired 95 % interval,
``paired_drop_interval``). A model that compression steps changed is judged by its accuracy alone
where labels are given (``compressed_gate``). Dense outputs (maps, boxes,
embeddings) are judged by the mean per-sample cosine similarity and the relative error
``mean|a - b| / mean|b|``, and, for outputs of rank >= 3, by the worst live channel's cosine (one
value scale per channel: a YOLO head concatenating boxes in pixels with scores in 0-1 under one
int8 scale keeps a global cosine near 1 while every score is 0; a channel that never fires,
``LIVE_FLOOR``, does not count). Every measure is recorded; only
the ones for the kind gate.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from edgekit.bundle.manifest import Signature, TensorSpec, Tolerance
from edgekit.errors import ConfigError
from edgekit.validate.calib import iter_batches, pad_samples, sample_count

Kind = Literal["classifier", "dense"]
# What an output is, which decides how it is judged: ``classify`` (top-1 agreement, the first
# output), ``regress`` (its own relative error: a score's cosine across samples says nothing, its
# top-1 over three MOS-like scores is noise), ``embed``/``detect``/``segment`` (the dense gate).
Task = Literal["classify", "regress", "embed", "detect", "segment"]
TASKS: tuple[str, ...] = ("classify", "regress", "embed", "detect", "segment")
REGRESS_MAX_COLUMNS = 4  # at most this many unbounded values per sample, not probabilities: regression
RunFn = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]
SAMPLE_CHUNK = 16  # samples compared in float64 at a time: a detector's or segmenter's outputs are large
# The measures a Comparison shares with the manifest's Validation, by the same names.
MEASURES = (
    "top1_agreement",
    "top1_accuracy",
    "fp32_top1_accuracy",
    "cosine",
    "channel_cosine",
    "relative_error",
    "max_abs_error",
    "mean_abs_error",
)


@dataclass(frozen=True)
class Comparison:
    """What ``compare`` measured, and why the gate failed (empty ``failures`` = passed)."""

    kind: Kind
    samples: int
    tolerance: Tolerance
    top1_agreement: float | None = None
    top1_accuracy: float | None = None
    fp32_top1_accuracy: float | None = None
    cosine: float | None = None
    channel_cosine: float | None = None
    relative_error: float | None = None
    max_abs_error: float | None = None
    mean_abs_error: float | None = None
    failures: tuple[str, ...] = ()
    # classifiers, at selection only (``edgekit.optimize.flip_risk``): top-1 agreement predicted on
    # inputs as close to the decision boundary as the gate's; not a manifest measure
    predicted_top1_agreement: float | None = None
    # detectors with a boxes post-processing (``validate.detections``): what the client receives;
    # and recognised heads' decoded outputs without one (``validate.heads``)
    detections: str | None = None
    # the outputs judged by what they decode to: their worst channel does not gate (nor bound a margin)
    decoded: tuple[str, ...] = ()
    # per output judged by its detections, per sample: (matched, fp32's, the candidate's) detections
    # (``optimize.margin`` bounds the F1's sampling error with them)
    detection_counts: tuple[tuple[str, tuple[tuple[int, int, int], ...]], ...] = ()
    # the task measures of decoded outputs: (output, measure, value, met the gate), measure being
    # ``validate.heads.DETECTION_F1`` or ``MASK_IOU``
    task_measures: tuple[tuple[str, str, float, bool], ...] = ()
    # outputs whose worst channel was taken on another axis than ``channel_axis``'s (a vector per
    # token: its hidden units), for the margin's bootstrap to take the same
    channel_axes: tuple[tuple[str, int], ...] = ()
    # classifiers with labels: the top-1 accuracy drop's paired 95 % interval (``paired_drop_interval``),
    # and the discordant samples it comes from: (fp32 right and this wrong, the reverse)
    top1_drop_interval: tuple[float, float] | None = None
    discordant: tuple[int, int] | None = None

    @property
    def passed(self) -> bool:
        return not self.failures

    def drop_text(self) -> str:
        """The accuracy drop with its paired interval in one line, or "" without labels."""
        if self.top1_accuracy is None or self.fp32_top1_accuracy is None or self.top1_drop_interval is None:
            return ""
        low, high = self.top1_drop_interval
        worse, better = self.discordant or (0, 0)
        return (
            f"top-1 accuracy {self.top1_accuracy:.3f} vs the original's {self.fp32_top1_accuracy:.3f} on "
            f"{self.samples} labelled samples: drop {self.fp32_top1_accuracy - self.top1_accuracy:+.3f}, paired 95 % "
            f"interval {low:+.3f} to {high:+.3f} ({worse} samples only the original got right, {better} only this)"
        )

    def summary(self) -> str:
        """One line, e.g. ``top-1 agreement 0.990`` or ``cosine 0.9981``."""
        if self.kind == "classifier" and self.top1_agreement is not None:
            text = f"top-1 agreement {self.top1_agreement:.3f}"
            if self.predicted_top1_agreement is not None and self.predicted_top1_agreement < self.top1_agreement:
                text += f", predicted on held-out-like inputs {self.predicted_top1_agreement:.3f}"
            if self.top1_accuracy is not None and self.fp32_top1_accuracy is not None:
                text += f", accuracy {self.top1_accuracy:.3f} (fp32 {self.fp32_top1_accuracy:.3f}"
                if self.top1_drop_interval is not None:
                    low, high = self.top1_drop_interval
                    drop = self.fp32_top1_accuracy - self.top1_accuracy
                    text += f"; drop {drop:+.3f}, 95 % {low:+.3f} to {high:+.3f}"
                text += ")"
            return text
        text = f"cosine {self.cosine:.4f}, relative error {self.relative_error:.4f}"
        if self.channel_cosine is not None:
            text += f", worst channel cosine {self.channel_cosine:.4f}"
        if self.detections is not None:
            text += f", {self.detections}"
        return text


def output_kind(served: Signature) -> Kind:
    """``classifier`` when the first output is one score vector per sample (rank 2, >1 class)."""
    first = served.outputs[0]
    if len(first.shape) == 2 and not (isinstance(first.shape[1], int) and first.shape[1] < 2):
        return "classifier"
    return "dense"


def run_all(fn: RunFn, arrays: Mapping[str, np.ndarray], batch: int = 1, pad: bool = False) -> dict[str, np.ndarray]:
    """Run ``fn`` over every sample, ``batch`` at a time; outputs concatenated on axis 0.

    ``pad``: ``fn`` takes exactly ``batch`` samples (a static batch), so a short last batch is
    padded with copies of its last sample and the padding's outputs are dropped."""
    parts: dict[str, list[np.ndarray]] = {}
    for feed in iter_batches(arrays, batch):
        n = sample_count(feed)
        short = pad and n < batch
        for name, value in fn(pad_samples(feed, batch) if short else feed).items():
            parts.setdefault(name, []).append(np.asarray(value)[:n] if short else np.asarray(value))
    return {name: np.concatenate(values, axis=0) for name, values in parts.items()}


def parse_tasks(given: str | Mapping[str, str] | None, outputs: list[str]) -> dict[str, str]:
    """``--task``: one task for every output (``regress``), or ``OUTPUT=TASK`` items, comma-separated
    or a mapping; checked against ``TASKS`` and the model's output names."""
    if given is None or given == "" or given == {}:
        return {}
    items: dict[str, str] = {}
    if isinstance(given, str):
        for part in (p.strip() for p in given.split(",") if p.strip()):
            name, sep, task = part.rpartition("=")
            if not sep:
                items.update({o: task for o in outputs})
            else:
                items[name.strip()] = task.strip()
    else:
        items = {str(k): str(v) for k, v in given.items()}
    for name, task in items.items():
        if task not in TASKS:
            raise ConfigError(f"--task {name}={task}: choose one of {', '.join(TASKS)}")
        if name not in outputs:
            near = difflib.get_close_matches(name, outputs, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(
                f"--task {name}={task}: the model has no output {name!r} (outputs: {', '.join(outputs)}){hint}"
            )
    return items


def output_tasks(
    served: Signature, reference: Mapping[str, np.ndarray], given: Mapping[str, str] | None = None
) -> tuple[dict[str, str], tuple[str, ...]]:
    """Each output's task (``given`` where named, else from its shape and the FP32 values in
    ``reference``) and one note per output naming the gate used and why:

    - one value per sample (``[N]``, ``[N, 1]``): regress;
    - ``[N, C]`` rows that are probabilities (in [0, 1], summing to 1): classify; of unit L2 norm:
      embed; at most ``REGRESS_MAX_COLUMNS`` other values: regress; more: classify (scores);
    - rank 3 whose axis 1 is an integer input's sequence axis (a transformer's hidden states,
      ``[N, T, H]`` from token ids ``[N, T]``): embed, a vector per token; other rank 3 (per
      anchor): detect; rank 4 and up (maps): segment;
    - a YOLO-style head or a DBNet-style map (``validate.heads``): ``detect:yolo`` /
      ``segment:dbnet``, judged by what it decodes to."""
    from edgekit.validate.heads import base_task, recognise
    from edgekit.validate.heads import gate_text as head_gate_text

    given = dict(given or {})
    tasks: dict[str, str] = {}
    notes: list[str] = []
    for spec in served.outputs:
        values = np.asarray(reference[spec.name]) if spec.name in reference else None
        shape = tuple(values.shape) if values is not None else tuple(spec.shape)
        head = recognise(values, served.inputs) if values is not None and spec.name not in given else None
        if spec.name in given:
            task, why = given[spec.name], "given by --task"
        elif head is not None:
            task, why = head
        else:
            task, why = _per_token(spec, served.inputs) or _infer_task(shape, values)
        tasks[spec.name] = task
        how = head_gate_text(task) if head is not None else _gate_text(task, spec.name == served.outputs[0].name)
        notes.append(f"gate: output {spec.name!r} judged as {base_task(task)} ({how}); {why}")
    return tasks, tuple(notes)


def kind_of(tasks: Mapping[str, str], served: Signature) -> Kind:
    """The gate's kind: a classifier when the first output is class scores."""
    return "classifier" if tasks.get(served.outputs[0].name) == "classify" else "dense"


def _per_token(spec: TensorSpec, inputs: Sequence[TensorSpec]) -> tuple[str, str] | None:
    """("embed", why) for a rank-3 output whose axis 1 is the sequence axis of a rank-2 integer
    input (the same named dim, or the same fixed size), else None."""
    if len(spec.shape) != 3:
        return None
    for inp in inputs:
        if len(inp.shape) == 2 and inp.dtype.startswith(("int", "uint")) and inp.shape[1] == spec.shape[1]:
            return "embed", (
                f"a vector per token (shape {list(spec.shape)}: axis 1 is input {inp.name!r}'s sequence axis)"
            )
    return None


def _infer_task(shape: tuple[Any, ...], values: np.ndarray | None) -> tuple[str, str]:
    if len(shape) <= 1 or (len(shape) == 2 and shape[1] == 1):
        return "regress", f"one value per sample (shape {list(shape)})"
    if len(shape) == 2:
        if values is not None and values.size:
            rows = values.reshape(len(values), -1).astype(np.float64)
            if rows.min() >= -1e-6 and rows.max() <= 1 + 1e-6 and np.allclose(rows.sum(axis=1), 1.0, atol=1e-3):
                return "classify", "its rows are probabilities (in [0, 1], summing to 1)"
            if np.allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-3):
                return "embed", "its rows have unit L2 norm"
            if isinstance(shape[1], int) and shape[1] <= REGRESS_MAX_COLUMNS:
                return "regress", (
                    f"{shape[1]} values per sample that are not probabilities (<= {REGRESS_MAX_COLUMNS}: regression)"
                )
        return "classify", f"a score vector per sample (shape {list(shape)})"
    if len(shape) == 3:
        return "detect", f"values per anchor (shape {list(shape)})"
    return "segment", f"a map per sample (shape {list(shape)})"


def _gate_text(task: str, first: bool) -> str:
    if task == "classify":
        return "top-1 agreement with fp32" if first else "recorded; the first output's top-1 gates"
    if task == "regress":
        return "its relative error to fp32"
    return "mean cosine, relative error and the worst live channel's cosine"


def compare(
    reference: Mapping[str, np.ndarray],
    candidate: Mapping[str, np.ndarray],
    kind: Kind,
    tolerance: Tolerance,
    labels: np.ndarray | None = None,
    tasks: Mapping[str, str] | None = None,
    post: Any = None,
) -> Comparison:
    """Compare ``candidate`` outputs with FP32 ``reference`` outputs (same names, samples on axis 0).
    ``tasks`` (``output_tasks``): a ``regress`` output is judged by its own relative error, and left
    out of the cosine and worst-channel measures. ``post``: the bundle's post-processing (a
    ``device_agents.processing.post.Postprocessor``); where it ends in ``boxes``, its output is
    judged by the detections (``validate.detections``), not by its worst channel."""
    from edgekit.validate.detections import DETECTION_MIN_F1, boxes_post, detection_agreement
    from edgekit.validate.heads import DETECTION_F1, check_heads

    detected = detection_agreement(reference, candidate, post) if boxes_post(post) else None
    heads = check_heads(reference, candidate, tasks, skip=post.tensor if detected is not None else None)
    decoded = {h.output for h in heads}
    names = list(reference)
    missing = [n for n in names if n not in candidate]
    if missing:
        raise ValueError(f"candidate outputs lack {missing[0]!r}")
    ref0, cand0 = reference[names[0]], candidate[names[0]]
    samples = int(ref0.shape[0])
    cosines, abs_err, ref_abs, max_abs = [], [], [], 0.0
    worst: tuple[float, str, int] | None = None  # (cosine, output, channel)
    regressed: list[str] = []  # regression outputs over the relative error
    dense_cosines: list[float] = []
    axes: list[tuple[str, int]] = []  # outputs whose channel axis is not ``channel_axis``'s
    dense_err: list[tuple[float, float]] = []  # (mean |a - b|, mean |b|) of the outputs the dense gate judges
    for n in names:
        if reference[n].reshape(samples, -1).shape != candidate[n].reshape(samples, -1).shape:
            raise ValueError(f"output {n!r}: candidate shape {list(candidate[n].shape)} != {list(reference[n].shape)}")
        # SAMPLE_CHUNK samples in float64 at a time: the whole output in float64, with its
        # difference and products, was ~7x the float32 outputs (2.8 GB for 50 samples of a 512² map)
        cos_rows, err_rows, ref_rows, peak_rows = per_sample(reference[n], candidate[n])
        values_per_sample = max(int(np.prod(reference[n].shape[1:], dtype=np.int64)), 1)
        cosines.append(float(np.mean(cos_rows)))
        abs_err.append(float(err_rows.sum()) / (samples * values_per_sample) if samples else float("nan"))
        ref_abs.append(float(ref_rows.sum()) / (samples * values_per_sample) if samples else float("nan"))
        max_abs = max(max_abs, float(peak_rows.max(initial=0.0)))
        if tasks is not None and tasks.get(n) == "regress":
            own = float(abs_err[-1] / max(ref_abs[-1], 1e-12))
            limit = tolerance.max_relative_error
            if limit is not None and own > limit:
                regressed.append(_short(f"output {n!r} (regression) relative error to fp32", own, limit, "<="))
            continue
        dense_cosines.append(cosines[-1])
        dense_err.append((abs_err[-1], ref_abs[-1]))
        if (detected is not None and n == post.tensor) or n in decoded:
            continue  # the detections judge it: a channel that never fires cannot veto them
        # a vector per token: its channels are the hidden units (last axis), not the token positions
        hidden = np.ndim(reference[n]) - 1 if tasks is not None and tasks.get(n) == "embed" else None
        if hidden is not None:
            axes.append((n, hidden))
        found = worst_channel(reference[n], candidate[n], hidden)
        if found is not None and (worst is None or found[0] < worst[0]):
            worst = (found[0], n, found[1])
    cosine = min(dense_cosines or cosines)
    mean_abs = float(np.mean(abs_err))
    relative = float(np.mean(abs_err) / max(float(np.mean(ref_abs)), 1e-12))
    values: dict[str, Any] = {
        "channel_axes": tuple(axes),
        "cosine": cosine,
        "relative_error": relative,
        "max_abs_error": max_abs,
        "mean_abs_error": mean_abs,
        "channel_cosine": None if worst is None else worst[0],
    }
    failures: list[str] = []
    t = tolerance
    if kind == "classifier":
        ref_top, cand_top = ref0.reshape(samples, -1).argmax(-1), cand0.reshape(samples, -1).argmax(-1)
        agreement = float(np.mean(ref_top == cand_top))
        values["top1_agreement"] = agreement
        if t.min_top1_agreement is not None and agreement < t.min_top1_agreement:
            failures.append(_short("top-1 agreement with fp32", agreement, t.min_top1_agreement, ">="))
        if labels is not None:
            ref_right, cand_right = ref_top == labels, cand_top == labels
            acc, fp32_acc = float(np.mean(cand_right)), float(np.mean(ref_right))
            values.update(top1_accuracy=acc, fp32_top1_accuracy=fp32_acc)
            if samples:
                values["top1_drop_interval"] = paired_drop_interval(ref_right, cand_right)
                values["discordant"] = (int(np.sum(ref_right & ~cand_right)), int(np.sum(~ref_right & cand_right)))
            drop = fp32_acc - acc
            if t.max_top1_drop is not None and drop > t.max_top1_drop:
                failures.append(
                    f"top-1 accuracy dropped {drop:.3f} (from {fp32_acc:.3f} to {acc:.3f}), over the allowed "
                    f"{t.max_top1_drop:.3f} by {drop - t.max_top1_drop:.3f}"
                )
    elif dense_cosines or tasks is None:
        if t.min_cosine is not None and cosine < t.min_cosine:
            failures.append(_short("mean cosine to fp32", cosine, t.min_cosine, ">="))
        judged = relative
        if tasks is not None and dense_err:  # the outputs the dense gate judges (regression ones: above)
            judged = float(np.mean([e for e, _ in dense_err]) / max(float(np.mean([r for _, r in dense_err])), 1e-12))
        if t.max_relative_error is not None and judged > t.max_relative_error:
            failures.append(_short("relative error to fp32", judged, t.max_relative_error, "<="))
        if t.min_channel_cosine is not None and worst is not None and worst[0] < t.min_channel_cosine:
            failures.append(
                f"output {worst[1]!r} channel {worst[2]} cosine {worst[0]:.2f} (< {t.min_channel_cosine:.4g}): the "
                "output mixes value scales (e.g. boxes in pixels with scores in 0-1) and one quantization scale "
                "crushed the small ones; keep the head in float (--precision auto / --mixed-precision) or normalize "
                "before the concat"
            )
    failures += regressed
    failures += [h.failure for h in heads if h.failure is not None]
    judged_by = [detected.text()] if detected is not None else []
    if judged_by or heads:
        values["detections"] = "; ".join(judged_by + [h.text for h in heads])
        values["decoded"] = (*([post.tensor] if detected is not None else []), *decoded)
        values["detection_counts"] = (
            *([(post.tensor, detected.per_sample)] if detected is not None else []),
            *((h.output, h.detection_counts) for h in heads if h.detection_counts),
        )
        values["task_measures"] = (
            *([(post.tensor, DETECTION_F1, detected.f1, detected.f1 >= DETECTION_MIN_F1)] if detected else []),
            *((h.output, h.measure, h.value, h.failure is None) for h in heads if h.value is not None),
        )
    if detected is not None:
        if detected.f1 < DETECTION_MIN_F1:
            failures.append(
                f"{detected.text()}, needs F1 >= {DETECTION_MIN_F1:g}: the detections after the post-processing "
                "differ from fp32's"
            )
    return Comparison(kind=kind, samples=samples, tolerance=tolerance, failures=tuple(failures), **values)


Z_95 = 1.959964  # two-sided 95 %


def paired_difference_interval(both: int, only_first: int, only_second: int, neither: int) -> tuple[float, float]:
    """95 % interval for ``p1 - p2``, two proportions measured on the same samples (``p1 = (both +
    only_first) / n``): Newcombe's hybrid score interval (method 10, Stat. Med. 1998;17:2635), each
    proportion's Wilson interval combined with the pairs' (continuity-corrected) correlation. It
    stays inside [-1, 1] and does not collapse to a point when the discordant counts are small, as
    the Wald interval does. Only the discordant samples (``only_first``, ``only_second``) move the
    estimate."""
    n = both + only_first + only_second + neither
    if min(both, only_first, only_second, neither) < 0 or n == 0:
        raise ValueError(f"paired counts must be >= 0 and not all 0, got {(both, only_first, only_second, neither)}")
    p1, p2 = (both + only_first) / n, (both + only_second) / n
    l1, u1 = _wilson(both + only_first, n)
    l2, u2 = _wilson(both + only_second, n)
    rows = (both + only_first) * (only_second + neither) * (both + only_second) * (only_first + neither)
    # the pairs' correlation, continuity-corrected where positive (Newcombe's convention)
    cross = float(both * neither - only_first * only_second)
    cross = cross - n / 2 if cross > n / 2 else min(cross, 0.0)
    phi = cross / math.sqrt(rows) if rows else 0.0
    below = math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    above = math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return max(-1.0, p1 - p2 - below), min(1.0, p1 - p2 + above)


def paired_drop_interval(reference_right: np.ndarray, candidate_right: np.ndarray) -> tuple[float, float]:
    """95 % interval for the top-1 accuracy drop (the reference's accuracy minus the candidate's) on
    the same labelled samples (``paired_difference_interval``); per sample, whether each got it right."""
    r, c = np.asarray(reference_right, dtype=bool), np.asarray(candidate_right, dtype=bool)
    counts = (r & c, r & ~c, ~r & c, ~r & ~c)
    both, only_reference, only_candidate, neither = (int(np.sum(x)) for x in counts)
    return paired_difference_interval(both, only_reference, only_candidate, neither)


def _wilson(successes: int, n: int) -> tuple[float, float]:
    p, z = successes / n, Z_95
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return max(0.0, (centre - spread) / (1 + z * z / n)), min(1.0, (centre + spread) / (1 + z * z / n))


def compressed_gate(tolerance: Tolerance, kind: Kind, labelled: bool, agreement_given: bool) -> tuple[Tolerance, str]:
    """The gate of a model that compression steps changed (pruned, factorised, distilled, sparsified,
    its weights shared), compared with the original, and one line saying which gate that is.

    Such a model was retrained or altered, not approximated: it may disagree with the original
    exactly where the original is unsure, and be right there more often. So a classifier with
    held-out labels is judged by its top-1 accuracy against the original's on the same samples
    (``max_top1_drop``); its agreement with the original is still measured and reported, but gates
    only where the user set ``min_top1_agreement`` (``agreement_given``). Without labels, or with
    ``max_top1_drop`` turned off, agreement gates as for any artifact. Dense outputs keep their gate."""
    if kind != "classifier":
        return tolerance, ""
    t = tolerance
    agreement = "agreement not gated (min_top1_agreement none)"
    if t.min_top1_agreement is not None:
        agreement = f"top-1 agreement with the original (>= {t.min_top1_agreement:.3f})"
    if not labelled:
        return t, (
            f"compressed classifier without labels: judged by {agreement}; give held-out labels to judge it by "
            "top-1 accuracy against the original's instead"
        )
    if t.max_top1_drop is None:
        return t, f"compressed classifier with labels, max_top1_drop none: judged by {agreement}"
    accuracy = f"top-1 accuracy against the original's (drop <= {t.max_top1_drop:.3f})"
    if agreement_given and t.min_top1_agreement is not None:
        return t, f"compressed classifier with labels: judged by {accuracy} and by {agreement}, as set"
    return dataclasses.replace(t, min_top1_agreement=None), (
        f"compressed classifier with labels: judged by {accuracy}; agreement with the original reported, not gated"
    )


def channel_axis(shape: tuple[int, ...]) -> int | None:
    """The channel axis of a dense output: axis 1 for rank >= 3, except rank 3 whose last axis is
    smaller than axis 1 (YOLOv5-style ``[1, anchors, 85]``): the last. None below rank 3."""
    if len(shape) < 3:
        return None
    if len(shape) == 3 and shape[2] < shape[1]:
        return 2
    return 1


# A channel counts in the worst-channel cosine only where its reference is live: its peak |value|
# at least this share of the tensor's peak |value|. Below it the channel never fires next to the
# tensor's other channels (YOLOv8n class scores that stay ~1e-3 next to boxes in 640 pixels: 2e-6;
# a class that fires at 0.9 is 1.4e-3, live) and its cosine is rounding noise, which must not veto a
# candidate that keeps everything else; a live channel crushed to 0 (cosine 0) still fails.
LIVE_FLOOR = 1e-4


def live_channels(reference: np.ndarray, axis: int) -> np.ndarray:
    """Per channel on ``axis``, whether the reference is live (``LIVE_FLOOR``)."""
    peak = np.abs(np.moveaxis(np.asarray(reference), axis, -1)).reshape(-1, reference.shape[axis]).max(axis=0)
    top = float(peak.max(initial=0.0))
    return np.asarray((peak > 0) & (peak >= LIVE_FLOOR * top))


def channel_cosines(reference: np.ndarray, candidate: np.ndarray, axis: int | None = None) -> np.ndarray | None:
    """Per channel (``axis``, default ``channel_axis``), the cosine over all samples and positions;
    NaN for a channel whose reference is not live (peak |value| 0 or below ``LIVE_FLOOR`` x the
    tensor's peak). None when the output has no channel axis."""
    axis = channel_axis(tuple(reference.shape)) if axis is None else axis
    if axis is None or reference.shape != candidate.shape:
        return None
    stats = ChannelStats()
    for start in range(0, reference.shape[0], SAMPLE_CHUNK):  # a few samples in float64 at a time
        stats.add(reference[start : start + SAMPLE_CHUNK], candidate[start : start + SAMPLE_CHUNK], axis)
    return stats.cosines()


def per_sample(r: np.ndarray, c: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per sample (axis 0): the cosine of candidate ``c`` to reference ``r``, sum |c - r|, sum |r|
    and max |c - r|; ``SAMPLE_CHUNK`` samples converted to float64 at a time."""
    n = r.shape[0]
    cos, err, ref_abs, peak = np.empty(n), np.empty(n), np.empty(n), np.empty(n)
    for start in range(0, n, SAMPLE_CHUNK):
        a = np.asarray(r[start : start + SAMPLE_CHUNK]).reshape(min(SAMPLE_CHUNK, n - start), -1).astype(np.float64)
        b = np.asarray(c[start : start + SAMPLE_CHUNK]).reshape(a.shape).astype(np.float64)
        cos[start : start + len(a)] = _cosine_rows(a, b)
        d = np.abs(a - b)
        err[start : start + len(a)] = d.sum(axis=1)
        peak[start : start + len(a)] = d.max(axis=1, initial=0.0)
        ref_abs[start : start + len(a)] = np.abs(a).sum(axis=1)
    return cos, err, ref_abs, peak


class ChannelStats:
    """Per-channel sums of one tensor's reference and candidate values, accumulated batch by
    batch (nothing is kept but four vectors): the gate's per-channel cosine and dead-channel rule
    (``channel_cosines``) and the global relative error, for callers that stream many tensors
    (the sensitivity rankers). ``axis=None``: the whole tensor is one channel."""

    def __init__(self) -> None:
        self.rr: np.ndarray | None = None  # sum of reference^2 per channel
        self.cc: np.ndarray | None = None
        self.rc: np.ndarray | None = None
        self.dd: np.ndarray | None = None  # sum of (candidate - reference)^2 per channel
        self.peak: np.ndarray | None = None  # max |reference| per channel
        self.count = 0  # values per channel
        self.per_channel = False

    def add(self, reference: np.ndarray, candidate: np.ndarray, axis: int | None) -> None:
        """Add one batch; a later batch must have the same channel count."""
        r = np.asarray(reference, dtype=np.float64)
        c = np.asarray(candidate, dtype=np.float64)
        if r.shape != c.shape:
            raise ValueError(f"candidate shape {list(c.shape)} != reference shape {list(r.shape)}")
        channels = r.shape[axis] if axis is not None else 1
        r = np.moveaxis(r, axis, -1).reshape(-1, channels) if axis is not None else r.reshape(-1, 1)
        c = np.moveaxis(c, axis, -1).reshape(-1, channels) if axis is not None else c.reshape(-1, 1)
        sums = (np.einsum("ij,ij->j", r, r), np.einsum("ij,ij->j", c, c), np.einsum("ij,ij->j", r, c))
        d = c - r
        dd = np.einsum("ij,ij->j", d, d)
        peak = np.abs(r).max(axis=0, initial=0.0)
        if self.rr is None or self.cc is None or self.rc is None or self.dd is None or self.peak is None:
            self.rr, self.cc, self.rc, self.dd, self.peak = (*sums, dd, peak)
        else:
            if len(self.rr) != channels:
                raise ValueError(f"a batch with {channels} channels after batches with {len(self.rr)}")
            self.rr, self.cc, self.rc, self.dd = self.rr + sums[0], self.cc + sums[1], self.rc + sums[2], self.dd + dd
            self.peak = np.maximum(self.peak, peak)
        self.count += r.shape[0]
        self.per_channel = axis is not None

    def cosines(self) -> np.ndarray | None:
        """Per channel, the cosine over everything added; NaN for a channel that is not live (as
        ``channel_cosines``)."""
        if self.rr is None or self.cc is None or self.rc is None or self.peak is None or not self.count:
            return None
        rms = np.sqrt(self.rr / self.count)
        top = float(self.peak.max(initial=0.0))
        dead = (rms == 0) | (rms < 1e-9 * float(rms.max(initial=0.0))) | (self.peak < LIVE_FLOOR * top)
        na, nb = np.sqrt(self.rr), np.sqrt(self.cc)
        both_zero = (na == 0) & (nb == 0)
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = self.rc / (na * nb)
        cos = np.where(both_zero, 1.0, np.nan_to_num(cos, nan=0.0))
        return np.where(dead, np.nan, cos)

    def relative_error(self) -> float:
        """||candidate - reference|| / ||reference|| over everything added (0 when nothing was)."""
        if self.rr is None or self.dd is None:
            return 0.0
        return float(np.sqrt(self.dd.sum()) / max(float(np.sqrt(self.rr.sum())), 1e-12))

    def channel_error(self) -> float | None:
        """The worst live channel's distance between its unit-normalized reference and candidate,
        ``sqrt(2 - 2 cos)``: on a relative error's scale (0.1 ~ 10 % off, 1.41 for a channel crushed
        to 0, 2 for one flipped). None without a channel axis or a live channel."""
        cos = self.cosines() if self.per_channel else None
        if cos is None or bool(np.all(np.isnan(cos))):
            return None
        return float(np.sqrt(max(0.0, 2.0 - 2.0 * float(np.nanmin(cos)))))

    def error(self) -> float:
        """What the sensitivity rankers score: the relative error, or the worst channel's error
        where that is larger (a crushed small channel hides in the global error)."""
        return max(self.relative_error(), self.channel_error() or 0.0)


def worst_channel(reference: np.ndarray, candidate: np.ndarray, axis: int | None = None) -> tuple[float, int] | None:
    """(cosine, channel index) of the worst live channel, or None (no channel axis, all dead);
    ``axis``: the channel axis where it is not ``channel_axis``'s."""
    cos = channel_cosines(reference, candidate, axis)
    if cos is None or bool(np.all(np.isnan(cos))):
        return None
    k = int(np.nanargmin(cos))
    return float(cos[k]), k


def _cosine_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    dot = np.sum(a * b, axis=1)
    both_zero = (na == 0) & (nb == 0)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = dot / (na * nb)
    return np.where(both_zero, 1.0, np.nan_to_num(cos, nan=0.0))


def _short(what: str, got: float, limit: float, op: str) -> str:
    return f"{what} {got:.4g}, needs {op} {limit:.4g} (off by {abs(got - limit):.4g})"


def tolerance_with(overrides: Tolerance | Mapping[str, Any] | None) -> Tolerance:
    """The default ``Tolerance`` with ``overrides`` applied; unknown keys name ``tolerance.KEY``."""
    if overrides is None:
        return Tolerance()
    if isinstance(overrides, Tolerance):
        return overrides
    fields = {f.name for f in dataclasses.fields(Tolerance)}
    values: dict[str, float | None] = {}
    for key, raw in overrides.items():
        if key not in fields:
            near = difflib.get_close_matches(key, fields, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ConfigError(f"tolerance.{key}: unknown key (known: {', '.join(sorted(fields))}){hint}")
        value = raw
        if isinstance(raw, str):
            value = None if raw.strip().lower() in ("none", "off", "") else _number(raw, key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0):
            raise ConfigError(f"tolerance.{key}: expected a number >= 0 or 'none', got {raw!r}")
        values[key] = None if value is None else float(value)
    return dataclasses.replace(Tolerance(), **values)


def parse_tolerance_args(items: list[str]) -> dict[str, str]:
    """``["min_cosine=0.9", "max_relative_error=none"]`` -> mapping (values checked later)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--tolerance {item!r}: expected KEY=VALUE such as min_cosine=0.95")
        out[key.strip()] = value.strip()
    return out


def _number(text: str, key: str) -> float:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"tolerance.{key}: expected a number >= 0 or 'none', got {text!r}")
    return float(value)
