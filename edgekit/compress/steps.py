"""Compression as a chain of steps, each measured against the ORIGINAL model.

    prune-channels=0.5   structured channel pruning (Torch-Pruning), fine-tuned by distillation when data is given
    sparsity=0.8 | 2:4   unstructured magnitude pruning (zeros; smaller compressed download)
    distill=width=0.5    a student (the teacher at a fraction of its width, an ONNX file, or MODULE:FACTORY)
                         trained on the teacher's outputs (and labels where given)
    low-rank=0.5         truncated-SVD factorisation of Linear/Conv layers where measured faster
    share-weights=16     k-means weight sharing (16 values per tensor)

Every step writes an ONNX model with the source model's input/output names, dtypes and dynamic
axes, and is measured side by side with the original: file size, ONNX Runtime latency on this
host (interleaved, medians), and the gate's comparison with the original on the evaluation data
(never with the previous step). A classifier with evaluation labels is judged by its top-1
accuracy against the original's, its agreement with the original reported but not gated unless
asked for (``edgekit.validate.metrics.compressed_gate``). Each step becomes one
``CompressionStep`` of the manifest's provenance, with its parameters, input/output hashes and
measured effect (with labels, both accuracies and the drop's paired 95 % interval).
"""

from __future__ import annotations

import hashlib
import importlib
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast, get_args

import numpy as np

from edgekit.bundle.manifest import CompressionStep, Tolerance
from edgekit.errors import CalibrationDataError, ConfigError
from edgekit.validate.metrics import Comparison, Kind, compare, compressed_gate, output_kind, run_all

StepKind = Literal["prune-channels", "sparsity", "distill", "low-rank", "share-weights"]
STEP_KINDS: tuple[StepKind, ...] = get_args(StepKind)
Progress = Callable[[str], None]


@dataclass(frozen=True)
class Step:
    kind: StepKind
    value: str

    def __str__(self) -> str:
        return f"{self.kind}={self.value}"


def parse_step(text: str) -> Step:
    """``prune-channels=0.5`` -> Step; the error lists the valid kinds and the nearest one."""
    import difflib

    kind, sep, value = text.partition("=")
    kind = kind.strip()
    if kind not in STEP_KINDS:
        near = difflib.get_close_matches(kind, STEP_KINDS, n=1)
        hint = f" (did you mean {near[0]}?)" if near else ""
        raise ConfigError(
            f"compression step {text!r}: unknown kind {kind!r}{hint}; choose one of {', '.join(STEP_KINDS)}"
        )
    if not sep or not value.strip():
        raise ConfigError(f"compression step {text!r}: give a value, e.g. {kind}={_EXAMPLES[kind]}")
    return Step(kind, value.strip())


_EXAMPLES: dict[StepKind, str] = {
    "prune-channels": "0.5",
    "sparsity": "0.8",
    "distill": "width=0.5",
    "low-rank": "0.5",
    "share-weights": "16",
}


@dataclass(frozen=True)
class Data:
    """Inputs by name (``train`` optional: pruning and low-rank then run without fine-tuning;
    distillation needs it), labels optional."""

    eval: Mapping[str, np.ndarray]
    eval_labels: np.ndarray | None = None
    train: Mapping[str, np.ndarray] | None = None
    train_labels: np.ndarray | None = None


@dataclass(frozen=True)
class Outcome:
    step: Step
    path: Path
    size_bytes: int
    latency_ms: float
    original_latency_ms: float
    comparison: Comparison
    provenance: CompressionStep
    details: str

    @property
    def speedup(self) -> float:
        return self.original_latency_ms / max(self.latency_ms, 1e-9)


@dataclass(frozen=True)
class Result:
    original: Path
    original_size_bytes: int
    outcomes: tuple[Outcome, ...]
    gate: str = ""  # which gate judged the steps (``compressed_gate``), in one line

    @property
    def final(self) -> Outcome:
        return self.outcomes[-1]


def _sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


