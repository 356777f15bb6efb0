"""``edgekit compress``: prune, distil, factorise or share the weights of an ONNX model.

    edgekit compress MODEL.onnx --prune-channels 0.5 --train TRAIN.npz [--labels L.npy] --eval EVAL.npz -o OUT.onnx

The steps run in the order given on the command line; every one is measured against the
ORIGINAL model (size, ONNX Runtime latency on this host side by side, the gate on --eval) and
printed as one row; the exit code is 3 when the final model fails the gate. With --eval-labels a
classifier is judged by its top-1 accuracy against the original's (--max-drop), its agreement
with the original reported; without labels, by agreement with the original.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from edgekit.bundle.manifest import Tolerance
from edgekit.errors import CalibrationDataError, ConfigError

FAILED_GATE_EXIT = 3


class _StepAction(argparse.Action):
    """Collects the step flags into one list, in command-line order."""

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: str | None = None
    ) -> None:
        steps = list(getattr(namespace, "steps", None) or [])
        steps.append(f"{self.dest.replace('_', '-')}={values}")
        namespace.steps = steps


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compress",
        help="prune, distil, factorise or share the weights of MODEL (gated against the original)",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    p.add_argument("model", type=Path, metavar="MODEL.onnx")
    steps = p.add_argument_group("steps (in the order given; at least one)")
    steps.add_argument(
        "--prune-channels",
        action=_StepAction,
        metavar="FRACTION[:CRITERION]",
        help="remove this fraction of channels (criterion l1, l2 or taylor; default l1)",
    )
    steps.add_argument(
        "--sparsity",
        action=_StepAction,
        metavar="FRACTION|2:4",
        help="zero this fraction of weights (unstructured), or the 2:4 pattern",
    )
    steps.add_argument(
        "--distill",
        action=_StepAction,
        metavar="STUDENT",
        help="train a student: width=0.5 (the teacher, narrower), STUDENT.onnx or MODULE:FACTORY",
    )
    steps.add_argument(
        "--low-rank",
        action=_StepAction,
        metavar="FRACTION|energy=E",
        help="factorise Linear/Conv layers keeping this fraction of parameters (or energy)",
    )
    steps.add_argument("--share-weights", action=_StepAction, metavar="K", help="K shared values per weight tensor")
    p.add_argument("--train", type=Path, metavar="TRAIN.npz", help="training inputs (fine-tuning, distillation)")
    p.add_argument(
        "--labels", type=Path, metavar="LABELS.npy", help="training labels (optional: the teacher's outputs teach)"
    )
    p.add_argument("--eval", type=Path, required=True, metavar="EVAL.npz", help="held-out inputs the gate compares on")
    p.add_argument(
        "--eval-labels",
        type=Path,
        metavar="LABELS.npy",
        help="held-out labels: a classifier is then judged by its top-1 accuracy against the original's",
    )
    p.add_argument(
        "--max-drop",
        type=float,
        metavar="D",
        help="with --eval-labels, the allowed top-1 accuracy drop from the original's (default 0.01 = one point)",
    )
    p.add_argument(
        "--epochs", type=int, default=30, help="fine-tuning / distillation epochs, at most (early stopping; default 30)"
    )
    p.add_argument("--lr", type=float, default=5e-4, help="fine-tuning / distillation learning rate (default 0.0005)")
    p.add_argument(
        "--no-augment",
        dest="augment",
        action="store_false",
        help="train on the --train images as given (default: batches redrawn and labelled by the original)",
    )
    p.add_argument("-o", "--output", type=Path, required=True, metavar="OUT.onnx")
    p.set_defaults(func=_compress, steps=[])


def _compress(args: argparse.Namespace) -> int:
    from edgekit.compress.steps import Data, compress, parse_step
    from edgekit.compress.training import TrainSettings
    from edgekit.validate.calib import load_arrays, load_labels, sample_count

    steps = [parse_step(s) for s in args.steps]
    tolerance = None
    if args.max_drop is not None:
        if not 0 <= args.max_drop <= 1:
            raise ConfigError(f"--max-drop must be a number in [0, 1] (0.01 = one point of top-1), got {args.max_drop}")
        if args.eval_labels is None:
            raise ConfigError("--max-drop is the allowed top-1 accuracy drop: give --eval-labels with it")
        tolerance = Tolerance(max_top1_drop=args.max_drop)
    evaluation = load_arrays(args.eval, "--eval data")
    train = None if args.train is None else load_arrays(args.train, "--train data")
    if args.labels is not None and train is None:
        raise CalibrationDataError("--labels are training labels: give --train with them")
    data = Data(
        eval=evaluation,
        eval_labels=None
        if args.eval_labels is None
        else load_labels(args.eval_labels, sample_count(evaluation), "--eval-labels"),
        train=train,
        train_labels=None
        if args.labels is None or train is None
        else load_labels(args.labels, sample_count(train), "--labels"),
    )
    result = compress(
        args.model,
        steps,
        args.output,
        data,
        settings=TrainSettings(epochs=args.epochs, lr=args.lr, augment=args.augment),
        tolerance=tolerance,
        progress=lambda line: print(f"  {line}", file=sys.stderr, flush=True),
    )
    if result.gate:
        print(result.gate)
    print(f"{'step':28s} {'size':>12s} {'latency':>16s}  gate vs original")
    original_ms = result.outcomes[0].original_latency_ms
    print(f"{'original':28s} {result.original_size_bytes:>12,d} {original_ms:>10.3f} ms 1.00x")
    for o in result.outcomes:
        verdict = "passed" if o.comparison.passed else "FAILED: " + "; ".join(o.comparison.failures)
        print(
            f"{o.step!s:28s} {o.size_bytes:>12,d} {o.latency_ms:>10.3f} ms {o.speedup:.2f}x  "
            f"{o.comparison.summary()} ({verdict})"
        )
        print(f"    {o.details}")
    final = result.final
    print(
        f"wrote {args.output}: {result.original_size_bytes / max(final.size_bytes, 1):.2f}x smaller, "
        f"{final.speedup:.2f}x faster on this host (ONNX Runtime, side by side)"
    )
    return 0 if final.comparison.passed else FAILED_GATE_EXIT


__all__ = ["register"]
