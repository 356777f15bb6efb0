"""Latency against bandwidth: all-local, all-remote and the best split, as a PNG (matplotlib)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from edgekit.errors import MissingSDKError
from edgekit.split.plan import LOCAL, REMOTE, Plan


def plot(plan: Plan, path: Path, *, title: str = "") -> Path:
    """Curves from the lowest to the highest planned bandwidth (log scale, 200 points), at the
    plan's RTT; the planned bandwidths are marked with the option chosen there."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingSDKError("matplotlib", "host", "the split plan's plot") from exc
    bws = [c.bandwidth_mbps for c in plan.choices]
    rtt = plan.choices[0].rtt_ms
    lo, hi = min(bws), max(bws)
    xs = np.geomspace(lo / 2, hi * 2, 200)
    local, remote = plan.option(LOCAL), plan.option(REMOTE)
    cuts = plan.cuts
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(xs, [local.latency_ms(x, rtt) for x in xs], label="all local", color="tab:blue")
    ax.plot(xs, [remote.latency_ms(x, rtt) for x in xs], label="all remote", color="tab:red")
    if cuts:
        ax.plot(
            xs,
            [min(o.latency_ms(x, rtt) for o in cuts) for x in xs],
            label="best split",
            color="tab:green",
            linestyle="--",
        )
    for c in plan.choices:
        ax.scatter([c.bandwidth_mbps], [c.best_ms], color="black", zorder=3, s=14)
        ax.annotate(c.best, (c.bandwidth_mbps, c.best_ms), textcoords="offset points", xytext=(4, 6), fontsize=8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("bandwidth (Mbit/s)")
    ax.set_ylabel(f"end-to-end latency per sample (ms), RTT {rtt:g} ms")
    ax.set_title(title or "split inference: latency against bandwidth")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
