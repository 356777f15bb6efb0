"""``--compress auto``: compressed variants tried against the plain quantized baseline, before the engine.

Each candidate step (structured pruning at two ratios, low-rank factorisation) is applied to the
original model (``edgekit.compress.steps``, fine-tuned by distillation where training data is
given) and gated against the ORIGINAL in float (a classifier with labels by its top-1 accuracy
against the original's, ``steps.gate_for``); a variant that fails is dropped there. The
original and every surviving variant are then quantized the same way (ONNX Runtime static INT8,
QDQ u8s8 per-channel, on the calibration data: the cpu target's plain recipe) and measured side by
side on this host: file size, latency at batch 1 (interleaved rounds, the speed-up's 95 % interval
against the quantized original) and the gate against the ORIGINAL's float outputs. A variant is
kept only when its quantized form passes the gate and is measured faster (the interval's lower
end above 1) or smaller (at most 90 % of the quantized original's bytes); the winner by the
objective (``latency``: fastest, ``size``: smallest) becomes the model the engine searches, and
every gate after that still compares with the original. When no variant qualifies, the original
goes on unchanged. Every row is printed and recorded in the manifest's provenance.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from edgekit.bundle.manifest import CompressionStep, Tolerance
from edgekit.compress.steps import Data, gate_for, parse_step
from edgekit.errors import ConfigError, EdgekitError

AUTO = "auto"
CANDIDATES: tuple[str, ...] = ("prune-channels=0.25", "prune-channels=0.5", "low-rank=0.5")
SMALLER = 0.9  # a variant "smaller" than the quantized original: at most this fraction of its bytes
Objective = str  # "latency" or "size"


@dataclass(frozen=True)
class Row:
    """One model of the comparison: the original or a variant, in float and quantized."""

    label: str  # "original" or the step, e.g. "prune-channels=0.5"
    float_bytes: int
    float_summary: str  # the float model's gate against the original ("-" for the original)
    float_passed: bool
    int8_bytes: int | None = None
    int8_ms: float | None = None
    speedup: float | None = None  # against the quantized original, p50 ratio
    speedup_low: float | None = None  # 95 % interval
    speedup_high: float | None = None
    int8_summary: str = ""
    int8_passed: bool = False
    verdict: str = ""  # why kept or dropped

    def line(self) -> str:
        if self.int8_bytes is None or self.int8_ms is None:
            return f"{self.label:24s} float {self.float_bytes:>10,d} B  {self.float_summary}; {self.verdict}"
        interval = (
            ""
            if self.speedup_low is None or self.speedup_high is None
            else f" [{self.speedup_low:.2f}-{self.speedup_high:.2f}]"
        )
        speed = "" if self.speedup is None else f" {self.speedup:.2f}x{interval}"
        return (
            f"{self.label:24s} float {self.float_bytes:>10,d} B  int8 {self.int8_bytes:>10,d} B "
            f"{self.int8_ms:8.3f} ms{speed}  {self.int8_summary}; {self.verdict}"
        )


@dataclass(frozen=True)
class AutoChoice:
    model: Path  # what the engine searches: the original or the winning variant
    chosen: str  # "original" or the winning step
    rows: tuple[Row, ...]
    provenance: tuple[CompressionStep, ...]


def is_auto(steps: Sequence[str]) -> bool:
    """``--compress auto`` (alone: it chooses the steps itself)."""
    if AUTO not in [s.strip() for s in steps]:
        return False
    if len(steps) != 1:
        others = ", ".join(s for s in steps if s != AUTO)
        raise ConfigError(f"--compress auto chooses the steps itself; give it alone, not with {others}")
    return True


def choose(
    original: Path,
    work: Path,
    data: Data,
    calib: Mapping[str, np.ndarray],
    *,
    objective: Objective = "latency",
    tolerance: Tolerance | None = None,
    agreement_given: bool = False,
    candidates: Sequence[str] | None = None,
    settings: Any = None,
    progress: Callable[[str], None] | None = None,
    timing_budget_s: float = 6.0,
) -> AutoChoice:
    """Try ``candidates`` on ``original``; the model the engine should search, and every measurement."""
    from edgekit.compress.steps import compress

    if objective not in ("latency", "size"):
        raise ConfigError(f"--compress auto: objective {objective!r}: choose latency or size")
    say = progress or (lambda _msg: None)
    work.mkdir(parents=True, exist_ok=True)
    tol = tolerance or Tolerance()
    rows: list[Row] = [Row("original", original.stat().st_size, "-", True)]
    variants: dict[str, tuple[Path, CompressionStep]] = {}
    for i, text in enumerate(CANDIDATES if candidates is None else candidates):
        step = parse_step(text)
        path = work / f"variant{i}.onnx"
        say(f"compress auto: trying {step}")
        try:
            result = compress(
                original, [step], path, data, settings=settings, tolerance=tol, agreement_given=agreement_given,
                progress=progress,
            )  # fmt: skip
        except EdgekitError as exc:  # a step this model does not take (untraceable graph, ...): the others go on
            rows.append(Row(str(step), 0, f"not made ({' '.join(str(exc).split())})", False, verdict="dropped"))
            continue
        outcome = result.final
        passed = outcome.comparison.passed
        rows.append(
            Row(
                str(step),
                outcome.size_bytes,
                outcome.comparison.summary(),
                passed,
                verdict="" if passed else "dropped: fails the gate against the original in float",
            )
        )
        if passed:
            variants[str(step)] = (path, outcome.provenance)
    # the variants' int8 forms are judged as the variants were (``compressed_gate``), the original's as quantization
    variant_tol, _ = gate_for(original, data.eval_labels is not None, tol, agreement_given)
    measured = _quantize_and_time(original, variants, calib, data, (tol, variant_tol), work, timing_budget_s, say)
    rows = [measured.get(r.label, r) for r in rows]
    rows, chosen = _decide(rows, objective)
    for row in rows:
        say(f"compress auto: {row.line()}")
    say(f"compress auto: the engine searches {chosen if chosen != 'original' else 'the original (no variant paid)'}")
    auto_step = CompressionStep(
        kind="auto_compress",
        tool="edgekit",
        settings={
            "objective": objective,
            "chosen": chosen,
            "baseline": "onnxruntime static int8 qdq u8s8 per-channel of the original",
            **{f"candidate {r.label}": _recorded(r) for r in rows},
        },
        metric="top1_agreement" if _classifier(rows) else "",
        notes="; ".join(r.line() for r in rows),
    )
    if chosen == "original":
        return AutoChoice(original, chosen, tuple(rows), (auto_step,))
    path, provenance = variants[chosen]
    return AutoChoice(path, chosen, tuple(rows), (auto_step, provenance))


def _classifier(rows: Sequence[Row]) -> bool:
    return any("top-1" in r.int8_summary or "top-1" in r.float_summary for r in rows)


def _recorded(row: Row) -> str:
    parts = [f"float {row.float_bytes} bytes", f"float gate: {row.float_summary}"]
    if row.int8_bytes is not None and row.int8_ms is not None:
        parts += [f"int8 {row.int8_bytes} bytes", f"int8 {row.int8_ms:.4f} ms", f"int8 gate: {row.int8_summary}"]
    if row.speedup is not None:
        parts.append(f"{row.speedup:.3f}x the quantized original")
    parts.append(row.verdict)
    return "; ".join(p for p in parts if p)


def _quantize_and_time(
    original: Path,
    variants: Mapping[str, tuple[Path, CompressionStep]],
    calib: Mapping[str, np.ndarray],
    data: Data,
    tols: tuple[Tolerance, Tolerance],
    work: Path,
    budget_s: float,
    say: Callable[[str], None],
) -> dict[str, Row]:
    """Every model quantized alike, run on the evaluation data and timed side by side; ``tols``:
    the original's gate (quantization alone) and the variants' (``steps.gate_for``)."""
    import onnx

    from edgekit.compress.onnx_prep import prepare_model
    from edgekit.compress.ort_quant import StaticQuantConfig, quantize_static_int8
    from edgekit.compress.signature import served_signature
    from edgekit.validate.latency import call_with, speedup_interval, stats_side_by_side
    from edgekit.validate.metrics import compare, output_kind, run_all
    from edgekit.validate.ort_runner import ort_open

    kind = output_kind(served_signature(onnx.load(str(original), load_external_data=False)))
    models = {"original": original, **{label: path for label, (path, _) in variants.items()}}
    reference = run_all(ort_open(original)(0), data.eval, batch=16)
    quantized: dict[str, Path] = {}
    comparisons: dict[str, Any] = {}
    fns: dict[str, Callable[[], object]] = {}
    one = {n: np.ascontiguousarray(v[:1]) for n, v in data.eval.items()}
    for i, (label, path) in enumerate(models.items()):
        say(f"compress auto: quantizing {label} (int8, as the baseline)")
        with tempfile.TemporaryDirectory(prefix="edgekit-auto-") as tmp:
            prepared = prepare_model(path, Path(tmp) / "prepared")
            out = work / f"int8-{i}.onnx"
            quantize_static_int8(prepared.path, out, calib, StaticQuantConfig(), Path(tmp))
        quantized[label] = out
        fn = ort_open(out)(0)
        tol = tols[0] if label == "original" else tols[1]
        comparisons[label] = compare(reference, run_all(fn, data.eval, batch=16), kind, tol, data.eval_labels)
        fns[label] = call_with(fn, one)
    stats = stats_side_by_side(fns, repeats=30, warmup=3, budget_s=budget_s, block=5)
    rows: dict[str, Row] = {}
    for label, path in models.items():
        comparison = comparisons[label]
        interval = None if label == "original" else speedup_interval(stats[label], stats["original"])
        rows[label] = Row(
            label,
            path.stat().st_size,
            "-" if label == "original" else "passed in float",
            True,
            int8_bytes=quantized[label].stat().st_size,
            int8_ms=stats[label].p50_ms,
            speedup=stats["original"].p50_ms / max(stats[label].p50_ms, 1e-9),
            speedup_low=None if interval is None else interval.low,
            speedup_high=None if interval is None else interval.high,
            int8_summary=comparison.summary() + ("" if comparison.passed else " (fails the gate)"),
            int8_passed=comparison.passed,
        )
    return rows


def _decide(rows: Sequence[Row], objective: Objective) -> tuple[list[Row], str]:
    """Each row's verdict, and the winner ("original" when no variant qualifies)."""
    import dataclasses

    base = next(r for r in rows if r.label == "original")
    qualified: list[Row] = []
    out: list[Row] = []
    for row in rows:
        if row.label == "original":
            out.append(dataclasses.replace(row, verdict="the quantized baseline"))
            continue
        if row.int8_bytes is None or base.int8_bytes is None:
            out.append(row)  # dropped in float: its verdict says why
            continue
        faster = row.speedup_low is not None and row.speedup_low > 1.0
        smaller = row.int8_bytes <= SMALLER * base.int8_bytes
        if not row.int8_passed:
            verdict = "dropped: quantized, fails the gate against the original"
        elif not (faster or smaller):
            verdict = "dropped: quantized, neither measured faster nor smaller than the quantized original"
        else:
            verdict = "qualifies: " + " and ".join(w for w, ok in (("faster", faster), ("smaller", smaller)) if ok)
            qualified.append(row)
        out.append(dataclasses.replace(row, verdict=verdict))
    if not qualified:
        return out, "original"

    def key(r: Row) -> tuple[float, ...]:
        faster = 1.0 if r.speedup_low is not None and r.speedup_low > 1.0 else 0.0
        if objective == "size":
            return (float(r.int8_bytes or 0), -(r.speedup or 0.0))
        return (-faster, -(r.speedup or 0.0), float(r.int8_bytes or 0))

    winner = min(qualified, key=key).label
    out = [
        dataclasses.replace(r, verdict=r.verdict.replace("qualifies", "chosen")) if r.label == winner else r
        for r in out
    ]
    return out, winner


__all__ = ["AUTO", "CANDIDATES", "AutoChoice", "Row", "choose", "is_auto"]
