"""The candidate report next to each bundle: ``<stem>.report.json`` (every candidate, settings,
result or reason), ``<stem>.report.md`` (the same as tables) and ``<stem>.report.png`` (accuracy
vs latency, marker area = artifact size, the Pareto front, the choice circled).

``summarise`` gives the few lines ``edgekit inspect`` prints for a report.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from edgekit.errors import EdgekitError
from edgekit.optimize.search_state import Outcome, SearchResult

REPORT_VERSION = 1


def outcome_data(o: Outcome) -> dict[str, Any]:
    c = o.comparison
    lat = o.latency
    return {
        "name": o.name,
        "status": o.status,
        "precision": o.precision,
        "runtime": o.runtime,
        "label": o.label,
        "method": o.method,
        "settings": dict(o.settings),
        "reason": o.reason,
        "baseline": o.baseline,
        "size_bytes": o.size_bytes or None,
        "build_s": round(o.build_s, 3),
        "accuracy": None if c is None else c.summary(),
        "top1_agreement": None if c is None else c.top1_agreement,
        "cosine": None if c is None else c.cosine,
        "relative_error": None if c is None else c.relative_error,
        "latency_p50_ms": None if lat is None else lat.p50_ms,
        "latency_p90_ms": None if lat is None else lat.p90_ms,
        "latency_iqr_ms": None if lat is None else lat.iqr_ms,
        # ONNX Runtime FP32 source p50 / this p50, both measured in the round named by timed_in
        "speed_vs_fp32": o.speed_vs_reference,
        "timed_in": o.timed_in or None,
        "reference_p50_ms": o.reference_p50_ms,
        "excluded_nodes": list(o.excluded_nodes),
        # where the latency was measured: this host, a device profile, or nowhere ("not measured here")
        "latency_from": o.latency_from or ("host" if lat is not None else None),
        "device_rank": o.device_rank,  # the target's expected device speed order where latency is not measured
    }


def report_data(result: SearchResult, target: str, gate_passed: bool, preprocess: str = "") -> dict[str, Any]:
    ref = result.reference_latency.p50_ms if result.reference_latency else None
    base = result.baseline
    return {
        "report_version": REPORT_VERSION,
        "target": target,
        "objective": result.objective,
        "threads": result.threads,
        "chosen": result.chosen.name,
        "why": result.why,
        "final_gate_passed": gate_passed,
        "slower_than_fp32": result.slower_than_fp32,
        "reference": "onnxruntime fp32 (source model), timed in the same loop",
        "reference_p50_ms": ref,  # the final round: the chosen's and the baseline's round
        "baseline": base.name if base else None,
        "baseline_p50_ms": base.p50_ms if base else None,
        # what decides "slower than fp32" (and what auto never ships anything slower than)
        "speed_vs_baseline": speed_vs_baseline(result),
        "selection": result.data.selection_source,
        "calibration": {"samples": len(next(iter(result.data.calib.values()))), "of": result.data.calib_total,
                        "sha256": result.data.calib_sha256},
        "elapsed_s": round(result.elapsed_s, 1),
        # the pre-processing images were read with (calibration and evaluation), "" for arrays
        "preprocess": preprocess or None,
        "notes": list(result.notes),
        "candidates": [outcome_data(o) for o in result.outcomes],
    }  # fmt: skip


def write_report(result: SearchResult, stem: Path, target: str, gate_passed: bool, preprocess: str = "") -> Path:
    """Write ``stem.report.{json,md,png}``; returns the ``.md`` path. ``preprocess``: the steps
    images were read with (``validate.preprocess.describe_steps``), shown beside the calibration."""
    data = report_data(result, target, gate_passed, preprocess)
    stem = Path(stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path = stem.with_name(stem.name + ".report.json")
    json_path.write_text(json.dumps(data, indent=1) + "\n")
    png = stem.with_name(stem.name + ".report.png")
    plotted = plot(data, png)
    md = stem.with_name(stem.name + ".report.md")
    md.write_text(markdown(data, png.name if plotted else None))
    return md


def markdown(data: dict[str, Any], png_name: str | None) -> str:
    lines = [
        f"# {data['target']}: {data['chosen']}",
        "",
        f"Objective **{data['objective']}**, threads {data['threads'] or 'runtime default'}; chosen: "
        f"**{data['chosen']}** — {data['why']}.",
        f"Selection on {data['selection']}; the final gate ran on held-out evaluation samples "
        f"({'passed' if data['final_gate_passed'] else 'FAILED'})"
        + (", **slower than fp32**" if data["slower_than_fp32"] else "")
        + ".",
        f"Calibration: {data['calibration']['samples']} of {data['calibration']['of']} samples, "
        f"sha256 `{data['calibration']['sha256'][:16]}`. Search took {data['elapsed_s']} s.",
        *([f"Images read with: {data['preprocess']}."] if data.get("preprocess") else []),
        "",
        *_speed_lines(data),
        "",
        "| candidate | status | runtime | accuracy vs fp32 | size | p50 ms | p90 ms | IQR ms | speed vs "
        + ("the target's fp32 on the device" if _profiled(data) else "ORT fp32")
        + " | round |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in data["candidates"]:

        def f(key: str, fmt: str = "{:.3f}", c: dict[str, Any] = c) -> str:
            v = c.get(key)
            return "-" if v is None else fmt.format(v)

        status = c["status"] + (f": {c['reason']}" if c["reason"] else "")
        size = "-" if not c["size_bytes"] else f"{c['size_bytes'] / 1024:.0f} KB"
        lines.append(
            f"| {c['name']} | {status.replace('|', '/')} | {c['runtime'] or '-'} | {c['accuracy'] or '-'} | {size} | "
            f"{f('latency_p50_ms')} | {f('latency_p90_ms')} | {f('latency_iqr_ms')} | {f('speed_vs_fp32', '{:.2f}x')} "
            f"| {c.get('timed_in') or '-'} |"
        )
    profiled = sorted({c["latency_from"] for c in data["candidates"] if c.get("latency_from") not in (None, "host")})
    if profiled:
        names = [c["name"] for c in data["candidates"] if c.get("latency_from") in profiled]
        lines += ["", f"Latency from the {', '.join(profiled)}: {', '.join(names)}."]
    elif not any(c["latency_p50_ms"] is not None for c in data["candidates"]):
        lines += ["", "Latency: not measured here (the target's runtime does not run on this host)."]
    excluded: list[str] = next((c["excluded_nodes"] for c in data["candidates"] if c["status"] == "chosen"), [])
    if excluded:
        lines += ["", f"Layers kept in float (mixed precision): {', '.join(excluded)}"]
    if data["notes"]:
        lines += ["", "Notes:", *(f"- {n}" for n in data["notes"])]
    if png_name:
        lines += ["", f"![accuracy vs latency]({png_name})"]
    return "\n".join(lines) + "\n"


def speed_vs_baseline(result: SearchResult) -> float | None:
    """The target's FP32 baseline p50 / the chosen's p50, both from the final round."""
    base, chosen = result.baseline, result.chosen
    if base is None or base.p50_ms is None or chosen.p50_ms is None or chosen.p50_ms <= 0:
        return None
    return base.p50_ms / chosen.p50_ms


def _profiled(data: dict[str, Any]) -> bool:
    return any(c.get("latency_from") not in (None, "host") for c in data["candidates"])


def _speed_lines(data: dict[str, Any]) -> list[str]:
    chosen = next((c for c in data["candidates"] if c["status"] == "chosen"), None)
    if chosen is None or chosen.get("speed_vs_fp32") is None:
        return []
    if chosen.get("latency_from") not in (None, "host"):  # a device profile: ratios to the target's FP32 there
        return [
            "",
            f"Speed of the chosen on the device ({chosen['latency_from']}): {chosen['speed_vs_fp32']:.2f}x "
            f"{data.get('baseline')} (the target's fp32, timed on the device; the host's ORT fp32 is not compared).",
        ]
    line = (
        f"Speed of the chosen, one side-by-side round ({chosen['timed_in']}): "
        f"{chosen['speed_vs_fp32']:.2f}x ORT fp32 (source)"
    )
    if data.get("speed_vs_baseline") is not None and data.get("baseline") != data["chosen"]:
        line += (
            f", {data['speed_vs_baseline']:.2f}x {data['baseline']} (the target's fp32 on its runtime: this one "
            "decides 'slower than fp32' and what auto ships)"
        )
    return ["", line + ". Candidates left out of the final round carry their quick-round p50 and ratio."]


def plot(data: dict[str, Any], path: Path) -> bool:
    """Accuracy vs p50 latency, marker area ~ size, Pareto front, choice circled. ``False`` when
    matplotlib is not installed or nothing has both numbers."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    points = []
    for c in data["candidates"]:
        acc = c["top1_agreement"] if c["top1_agreement"] is not None else c["cosine"]
        if acc is None or c["latency_p50_ms"] is None:
            continue
        points.append((c["latency_p50_ms"], acc, c["size_bytes"] or 1, c))
    if not points:
        return False
    biggest = max(p[2] for p in points)
    fig, ax = plt.subplots(figsize=(9, 5.5), dpi=110)
    for i, (lat, acc, size, c) in enumerate(points, 1):
        colour = {"chosen": "#1b7837", "passed": "#4575b4", "failed": "#d73027"}.get(c["status"], "#999999")
        area = 40 + 400 * size / biggest
        ax.scatter(
            [lat],
            [acc],
            s=area,
            color=colour,
            alpha=0.55,
            edgecolors="black",
            linewidths=0.5,
            label=f"{i}: {c['name']}"
            + (" (chosen)" if c["status"] == "chosen" else "")
            + (" (quick round)" if c.get("timed_in") == "quick" else ""),  # another measurement than the rest
        )
        ax.annotate(str(i), (lat, acc), fontsize=7, ha="center", va="center")
        if c["status"] == "chosen":
            ax.scatter([lat], [acc], s=area * 2.5, facecolors="none", edgecolors="#1b7837", linewidths=2)
    if max(p[0] for p in points) > 5 * min(p[0] for p in points):
        from matplotlib.ticker import NullFormatter, ScalarFormatter

        ax.set_xscale("log")
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())  # minor labels overlap on a short log axis
    front = pareto([(p[0], p[1]) for p in points])
    if len(front) > 1:
        ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="#555555", linewidth=1, label="Pareto front")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, markerscale=0.4)
    ax.set_xlabel("p50 latency, batch 1 (ms)")
    ax.set_ylabel("top-1 agreement with fp32" if points[0][3]["top1_agreement"] is not None else "cosine to fp32")
    ax.set_title(f"{data['target']}: candidates (marker area = artifact size; circled = chosen)", fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both lower latency and higher accuracy, by latency."""
    front: list[tuple[float, float]] = []
    best = float("-inf")
    for lat, acc in sorted(points, key=lambda p: (p[0], -p[1])):
        if acc > best:
            front.append((lat, acc))
            best = acc
    return front


def summarise(path: Path) -> str:
    """A few lines for ``edgekit inspect``: the choice, why, and the candidates by status."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise EdgekitError(f"{path}: not a readable candidate report ({exc})") from exc
    counts: dict[str, int] = {}
    for c in data.get("candidates", []):
        counts[c["status"]] = counts.get(c["status"], 0) + 1
    chosen: dict[str, Any] = next((c for c in data.get("candidates", []) if c["status"] == "chosen"), {})
    speed = chosen.get("speed_vs_fp32")
    lines = [
        f"candidates ({data['target']}, objective {data['objective']}): "
        + ", ".join(f"{n} {s}" for s, n in sorted(counts.items())),
        f"chosen: {data['chosen']} ({data['why']})" + (f", {speed:.2f}x ORT fp32" if speed else ""),
    ]
    if data.get("slower_than_fp32"):
        lines.append("slower than fp32 on its runtime")
    return "\n".join(lines)
