"""Printing and saving what the benchmarks measured: a text table, JSON, and a PNG of the ratios."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.registry import Measurement

HEADERS = ("benchmark", "case", "metric", "A", "B", "B/A", "note")


def _value(v: float | None, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "bytes":
        return f"{v / 1024:.1f} KB"
    if unit == "%":
        return f"{v:.1f}%"
    return f"{v:.3f} {unit}"


def format_table(rows: Sequence[Measurement]) -> str:
    lines = [HEADERS]
    for m in rows:
        ratio = m.ratio
        lines.append(
            (
                m.benchmark,
                m.case,
                m.metric,
                f"{m.a_label} {_value(m.a_value, m.unit)}" if m.a_value is not None else m.a_label or "-",
                f"{m.b_label} {_value(m.b_value, m.unit)}" if m.b_value is not None else m.b_label or "-",
                f"{ratio:.2f}x" if ratio is not None else "-",
                m.note,
            )
        )
    widths = [max(len(r[i]) for r in lines) for i in range(len(HEADERS) - 1)]
    out = ["  ".join([*(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)), r[-1]]).rstrip() for r in lines]
    out.insert(1, "  ".join("-" * w for w in widths) + "  ----")
    return "\n".join(out)


def to_json(machine: dict[str, Any], rows: Sequence[Measurement], started: str, duration_s: float) -> dict[str, Any]:
    return {
        "started": started,
        "duration_s": round(duration_s, 1),
        "machine": machine,
        "measurements": [asdict(m) | {"ratio": m.ratio} for m in rows],
    }


def write_json(path: Path, doc: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)
    return path


def write_plot(path: Path, rows: Sequence[Measurement], title: str) -> Path | None:
    """Horizontal bars of B/A per measured row (1.0 marked); None when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    measured = [m for m in rows if m.ratio is not None]
    if not measured:
        return None
    labels = [f"{m.benchmark}: {m.case}, {m.metric}" for m in measured]
    ratios = [m.ratio or 0.0 for m in measured]
    fig, ax = plt.subplots(figsize=(11, 0.4 * len(measured) + 1.8))
    ax.barh(range(len(measured)), ratios, color="tab:blue")  # whether > 1 is good depends on the row
    ax.axvline(1.0, color="black", linewidth=0.8)
    if max(ratios) / max(min(ratios), 1e-9) > 10:  # e.g. HTTP overhead next to quantization ratios
        ax.set_xscale("log")
        ax.set_xlim(min(ratios) / 1.5, max(ratios) * 2.5)
    else:
        ax.set_xlim(0, max(1.0, max(ratios)) * 1.15)
    ax.set_yticks(range(len(measured)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("B / A (size, latency: < 1 is smaller / faster; top-1: 1 = unchanged)")
    for i, r in enumerate(ratios):
        ax.text(r, i, f" {r:.2f}x", va="center", fontsize=8)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
