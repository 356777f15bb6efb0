"""The engine's search as the manifest records it (v2): the candidate report, the calibration
identity, the layers mixed precision kept in float, and the choice as a provenance step; and what
``edgekit inspect`` prints of it."""

from __future__ import annotations

import dataclasses
from typing import Any

from edgekit.bundle.manifest import (
    CalibrationData,
    CandidateReport,
    CandidateResult,
    CompressionStep,
    Precision,
    Tolerance,
)
from edgekit.optimize.search_state import SearchResult

EXCLUDED_REASON = "per-layer sensitivity on the calibration subset (fewest layers that meet the budget)"


def candidate_report(result: SearchResult, budget: Tolerance, measured_on: str = "") -> CandidateReport:
    """Every candidate (the chosen one's ``reason`` says why it was chosen); each ``speedup_vs_fp32``
    is ONNX Runtime FP32 source p50 / its p50, both from the one side-by-side round it was timed in."""
    rows = []
    for o in result.outcomes:
        c, lat = o.comparison, o.latency
        settings = {k: _text(v) for k, v in o.settings.items()} | {"runtime": o.runtime, "precision": o.precision}
        rows.append(
            CandidateResult(
                id=o.name,
                settings=settings,
                status=o.status,  # type: ignore[arg-type]  # the engine's statuses are the manifest's
                reason=result.why if o.status == "chosen" else o.reason,
                top1_agreement=None if c is None else c.top1_agreement,
                cosine=None if c is None else c.cosine,
                relative_error=None if c is None else c.relative_error,
                size_bytes=o.size_bytes or None,
                latency_p50_ms=None if lat is None else lat.p50_ms,
                latency_p90_ms=None if lat is None else lat.p90_ms,
                latency_iqr_ms=None if lat is None else lat.iqr_ms,
                speedup_vs_fp32=o.speed_vs_reference,
                excluded_nodes=o.excluded_nodes,
            )
        )
    selection = len(next(iter(result.data.selection.values())))
    return CandidateReport(
        objective=result.objective,  # type: ignore[arg-type]  # checked by EngineSettings
        budget=budget,
        chosen=result.chosen.name,
        selection_samples=selection,
        latency_measured=result.chosen.latency is not None,
        candidates=tuple(rows),
        measured_on=measured_on,
        notes=(
            f"selection on {result.data.selection_source}",
            f"latency: batch 1, {result.threads or 'runtime default'} threads, side by side with onnxruntime fp32",
            f"chose {result.chosen.name}: {result.why}",
            *baseline_note(result),
            *result.notes[1:],
        ),
    )


def calibration_data(result: SearchResult, source: str = "") -> CalibrationData:
    d = result.data
    n = len(next(iter(d.calib.values())))
    return CalibrationData(
        sha256=d.calib_sha256,
        samples=n,
        source=source,
        selection=f"{n} of {d.calib_total} calibration samples, stratified by fp32 top-1 (classifiers) "
        "or evenly spaced",
    )


def with_excluded(precision: Precision, result: SearchResult) -> Precision:
    nodes = result.chosen.excluded_nodes
    if not nodes:
        return precision
    reason = result.excluded_by.get(result.chosen.name, EXCLUDED_REASON)
    return dataclasses.replace(precision, excluded_nodes=nodes, excluded_reason=reason)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def baseline_note(result: SearchResult) -> tuple[str, ...]:
    """Which FP32 decides 'slower than fp32' when it is not the reference the ratios are to."""
    base, chosen = result.baseline, result.chosen
    if base is None or base.name == chosen.name or base.p50_ms is None or chosen.p50_ms is None:
        return ()
    if chosen.latency_from:  # a device profile: the ratios already are to the target's own FP32 there
        return ()
    return (
        f"speed: {base.p50_ms / chosen.p50_ms:.2f}x {base.name} (the target's fp32 on {base.runtime}; it decides "
        f"'slower than fp32' and what auto ships), p50 {chosen.p50_ms:.3f} vs {base.p50_ms:.3f} ms, "
        f"same {chosen.timed_in} round as the onnxruntime fp32 ratio",
    )


