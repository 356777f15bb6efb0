"""The candidate report next to a bundle: json, markdown, the plot, and the inspect summary."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from edgekit.bundle.manifest import Precision
from edgekit.optimize.candidates import Built
from edgekit.optimize.data import search_data
from edgekit.optimize.report import pareto, summarise, write_report
from edgekit.optimize.search_state import SearchResult
from edgekit.validate.latency import LatencyStats
from tests.optimize.test_choose import _o


def _result(tmp_path: Path, baseline_runtime: str = "onnxruntime") -> SearchResult:
    final = {"timed_in": "final", "reference_p50_ms": 1.0}
    fp32 = dataclasses.replace(
        _o("ort fp32", 1.0, 1000, precision="fp32", baseline=True, **final), runtime=baseline_runtime
    )
    chosen = dataclasses.replace(_o("int8 a", 0.5, 250, **final), status="chosen", excluded_nodes=("conv3",))
    # timed in the quick round only, against the reference's p50 in that round
    quick = {"timed_in": "quick", "reference_p50_ms": 0.8}
    failed = dataclasses.replace(_o("int8 b", 0.4, 250, 0.5, passed=False, **quick), reason="top-1 agreement 0.5")
    skipped = dataclasses.replace(_o("int8 c", None, 0), status="skipped", reason="dominated", comparison=None)
    built = Built(files={}, runtime="onnxruntime", precision=Precision("int8", "uint8"), open=None)
    data = search_data({"x": np.zeros((40, 3), np.float32)}, 16)
    return SearchResult(
        chosen=chosen, built=built, built_dir=tmp_path, why="fastest within the budget",
        outcomes=(fp32, chosen, failed, skipped),
        reference_latency=LatencyStats(1.0, 1.2, 0.1, 100), baseline=fp32, slower_than_fp32=False, objective="latency",
        data=data, threads=2, notes=("selection on 24 calibration samples",), elapsed_s=3.0,
    )  # fmt: skip


def test_report_writes_json_markdown_and_plot_next_to_the_bundle(tmp_path: Path) -> None:
    md = write_report(_result(tmp_path), tmp_path / "m-cpu-v1", "cpu", gate_passed=True)
    assert md == tmp_path / "m-cpu-v1.report.md"
    data = json.loads((tmp_path / "m-cpu-v1.report.json").read_text())
    assert [c["status"] for c in data["candidates"]] == ["passed", "chosen", "failed", "skipped"]
    assert data["candidates"][1]["speed_vs_fp32"] == 2.0 and data["candidates"][1]["excluded_nodes"] == ["conv3"]
    # a ratio is within one round: the quick-round candidate against the quick round's reference
    assert data["candidates"][2]["speed_vs_fp32"] == 2.0 and data["candidates"][2]["timed_in"] == "quick"
    text = md.read_text()
    assert (
        "| int8 b | failed: top-1 agreement 0.5 |" in text and "Layers kept in float (mixed precision): conv3" in text
    )
    png = tmp_path / "m-cpu-v1.report.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "![accuracy vs latency](m-cpu-v1.report.png)" in text
    assert summarise(tmp_path / "m-cpu-v1.report.json").splitlines() == [
        "candidates (cpu, objective latency): 1 chosen, 1 failed, 1 passed, 1 skipped",
        "chosen: int8 a (fastest within the budget), 2.00x ORT fp32",
    ]


def test_report_pareto_front_keeps_only_undominated_points() -> None:
    points = [(1.0, 0.99), (0.5, 0.98), (0.6, 0.97), (2.0, 1.0), (0.4, 0.90)]
    assert pareto(points) == [(0.4, 0.90), (0.5, 0.98), (1.0, 0.99), (2.0, 1.0)]


def test_report_summary_lines_from_the_manifest_candidate_report(tmp_path: Path) -> None:
    from edgekit.bundle.manifest import Tolerance
    from edgekit.optimize.record import candidate_report, summary_lines

    report = candidate_report(_result(tmp_path), Tolerance())
    assert report.chosen == "int8 a" and report.latency_measured
    assert [c.speedup_vs_fp32 for c in report.candidates][:3] == [1.0, 2.0, 2.0]
    assert summary_lines(report) == [
        "candidates (objective latency, 40 selection samples): 1 chosen, 1 failed, 1 passed, 1 skipped",
        "  passed   ort fp32: top-1 agree 100.0%, p50 1.000 ms (1.00x ORT fp32), 1000 B",
        "  chosen   int8 a: top-1 agree 100.0%, p50 0.500 ms (2.00x ORT fp32), 250 B",
        "  failed   int8 b: top-1 agree 50.0%, p50 0.400 ms (2.00x ORT fp32), 250 B, top-1 agreement 0.5",
        "  skipped  int8 c: dominated",
        "chosen: int8 a, 2.00x ORT fp32: fastest within the budget",
        "  speed: 2.00x ort fp32 (the target's fp32 on onnxruntime; it decides 'slower than fp32' and what auto "
        "ships), p50 0.500 vs 1.000 ms, same final round as the onnxruntime fp32 ratio",
    ]


def test_report_choice_is_a_provenance_step_with_settings_objective_budget_and_why(tmp_path: Path) -> None:
    from edgekit.bundle.manifest import Tolerance
    from edgekit.optimize.record import choice_step

    result = _result(tmp_path)
    chosen = dataclasses.replace(result.chosen, settings={"recipe": "int8 a", "per_channel": True})
    step = choice_step(dataclasses.replace(result, chosen=chosen), Tolerance(min_cosine=None))
    assert (step.kind, step.tool, step.metric, step.after) == ("select", "edgekit optimize", "top1_agreement", 1.0)
    assert step.settings == {
        "recipe": "int8 a", "per_channel": "True", "candidate": "int8 a", "runtime": "onnxruntime",
        "precision": "int8", "objective": "latency",
        "budget": "min_top1_agreement=0.98, max_top1_drop=0.01, max_relative_error=0.2, min_channel_cosine=0.9",
        "candidates": "3", "skipped": "1", "excluded_nodes": "conv3",
    }  # fmt: skip
    assert step.notes == (
        "fastest within the budget (on all 40 calibration samples, the 16 calibrating included "
        "(too few left over to hold out: 24 < 64))"
    )
