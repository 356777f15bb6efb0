"""The engine's search as the manifest records it (v2): the candidate report, the calibration
identity, and the layers mixed precision kept in float."""

from __future__ import annotations

import dataclasses
from typing import Any

from edgekit.bundle.manifest import CalibrationData, CandidateReport, CandidateResult, Precision, Tolerance
from edgekit.optimize.engine import SearchResult

EXCLUDED_REASON = "per-layer sensitivity on the calibration subset (fewest layers that meet the budget)"


def candidate_report(result: SearchResult, budget: Tolerance, measured_on: str = "") -> CandidateReport:
    ref = result.reference_latency.p50_ms if result.reference_latency is not None else None
    rows = []
    for o in result.outcomes:
        c, lat = o.comparison, o.latency
        settings = {k: _text(v) for k, v in o.settings.items()} | {"runtime": o.runtime, "precision": o.precision}
        rows.append(
            CandidateResult(
                id=o.name,
                settings=settings,
                status=o.status,  # type: ignore[arg-type]  # the engine's statuses are the manifest's
                reason=o.reason,
                top1_agreement=None if c is None else c.top1_agreement,
                cosine=None if c is None else c.cosine,
                relative_error=None if c is None else c.relative_error,
                size_bytes=o.size_bytes or None,
                latency_p50_ms=None if lat is None else lat.p50_ms,
                latency_p90_ms=None if lat is None else lat.p90_ms,
                latency_iqr_ms=None if lat is None else lat.iqr_ms,
                speedup_vs_fp32=None if lat is None or not ref else ref / lat.p50_ms,
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
    return dataclasses.replace(precision, excluded_nodes=nodes, excluded_reason=EXCLUDED_REASON)


def _text(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return ",".join(map(str, value))
    return str(value)


def summary_lines(report: CandidateReport) -> list[str]:
    """What ``edgekit inspect`` prints of a manifest's candidate report: counts by status, the
    choice and its speed against ONNX Runtime FP32, and the first skipped/failed reasons."""
    counts: dict[str, int] = {}
    for c in report.candidates:
        counts[c.status] = counts.get(c.status, 0) + 1
    chosen = next((c for c in report.candidates if c.status == "chosen"), None)
    speed = f", {chosen.speedup_vs_fp32:.2f}x ORT fp32" if chosen and chosen.speedup_vs_fp32 else ""
    lines = [
        f"candidates (objective {report.objective}, {report.selection_samples} selection samples): "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        f"chosen: {report.chosen}{speed}" + ("" if report.latency_measured else " (latency not measured here)"),
    ]
    for c in report.candidates:
        if c.status in ("error", "failed", "skipped") and c.reason:
            lines.append(f"  {c.status} {c.id}: {c.reason}")
    return lines
