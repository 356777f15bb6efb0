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


# Panels of the plot, in order: which rows each holds and how its x axis reads.
PANELS = (
    ("size", "artifact size (KB), A vs B"),
    ("accuracy", "held-out top-1 (%), A vs B"),
    ("latency", "latency (ms, log scale): p50, whiskers p25-p75 where measured"),
    ("speedup", "speed-up of B over A (A time / B time, log scale): right of 1.0 = B faster"),
    ("seconds", "fleet timings (s), A vs B"),
)
A_COLOUR, B_COLOUR = "#8c8c8c", "#1f77b4"


def panel_of(m: Measurement) -> str | None:
    """Which value panel a row belongs in (``None``: not plotted, e.g. counts)."""
    return {"bytes": "size", "%": "accuracy", "ms": "latency", "s": "seconds"}.get(m.unit)


def is_speed(m: Measurement) -> bool:
    """Rows whose B/A is a time ratio that reads as a speed-up (latency, time to serving)."""
    return m.unit in ("ms", "s") and ("latency" in m.metric or "time to serving" in m.metric)


def load_rows(path: Path) -> list[Measurement]:
    """The measurements of a ``latest.json`` (to re-plot without re-measuring)."""
    doc = json.loads(Path(path).read_text())
    rows = []
    for item in doc["measurements"]:
        item = {k: v for k, v in item.items() if k != "ratio"}
        for side in ("a_spread", "b_spread"):
            if item.get(side) is not None:
                item[side] = tuple(item[side])
        rows.append(Measurement(**item))
    return rows


def write_plot(path: Path, rows: Sequence[Measurement], title: str) -> Path | None:
    """``plot(rows, title)`` saved as a PNG; None when matplotlib is absent or nothing was measured."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig = plot(rows, title)
    if fig is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot(rows: Sequence[Measurement], title: str) -> Any:
    """A matplotlib figure with one panel per kind of number (size, accuracy, latency with spread,
    speed-up around a 1.0 line, fleet timings), absolute values written next to each bar or dot."""
    import matplotlib.pyplot as plt

    measured = [m for m in rows if m.a_value is not None and m.b_value is not None]
    groups: dict[str, list[Measurement]] = {key: [] for key, _ in PANELS}
    for m in measured:
        kind = panel_of(m)
        if kind is not None:
            groups[kind].append(m)
        if is_speed(m) and m.b_value:
            groups["speedup"].append(m)
    panels = [(key, label, groups[key]) for key, label in PANELS if groups[key]]
    if not panels:
        return None
    heights = [max(1.6, 0.26 * len(g) * (1 if key in ("speedup", "accuracy") else 2) + 0.7) for key, _, g in panels]
    fig, axes = plt.subplots(
        len(panels), 1, figsize=(11, sum(heights) + 1.2), gridspec_kw={"height_ratios": heights}, squeeze=False
    )
    for ax, (key, label, group) in zip(axes[:, 0], panels, strict=True):
        if key == "speedup":
            _speedup_panel(ax, group)
        else:
            _value_panel(ax, key, group)
        ax.set_title(label, fontsize=9, loc="left")
        ax.tick_params(axis="x", labelsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / (sum(heights) + 1.2)))
    return fig


def _row_label(m: Measurement, with_metric: bool) -> str:
    return f"{m.benchmark}: {m.case}" + (f", {m.metric}" if with_metric else "")


def _scale(key: str, v: float) -> float:
    return v / 1024 if key == "size" else v


def _text(key: str, v: float) -> str:
    if key == "size":
        return f"{v / 1024:.0f} KB"
    if key == "accuracy":
        return f"{v:.1f}%"
    return f"{v:.3g} {'ms' if key == 'latency' else 's'}"


def _value_panel(ax: Any, key: str, group: Sequence[Measurement]) -> None:
    """Two bars per row (A grey, B blue), each labelled with its own value and side."""
    with_metric = key in ("latency", "seconds")
    ticks, labels = [], []
    values: list[float] = []
    for i, m in enumerate(group):
        for j, (side, v, spread, colour) in enumerate(
            ((m.a_label, m.a_value, m.a_spread, A_COLOUR), (m.b_label, m.b_value, m.b_spread, B_COLOUR))
        ):
            y = (i + j * 0.4) if key == "accuracy" else (2 * i + j * 0.8)
            x = _scale(key, float(v or 0.0))
            values.append(x)
            err = None
            if spread is not None:
                err = [[max(0.0, x - _scale(key, spread[0]))], [max(0.0, _scale(key, spread[1]) - x)]]
            if key in ("accuracy", "latency"):
                # dots: a bar from 0 would make 98% vs 99% look huge and alike, and on a log axis a bar's
                # length means nothing; the whiskers are the measured p25-p75
                ax.errorbar([x], [y], xerr=err, fmt="o", color=colour, capsize=3, markersize=5, linewidth=1)
            else:
                ax.barh(y, x, height=0.7, color=colour, xerr=err, capsize=2, error_kw={"linewidth": 0.8})
            ax.text(x, y, f"  {_text(key, float(v or 0.0))} {side}", va="center", fontsize=7)
        ticks.append(i + 0.2 if key == "accuracy" else 2 * i + 0.4)
        labels.append(_row_label(m, with_metric))
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.invert_yaxis()
    if key == "accuracy":
        low = min(values)
        ax.set_xlim(max(0.0, low - max(2.0, (100 - low))), 101.0)
    elif key == "latency" and max(values) / max(min(values), 1e-9) > 20:
        ax.set_xscale("log")
        ax.set_xlim(min(values) / 2, max(values) * 12)
    else:
        ax.set_xlim(0, max(values) * 1.35)


def _speedup_panel(ax: Any, group: Sequence[Measurement]) -> None:
    """Bars from the 1.0 line: A time / B time, right = B faster, left = B slower."""
    import math

    speedups = [float(m.a_value or 0.0) / float(m.b_value or 1.0) for m in group]
    for i, r in enumerate(speedups):
        colour = B_COLOUR if r >= 1 else "#d62728"
        ax.barh(i, r - 1.0, left=1.0, height=0.7, color=colour)
        factor = r if r >= 1 else 1 / r if r > 0 else math.inf
        verdict = "about the same" if abs(math.log(r)) < 0.02 else f"{factor:.2f}x {'faster' if r >= 1 else 'slower'}"
        ax.text(r, i, f"  {r:.2f}x: {verdict}  ", va="center", ha="left" if r >= 1 else "right", fontsize=7)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    low, high = min([*speedups, 1.0]), max([*speedups, 1.0])
    ax.set_xlim(low / 30, high * 4)  # room for the labels of slower rows, left of their bars
    ax.set_yticks(range(len(group)), [_row_label(m, True) for m in group], fontsize=8)
    ax.invert_yaxis()
