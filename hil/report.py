"""The HIL report: what each scenario measured on the board, as Markdown, JSON and PNG plots.

``--report DIR`` writes ``DIR/report.json`` (everything, machine-readable), ``DIR/report.md`` (a
table per scenario), ``DIR/latency.png`` (the batch-1 latency distribution with the bundle's
recorded host p50) and ``DIR/rss.png`` (the agent's RSS over the whole run, scenarios marked).
Numbers are measured on the board in this run; what the bundle recorded is shown beside them.
"""

from __future__ import annotations

import json
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class ScenarioResult:
    name: str
    outcome: str = "not run"  # passed, failed, skipped
    seconds: float = 0.0
    reason: str = ""  # why it was skipped or failed
    measured: dict[str, Any] = field(default_factory=dict)


@dataclass
class HilReport:
    board: str
    started: float = field(default_factory=time.time)
    scenarios: dict[str, ScenarioResult] = field(default_factory=dict)
    latencies_ms: list[float] = field(default_factory=list)  # batch-1 requests over the network
    recorded_p50_ms: float | None = None  # the bundle's host p50
    rss: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, bytes)
    marks: list[tuple[float, str]] = field(default_factory=list)  # (seconds since start, scenario started)

    def scenario(self, name: str) -> ScenarioResult:
        return self.scenarios.setdefault(name, ScenarioResult(name))

    def measure(self, name: str, **values: Any) -> None:
        self.scenario(name).measured.update(values)

    def mark(self, name: str) -> None:
        self.marks.append((time.time() - self.started, name))

    def add_rss(self, rss_bytes: int) -> None:
        self.rss.append((time.time() - self.started, rss_bytes))

    # -- writing ----------------------------------------------------------------------------
    def to_data(self) -> dict[str, Any]:
        return {
            "board": self.board,
            "host": f"{platform.node()} ({platform.machine()}, Python {platform.python_version()})",
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.started)),
            "seconds": round(time.time() - self.started, 1),
            "scenarios": {
                name: {"outcome": s.outcome, "seconds": round(s.seconds, 2), "reason": s.reason, "measured": s.measured}
                for name, s in self.scenarios.items()
            },
            "latency_ms": self.latencies_ms,
            "recorded_host_p50_ms": self.recorded_p50_ms,
            "rss": [{"t_s": round(t, 3), "rss_bytes": b} for t, b in self.rss],
        }

    def write(self, directory: Path) -> list[Path]:
        directory.mkdir(parents=True, exist_ok=True)
        data = self.to_data()
        written = [directory / "report.json", directory / "report.md"]
        written[0].write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        written[1].write_text(self.markdown(data))
        written += self._plots(directory)
        return written

    def markdown(self, data: dict[str, Any]) -> str:
        lines = [
            f"# edgekit HIL report: {self.board}",
            "",
            f"Run on {data['host']} at {data['started']}, {data['seconds']} s in all.",
            "",
            "| scenario | outcome | seconds | measured / reason |",
            "| --- | --- | ---: | --- |",
        ]
        for s in self.scenarios.values():
            measured = ", ".join(f"{k} = {_fmt(v)}" for k, v in s.measured.items())
            detail = "; ".join(x for x in (measured, s.reason) if x)
            lines.append(f"| {s.name} | {s.outcome} | {s.seconds:.1f} | {detail.replace('|', '/')} |")
        lines += ["", "Plots: `latency.png` (batch-1 latency on the board), `rss.png` (agent RSS over the run).", ""]
        return "\n".join(lines)

    def _plots(self, directory: Path) -> list[Path]:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        out = []
        if self.latencies_ms:
            fig, ax = plt.subplots(figsize=(7, 4))
            values = sorted(self.latencies_ms)
            low, high = max(values[0], 1e-3), max(values[-1], values[0] * 1.01, 1e-3)
            if self.recorded_p50_ms:
                low = min(low, self.recorded_p50_ms)
            bins = [low * (high / low) ** (i / 60) for i in range(61)]  # log-spaced: a long tail stays readable
            ax.hist(values, bins=bins, color="#4a7ab5")
            ax.set_xscale("log")
            p50, p99 = values[len(values) // 2], values[min(len(values) - 1, int(len(values) * 0.99))]
            ax.axvline(p50, color="black", linestyle="-", label=f"board p50 {p50:.2f} ms")
            ax.axvline(p99, color="black", linestyle="--", label=f"board p99 {p99:.2f} ms")
            if self.recorded_p50_ms is not None:
                ax.axvline(
                    self.recorded_p50_ms, color="#c0392b", label=f"bundle's host p50 {self.recorded_p50_ms:.3f} ms"
                )
            ax.set_xlabel("request latency over the network, batch 1 (ms)")
            ax.set_ylabel("requests")
            ax.set_title(f"{self.board}: {len(values)} requests")
            ax.legend()
            fig.tight_layout()
            out.append(directory / "latency.png")
            fig.savefig(out[-1], dpi=100)
            plt.close(fig)
        if self.rss:
            fig, ax = plt.subplots(figsize=(9, 4))
            ax.plot([t for t, _ in self.rss], [b / 2**20 for _, b in self.rss], ".", markersize=2, color="#2e7d32")
            top = max(b for _, b in self.rss) / 2**20
            ax.set_ylim(0, top * 1.05)
            ran = [(t, n) for t, n in self.marks if self.scenario(n).outcome != "skipped"]
            for i, (t, name) in enumerate(ran):
                ax.axvline(t, color="grey", linewidth=0.5)
                # alternately hung from the top and stood on the bottom: short scenarios' labels do not overlap
                y, align = (top * 1.05, "top") if i % 2 == 0 else (0.0, "bottom")
                ax.text(t, y, name, rotation=90, fontsize=7, va=align, ha="right", color="grey")
            ax.set_xlabel("seconds since the run started")
            ax.set_ylabel("agent RSS (MiB)")
            ax.set_title(f"{self.board}: agent resident memory (gaps: agent off)")
            fig.tight_layout()
            out.append(directory / "rss.png")
            fig.savefig(out[-1], dpi=100)
            plt.close(fig)
        return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)