def choice_step(result: SearchResult, budget: Tolerance) -> CompressionStep:
    """The engine's choice as a manifest provenance step: the chosen candidate's settings, the
    objective, the accuracy budget, and why (``metric``/``after``: its accuracy on the selection
    samples)."""
    o = result.chosen
    settings = {k: _text(v) for k, v in o.settings.items()} | {
        "candidate": o.name,
        "runtime": o.runtime,
        "precision": o.precision,
        "objective": result.objective,
        "budget": ", ".join(f"{k}={v:g}" for k, v in dataclasses.asdict(budget).items() if v is not None),
        "candidates": str(sum(1 for x in result.outcomes if x.status != "skipped")),
        "skipped": str(sum(1 for x in result.outcomes if x.status == "skipped")),
    }
    if o.excluded_nodes:
        settings["excluded_nodes"] = ",".join(o.excluded_nodes)
    c = o.comparison
    metric, after = "", None
    if c is not None and c.top1_agreement is not None:
        metric, after = "top1_agreement", c.top1_agreement
    elif c is not None and c.cosine is not None:
        metric, after = "cosine", c.cosine
    return CompressionStep(
        kind="select",
        tool="edgekit optimize",
        settings=settings,
        metric=metric,
        after=after,
        notes=f"{result.why} (on {result.data.selection_source})",
    )


def summary_lines(report: CandidateReport) -> list[str]:
    """What ``edgekit inspect`` prints of a manifest's candidate report: counts by status, one
    line per candidate (status, accuracy, p50 and speed vs ONNX Runtime FP32, size, the reason it
    failed / was skipped), and the choice with why."""
    counts: dict[str, int] = {}
    for c in report.candidates:
        counts[c.status] = counts.get(c.status, 0) + 1
    chosen = next((c for c in report.candidates if c.status == "chosen"), None)
    speed = f", {chosen.speedup_vs_fp32:.2f}x ORT fp32" if chosen and chosen.speedup_vs_fp32 else ""
    lines = [
        f"candidates (objective {report.objective}, {report.selection_samples} selection samples): "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
    ]
    width = max(len(c.status) for c in report.candidates) if report.candidates else 0
    for c in report.candidates:
        if c.status == "skipped":
            lines.append(f"  {c.status:<{width}}  {c.id}: {c.reason}")
            continue
        parts = [_accuracy(c), _speed(c, report.latency_measured)]
        if c.size_bytes:
            parts.append(_size(c.size_bytes))
        if c.status in ("failed", "error") and c.reason:
            parts.append(c.reason)
        lines.append(f"  {c.status:<{width}}  {c.id}: " + ", ".join(p for p in parts if p))
    why = f": {chosen.reason}" if chosen is not None and chosen.reason else ""
    lines.append(
        f"chosen: {report.chosen}{speed}" + ("" if report.latency_measured else " (latency not measured here)") + why
    )
    lines += [f"  {n}" for n in report.notes if n.startswith("speed: ")]
    return lines


def _accuracy(c: CandidateResult) -> str:
    if c.top1_agreement is not None:
        return f"top-1 agree {c.top1_agreement:.1%}"
    if c.cosine is not None:
        return f"cosine {c.cosine:.4f}"
    return ""


def _speed(c: CandidateResult, measured: bool) -> str:
    if c.latency_p50_ms is None:
        return "" if c.status == "error" else ("latency not measured here" if not measured else "")
    ratio = f" ({c.speedup_vs_fp32:.2f}x ORT fp32)" if c.speedup_vs_fp32 else ""
    return f"p50 {c.latency_p50_ms:.3f} ms{ratio}"


def _size(n: int) -> str:
    for unit, scale in (("MB", 1024**2), ("KB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
