"""``edgekit cascade plan SMALL.onnx LARGE.onnx --eval DATA --max-drop 0.005``: the confidence
threshold of a two-model cascade (the agent's ``[models.<name>.route]``) for a target accuracy.

Both models run on the labelled evaluation data (ONNX Runtime, FP32). A request escalates to the
large model when the small model's top-1 probability is below the threshold; the plan is the
lowest threshold (the fewest escalations) whose cascade top-1 is within ``max_drop`` of the
large model's alone, with the escalation rate it implies. A classifier's first output is read as
scores; one that does not sum to 1 gets a softmax first (as the agent's ``topk`` does).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.errors import ConfigError


@dataclass(frozen=True)
class CascadePlan:
    threshold: float
    escalation_rate: float
    samples: int
    small_top1: float
    large_top1: float
    cascade_top1: float
    max_drop: float

    def lines(self, name: str, small: str, large: str) -> list[str]:
        drop = (self.large_top1 - self.cascade_top1) * 100
        return [
            f"{self.samples} samples: small top-1 {self.small_top1:.1%}, large top-1 {self.large_top1:.1%}, "
            f"cascade top-1 {self.cascade_top1:.1%} ({drop:.2f} pt below large, budget {self.max_drop * 100:.2f} pt)",
            f"threshold {self.threshold:.4f}: {self.escalation_rate:.1%} of requests escalate to {large}",
            "",
            f"[models.{name}.route]",
            f'members = ["{small}", "{large}"]',
            f"threshold = {self.threshold:.4f}",
        ]


def top1_scores(outputs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(predicted class, its probability) per sample of a classifier's output [N, ...classes]."""
    rows = outputs.reshape(outputs.shape[0], -1).astype(np.float64)
    if not (rows.min() >= 0 and rows.max() <= 1 and np.allclose(rows.sum(axis=1), 1.0, atol=1e-3)):
        rows = np.exp(rows - rows.max(axis=1, keepdims=True))
        rows /= rows.sum(axis=1, keepdims=True)
    return rows.argmax(axis=1), rows.max(axis=1)


def choose_threshold(
    confidence: np.ndarray, small_right: np.ndarray, large_right: np.ndarray, max_drop: float
) -> tuple[float, float, float]:
    """(threshold, escalation rate, cascade top-1): the fewest escalations meeting the budget.
    Samples escalate in order of rising confidence; all of them escalating is the large model."""
    n = len(confidence)
    order = np.argsort(confidence, kind="stable")
    conf = confidence[order]
    # escalating the k least confident: large's answers for them, small's for the rest
    large_first = np.concatenate([[0], np.cumsum(large_right[order])])
    small_rest = np.concatenate([np.cumsum(small_right[order][::-1])[::-1], [0]])
    accuracy = (large_first + small_rest) / n
    target = large_right.mean() - max_drop
    for k in range(n + 1):
        if k < n and k > 0 and conf[k] == conf[k - 1]:
            continue  # a threshold cannot split equal confidences
        if accuracy[k] >= target - 1e-12:
            threshold = 0.0 if k == 0 else (1.0 if k == n else float((conf[k - 1] + conf[k]) / 2))
            return threshold, k / n, float(accuracy[k])
    return 1.0, 1.0, float(accuracy[n])


def plan(
    small: Path, large: Path, eval_data: str | Path, labels: str | Path | None = None, max_drop: float = 0.005
) -> CascadePlan:
    import onnx

    from edgekit.compress.signature import served_signature
    from edgekit.validate.calib import check_arrays, load_data, pop_labels
    from edgekit.validate.metrics import run_all
    from edgekit.validate.ort_runner import ort_cpu_runner

    if not 0 <= max_drop <= 1:
        raise ConfigError(f"--max-drop must be in [0, 1] (0.005 = half a point of top-1), got {max_drop}")
    served = served_signature(onnx.load(str(small), load_external_data=False))
    other = served_signature(onnx.load(str(large), load_external_data=False))
    if [s.name for s in served.inputs] != [s.name for s in other.inputs]:
        raise ConfigError(
            f"{large} takes {[s.name for s in other.inputs]}, {small} {[s.name for s in served.inputs]}: a cascade's "
            "members take the same inputs"
        )
    arrays = load_data(eval_data, served, "evaluation data")
    inline = pop_labels(arrays, served)
    truth = np.load(labels) if labels is not None else inline
    if truth is None:
        raise ConfigError("cascade plan: the evaluation data needs labels (a 'labels' array, or --labels L.npy)")
    arrays = check_arrays(arrays, served, "evaluation data")
    truth = np.asarray(truth).reshape(-1)
    outputs = {}
    for which, path in (("small", small), ("large", large)):
        got = run_all(ort_cpu_runner(path), arrays, 1)
        outputs[which] = top1_scores(next(iter(got.values())))
    if len(truth) != len(outputs["small"][0]):
        raise ConfigError(f"cascade plan: {len(truth)} labels for {len(outputs['small'][0])} samples")
    small_right = outputs["small"][0] == truth
    large_right = outputs["large"][0] == truth
    threshold, rate, accuracy = choose_threshold(outputs["small"][1], small_right, large_right, max_drop)
    return CascadePlan(
        threshold=threshold,
        escalation_rate=rate,
        samples=len(truth),
        small_top1=float(small_right.mean()),
        large_top1=float(large_right.mean()),
        cascade_top1=accuracy,
        max_drop=max_drop,
    )


def register(sub: Any) -> None:
    cascade = sub.add_parser("cascade", help="plan a cascade of a small and a large model for the agent")
    commands = cascade.add_subparsers(dest="cascade_command", required=True)
    p = commands.add_parser(
        "plan",
        help="the small model's confidence threshold for a target accuracy, and the escalation rate it gives",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("small", type=Path, metavar="SMALL.onnx")
    p.add_argument("large", type=Path, metavar="LARGE.onnx")
    p.add_argument(
        "--eval", required=True, metavar="DATA", help="labelled evaluation data (.npz with 'labels', or images)"
    )
    p.add_argument("--labels", type=Path, metavar="LABELS.npy", help="class index per evaluation sample")
    p.add_argument("--max-drop", type=float, default=0.005, metavar="D", help="allowed top-1 drop vs the large model")
    p.add_argument("--name", default="cascade", help="the cascade's served name in the printed [models.NAME.route]")
    p.set_defaults(func=_plan_command)


def _plan_command(args: argparse.Namespace) -> int:
    result = plan(args.small, args.large, args.eval, args.labels, args.max_drop)
    print("\n".join(result.lines(args.name, args.small.stem, args.large.stem)))
    return 0