class _Chain:
    """The state a chain of steps shares: the interface to keep, the data, the teacher's outputs."""

    def __init__(self, original: Path, data: Data, settings: Any, progress: Progress | None) -> None:
        from edgekit.compress.torch_bridge import interface
        from edgekit.compress.training import teacher_session

        self.original = original
        self.interface = interface(original)
        self.names = [name for name, _, _ in self.interface.inputs]
        self.settings = settings
        self.progress = progress
        self.eval = self._ordered(data.eval, "--eval")
        self.eval_labels = data.eval_labels
        self.teacher = teacher_session(original, self.names)
        self.eval_teacher = self.teacher(self.eval)
        # early stopping watches a slice of the training data, never the evaluation data the gate judges on
        self.train = self.val = self.train_labels = self.train_teacher = self.val_teacher = None
        if data.train is not None:
            train = self._ordered(data.train, "--train")
            n = int(train[0].shape[0])
            order = np.random.default_rng(0).permutation(n)
            held = max(1, min(n // 10, 512)) if n >= 20 else 0
            fit, val = order[held:], (order[:held] if held else order)
            self.train = [x[fit] for x in train]
            self.val = [x[val] for x in train]
            self.train_labels = None if data.train_labels is None else data.train_labels[fit]
            self.train_teacher = self.teacher(self.train)
            self.val_teacher = self.teacher(self.val)

    def _ordered(self, arrays: Mapping[str, np.ndarray], flag: str) -> list[np.ndarray]:
        missing = [n for n in self.names if n not in arrays]
        if missing:
            raise CalibrationDataError(f"{flag} data has no array {missing[0]!r} (the model's inputs: {self.names})")
        return [np.asarray(arrays[n]) for n in self.names]

    def example(self) -> tuple[Any, ...]:
        return self.interface.example(dict(zip(self.names, self.eval, strict=True)))

    def sensitivity_inputs(self, n: int = 192) -> tuple[Any, ...] | None:
        """A batch of training inputs to measure pruning sensitivity and refit layers on; None
        without --train (the evaluation inputs judge the result: nothing is fitted on them)."""
        import torch

        if self.train is None:
            return None
        return tuple(torch.from_numpy(np.ascontiguousarray(x[:n])) for x in self.train)

    def finetune(self, module: Any, what: str, after_step: Callable[[], None] | None = None) -> str:
        from edgekit.compress.training import augmentable, distill

        if self.train is None or self.train_teacher is None or self.val is None or self.val_teacher is None:
            return f"{what}: not fine-tuned (no --train data)"

        augmented = bool(getattr(self.settings, "augment", False)) and augmentable(self.train)
        report = distill(
            module,
            self.train,
            self.train_teacher,
            labels=self.train_labels,
            eval_inputs=self.val,
            eval_teacher=self.val_teacher,
            after_step=after_step,
            settings=self.settings,
            progress=self.progress,
            teacher_fn=self.teacher,
        )
        return (
            f"{what}: fine-tuned {report.epochs_run} epochs by distillation"
            + (" on redrawn batches labelled by the original" if augmented else "")
            + f", {report.metric} on a held-out tenth of --train {report.before:.4f} -> {report.best:.4f} "
            f"(best epoch {report.best_epoch})"
        )


def _student(spec: str, current: Path, chain: _Chain) -> tuple[Any, str]:
    """The student module a ``distill=`` value names."""
    from edgekit.compress.prune import prune_channels
    from edgekit.compress.torch_bridge import load_module

    if spec.startswith("width="):
        try:
            width = float(spec.split("=", 1)[1])
        except ValueError:
            raise ConfigError(f"distill={spec}: width must be a number between 0 and 1, e.g. width=0.5") from None
        if not 0.0 < width < 1.0:
            raise ConfigError(f"distill={spec}: width must be between 0 and 1, e.g. width=0.5")
        student = load_module(current)
        # a student is the teacher at one width everywhere (a width multiplier): training recovers
        # what the uniform cut loses, and the early high-resolution layers, where most of the
        # compute is, shrink as much as the rest
        report = prune_channels(
            student, chain.example(), 1.0 - width, criterion="l2", data=chain.sensitivity_inputs(), by_sensitivity=False
        )
        return (
            student,
            f"student: the teacher at width {width:g} ({report.params_after:,} of {report.params_before:,} parameters)",
        )
    if spec.endswith(".onnx"):
        path = Path(spec)
        if not path.is_file():
            raise ConfigError(f"distill={spec}: no such ONNX file")
        student = load_module(path)
        return student, f"student: {path.name}"
    module_name, sep, factory = spec.partition(":")
    if not sep:
        raise ConfigError(f"distill={spec}: give width=FRACTION, STUDENT.onnx or MODULE:FACTORY")
    try:
        student = getattr(importlib.import_module(module_name), factory)()
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"distill={spec}: cannot make the student ({exc})") from exc
    return student, f"student: {spec}"


def _run_step(step: Step, current: Path, out: Path, chain: _Chain) -> tuple[str, dict[str, str]]:
    """Apply one step from ``current`` into ``out``; (details, settings recorded)."""
    from edgekit.compress import lowrank, prune, share, torch_bridge

    if step.kind == "sparsity":
        pattern = prune.parse_pattern(step.value)
        if chain.train is None:
            rep = prune.sparsify(current, out, pattern)
            tuned = "not fine-tuned (no --train data)"
        else:
            module = torch_bridge.load_module(current)
            reapply = prune.sparsify_module(module, pattern)
            tuned = chain.finetune(module, "sparse", after_step=reapply)
            with tempfile.TemporaryDirectory(prefix="edgekit-sparse-") as tmp:
                dense = torch_bridge.export_like(module, chain.interface, Path(tmp) / "exported.onnx", chain.example())
                rep = prune.sparsify(dense, out, pattern)  # exact zeros again after export's rounding
        return (
            f"{rep.pattern}: {rep.sparsity:.1%} zeros in {rep.tensors} weight tensors"
            + (f" ({rep.dense} depthwise or small ones left dense)" if rep.dense else "")
            + "; zlib-compressed "
            f"{prune.compressed_size(chain.original):,} -> {rep.compressed_bytes_after:,} bytes; dense runtimes run "
            "it at the same speed"
            + ("; TensorRT 2:4 sparse kernels: not measured here (no GPU)" if pattern == "2:4" else "")
            + f"; {tuned}",
            {"pattern": rep.pattern, "zlib_bytes_after": str(rep.compressed_bytes_after)},
        )
    if step.kind == "share-weights":
        try:
            k = int(step.value)
        except ValueError:
            raise ConfigError(
                f"share-weights={step.value}: give the number of shared values per tensor, e.g. 16"
            ) from None
        srep = share.share_weights(current, out, k)
        return (
            f"{k} shared values per tensor in {srep.tensors} tensors: codebook + {max(1, (k - 1).bit_length())}-bit "
            f"indices would take {srep.size_ratio:.3f}x the float32 model (stored de-quantised here: formats without "
            "palettization hold floats)",
            {"clusters": str(k), "codebook_size_ratio": f"{srep.size_ratio:.4f}"},
        )
    example = chain.example()
    if step.kind == "prune-channels":
        ratio, _, rest = step.value.partition(":")
        criterion, _, allocation = rest.partition(":")
        if allocation not in ("", "uniform", "sensitivity"):
            raise ConfigError(
                f"prune-channels={step.value}: the third field is the allocation, uniform or sensitivity "
                "(default: sensitivity, measured on data)"
            )
        module = torch_bridge.load_module(current)
        gradient = None
        if criterion == "taylor":
            gradient = _gradient_batches(chain)
        prep = prune.prune_channels(
            module,
            example,
            _fraction(Step(step.kind, ratio)),
            criterion=cast(Any, criterion or "l1"),
            gradient_batches=gradient,
            data=chain.sensitivity_inputs(),
            by_sensitivity=allocation != "uniform",
        )
        tuned = chain.finetune(module, "pruned")
        torch_bridge.export_like(module, chain.interface, out, example)
        return (
            f"{prep.criterion} importance: parameters {prep.params_before:,} -> {prep.params_after:,}, multiply-adds "
            f"{prep.macs_before / max(prep.macs_after, 1):.2f}x fewer; {_ratios(prep.layer_ratios, chain)}; "
            f"channels kept in multiples of {prep.channel_multiple} (4 in layers under 16); "
            f"{prep.refitted_layers} layers refitted to the original's outputs by least squares, "
            f"{prep.bias_moved_layers} by their bias alone; "
            f"kept whole: {', '.join(prep.kept_layers) or '-'}; {tuned}",
            {
                "ratio": ratio,
                "criterion": prep.criterion,
                "params_after": str(prep.params_after),
                "allocation": "sensitivity" if prep.layer_ratios else "uniform",
                "channel_multiple": str(prep.channel_multiple),
            },
        )
    if step.kind == "low-rank":
        spec = lowrank.LowRankSpec.parse(step.value)
        module = torch_bridge.load_module(current)
        decisions = lowrank.factorise(module, example, spec)
        done = [d for d in decisions if d.factorised]
        tuned = chain.finetune(module, "factorised") if done else "nothing factorised"
        torch_bridge.export_like(module, chain.interface, out, example)
        skipped = "; ".join(f"{d.layer} ({d.reason})" for d in decisions if not d.factorised)
        return (
            f"{len(done)} of {len(decisions)} layers factorised ("
            + ", ".join(f"{d.shape} rank {d.rank}" for d in done)
            + f"); {tuned}"
            + (f"; left: {skipped}" if skipped else ""),
            {"spec": step.value, "layers": str(len(done))},
        )
    # distill
    if chain.train is None:
        raise CalibrationDataError("distillation trains the student: give --train DATA.npz (labels optional)")
    student, what = _student(step.value, current, chain)
    tuned = chain.finetune(student, "student")
    torch_bridge.export_like(student, chain.interface, out, example)
    return f"{what}; {tuned}", {"student": step.value}


def _ratios(ratios: Sequence[tuple[str, float]], chain: _Chain) -> str:
    if not ratios:
        return "the same ratio in every layer" + ("" if chain.train is not None else " (no --train data to measure on)")
    values = sorted(r for _, r in ratios)
    least = ", ".join(f"{n} {r:.2f}" for n, r in sorted(ratios, key=lambda nr: nr[1])[:3])
    return (
        f"per-layer ratios by sensitivity measured on --train inputs, {values[0]:.2f}-{values[-1]:.2f} "
        f"(most kept: {least})"
    )


def _fraction(step: Step) -> float:
    try:
        return float(step.value)
    except ValueError:
        raise ConfigError(
            f"{step.kind}={step.value}: give a fraction between 0 and 1, e.g. {_EXAMPLES[step.kind]}"
        ) from None


def _gradient_batches(chain: _Chain) -> list[tuple[tuple[Any, ...], Any]]:
    import torch

    if chain.train is None or chain.train_teacher is None:
        raise ConfigError("taylor importance needs data: give --train (inputs; labels are not needed)")
    n = min(256, int(chain.train[0].shape[0]))
    return [
        (
            tuple(torch.from_numpy(np.ascontiguousarray(x[s : s + 64])) for x in chain.train),
            torch.from_numpy(chain.train_teacher[s : s + 64]),
        )
        for s in range(0, n, 64)
    ]


def gate_for(
    original: Path, labelled: bool, tolerance: Tolerance | None = None, agreement_given: bool = False
) -> tuple[Tolerance, str]:
    """The tolerance a model compressed from ``original`` is judged by, and the line that says so
    (``compressed_gate``; the kind from ``original``'s first output)."""
    return compressed_gate(tolerance or Tolerance(), _kind(original), labelled, agreement_given)


def _kind(original: Path) -> Kind:
    import onnx

    from edgekit.compress.signature import served_signature

    return output_kind(served_signature(onnx.load(str(original), load_external_data=False)))


def measure(
    original: Path,
    candidate: Path,
    data: Mapping[str, np.ndarray],
    labels: np.ndarray | None,
    tolerance: Tolerance | None = None,
    agreement_given: bool = False,
) -> tuple[Comparison, float, float]:
    """(comparison with the original on ``data``, candidate ms, original ms): ONNX Runtime, side by side.
    The gate is ``gate_for``'s: with ``labels``, a classifier's top-1 accuracy against the original's
    (its agreement gates only where ``agreement_given``)."""
    from edgekit.validate.latency import call_with, stats_side_by_side
    from edgekit.validate.ort_runner import ort_open

    tol, _ = gate_for(original, labels is not None, tolerance, agreement_given)
    ref_fn, cand_fn = ort_open(original)(0), ort_open(candidate)(0)
    reference, outputs = run_all(ref_fn, data, batch=16), run_all(cand_fn, data, batch=16)
    comparison = compare(reference, outputs, _kind(original), tol, labels)
    one = {n: np.ascontiguousarray(v[:1]) for n, v in data.items()}
    stats = stats_side_by_side({"original": call_with(ref_fn, one), "candidate": call_with(cand_fn, one)})
    return comparison, stats["candidate"].p50_ms, stats["original"].p50_ms


def compress(
    model: Path,
    steps: Sequence[Step],
    out: Path,
    data: Data,
    *,
    settings: Any = None,
    tolerance: Tolerance | None = None,
    agreement_given: bool = False,
    progress: Progress | None = None,
) -> Result:
    """Apply ``steps`` in order to ``model``; write the last step's model to ``out``. Each step is
    gated against ``model`` (``measure``); ``agreement_given``: the user set ``min_top1_agreement``,
    which then gates a classifier with labels too."""
    from edgekit.compress.training import TrainSettings

    if not steps:
        raise ConfigError("no compression step given: e.g. --prune-channels 0.5, --low-rank 0.5, --distill width=0.5")
    chain = _Chain(model, data, settings or TrainSettings(), progress)
    _, gate = gate_for(model, data.eval_labels is not None, tolerance, agreement_given)
    if progress is not None and gate:
        progress(gate)
    outcomes: list[Outcome] = []
    current = model
    with tempfile.TemporaryDirectory(prefix="edgekit-compress-") as tmp:
        for i, step in enumerate(steps):
            if progress is not None:
                progress(f"step {i + 1}/{len(steps)}: {step}")
            target = out if i == len(steps) - 1 else Path(tmp) / f"step{i}.onnx"
            details, recorded = _run_step(step, current, target, chain)
            comparison, ms, original_ms = measure(
                model,
                target,
                dict(zip(chain.names, chain.eval, strict=True)),
                data.eval_labels,
                tolerance,
                agreement_given,
            )
            metric = "top1_agreement" if comparison.kind == "classifier" else "cosine"
            provenance = CompressionStep(
                kind=step.kind.replace("-", "_"),
                tool="torch-pruning" if step.kind == "prune-channels" else "edgekit",
                settings={
                    "value": step.value,
                    "input_sha256": _sha256(current),
                    "output_sha256": _sha256(target),
                    "size_bytes": str(target.stat().st_size),
                    "latency_ms": f"{ms:.4f}",
                    "original_latency_ms": f"{original_ms:.4f}",
                    **_accuracy_settings(comparison),
                    **recorded,
                },
                metric=metric,
                before=1.0,
                after=getattr(comparison, metric),
                notes=details,
            )
            outcomes.append(
                Outcome(step, target, target.stat().st_size, ms, original_ms, comparison, provenance, details)
            )
            current = target
        # the intermediate files go with the temporary folder: only the final path stays valid
        final = outcomes[-1]
        outcomes = [*(o if o.path == out else _detached(o) for o in outcomes[:-1]), final]
    return Result(model, model.stat().st_size, tuple(outcomes), gate)


def _accuracy_settings(comparison: Comparison) -> dict[str, str]:
    """What the provenance records of a classifier's accuracy with labels: both accuracies, the
    drop's paired 95 % interval, and whether agreement gated (``compressed_gate``)."""
    c = comparison
    if c.top1_accuracy is None or c.fp32_top1_accuracy is None or c.top1_drop_interval is None:
        return {}
    low, high = c.top1_drop_interval
    worse, better = c.discordant or (0, 0)
    return {
        "top1_accuracy": f"{c.top1_accuracy:.4f}",
        "original_top1_accuracy": f"{c.fp32_top1_accuracy:.4f}",
        "top1_drop_95": f"{low:+.4f} to {high:+.4f}",
        "discordant": f"{worse} only the original right, {better} only this",
        "gate": "top-1 agreement and accuracy" if c.tolerance.min_top1_agreement is not None else "top-1 accuracy",
    }


def _detached(outcome: Outcome) -> Outcome:
    import dataclasses

    return dataclasses.replace(outcome, path=Path("-"))


__all__ = ["STEP_KINDS", "Data", "Outcome", "Result", "Step", "compress", "measure", "parse_step"]
