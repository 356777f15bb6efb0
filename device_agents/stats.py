"""Serving numbers from the agent's Prometheus metrics: per model, stage latency percentiles,
throughput, batch sizes, queue depth. Works on a live ``CollectorRegistry`` (``AgentService.stats``)
and on scraped ``/metrics`` text (``edgekit-agent stats``), and on the difference of two
snapshots, so that a live table shows the last interval rather than the whole uptime.

Percentiles are estimated from histogram buckets by linear interpolation inside the bucket, as
Prometheus' ``histogram_quantile`` does: they are as coarse as the buckets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from device_agents.metrics import STAGES

_HISTOGRAMS = {
    "edgekit_stage_seconds": "stage",
    "edgekit_request_duration_seconds": "request",
    "edgekit_batch_size": "batch",
    "edgekit_server_overhead_seconds": "overhead",
    "edgekit_cache_hit_seconds": "cache_hit",
}
# result-cache counters kept per (model, what): lookups by result, and the time saved
_CACHE_COUNTERS = {"edgekit_cache_lookups": "result", "edgekit_cache_saved_seconds": ""}


@dataclass
class Histogram:
    buckets: dict[float, float] = field(default_factory=dict)  # upper bound -> cumulative count
    total: float = 0.0
    count: float = 0.0

    def minus(self, earlier: Histogram | None) -> Histogram:
        if earlier is None:
            return self
        return Histogram(
            {le: c - earlier.buckets.get(le, 0.0) for le, c in self.buckets.items()},
            self.total - earlier.total,
            self.count - earlier.count,
        )

    def quantile(self, q: float) -> float | None:
        if self.count <= 0:
            return None
        rank = q * self.count
        lower_bound, lower_count = 0.0, 0.0
        for le in sorted(self.buckets):
            count = self.buckets[le]
            if count >= rank:
                if math.isinf(le):
                    return lower_bound
                width = count - lower_count
                return lower_bound + (le - lower_bound) * ((rank - lower_count) / width if width else 1.0)
            lower_bound, lower_count = le, count
        return lower_bound

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None


@dataclass
class Snapshot:
    """Histograms keyed by (kind, model, stage), request counts by (model, code), gauges by (name, model)
    (the result cache's by (name, tier)), result-cache counters by (model, result or "saved_s")."""

    histograms: dict[tuple[str, str, str], Histogram] = field(default_factory=dict)
    requests: dict[tuple[str, str], float] = field(default_factory=dict)
    gauges: dict[tuple[str, str], float] = field(default_factory=dict)
    cache: dict[tuple[str, str], float] = field(default_factory=dict)

    def minus(self, earlier: Snapshot | None) -> Snapshot:
        if earlier is None:
            return self
        return Snapshot(
            {k: h.minus(earlier.histograms.get(k)) for k, h in self.histograms.items()},
            {k: v - earlier.requests.get(k, 0.0) for k, v in self.requests.items()},
            dict(self.gauges),
            {k: v - earlier.cache.get(k, 0.0) for k, v in self.cache.items()},
        )

    def models(self) -> list[str]:
        names = {m for _, m, _ in self.histograms} | {m for m, _ in self.requests}
        return sorted(n for n in names if n)


def snapshot(families: Iterable[Any]) -> Snapshot:
    """A ``Snapshot`` from metric families (``registry.collect()`` or the text parser's output)."""
    snap = Snapshot()
    for family in families:
        kind = _HISTOGRAMS.get(family.name)
        for s in family.samples:
            model = s.labels.get("model", "")
            if kind is not None:
                h = snap.histograms.setdefault((kind, model, s.labels.get("stage", "")), Histogram())
                if s.name.endswith("_bucket"):
                    h.buckets[float(s.labels["le"])] = s.value
                elif s.name.endswith("_sum"):
                    h.total = s.value
                elif s.name.endswith("_count"):
                    h.count = s.value
            elif family.name == "edgekit_requests" and s.name.endswith("_total"):
                snap.requests[(model, s.labels.get("code", ""))] = s.value
            elif family.name in ("edgekit_queue_depth", "edgekit_inflight"):
                snap.gauges[(family.name, model)] = s.value
            elif family.name in _CACHE_COUNTERS and s.name.endswith("_total"):
                label = _CACHE_COUNTERS[family.name]
                snap.cache[(model, s.labels[label] if label else "saved_s")] = s.value
            elif family.name in ("edgekit_cache_entries", "edgekit_cache_bytes", "edgekit_cache_paused"):
                snap.gauges[(family.name, s.labels.get("tier", ""))] = s.value
    return snap


def serving_stats(registry: Any, since: Snapshot | None = None, interval_s: float | None = None) -> dict[str, Any]:
    """Per model: requests, errors, throughput (with ``interval_s``), percentiles in ms, batch sizes."""
    return summarize(snapshot(registry.collect()).minus(since), interval_s)


def summarize(snap: Snapshot, interval_s: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for model in snap.models():
        requests = sum(v for (m, _), v in snap.requests.items() if m == model)
        errors = sum(v for (m, code), v in snap.requests.items() if m == model and code != "200")
        row: dict[str, Any] = {"requests": int(requests), "errors": int(errors)}
        if interval_s:
            row["throughput_rps"] = requests / interval_s
        for kind, stage in (("request", ""), *(("stage", s) for s in STAGES)):
            h = snap.histograms.get((kind, model, stage))
            if h is not None and h.count > 0:
                row[stage or "request"] = {f"p{round(q * 100)}_ms": _ms(h.quantile(q)) for q in (0.5, 0.95, 0.99)}
        overhead = snap.histograms.get(("overhead", model, ""))
        if overhead is not None and overhead.count > 0:
            row["server_overhead"] = {f"p{round(q * 100)}_ms": _ms(overhead.quantile(q)) for q in (0.5, 0.95, 0.99)}
        batch = snap.histograms.get(("batch", model, ""))
        if batch is not None and batch.count > 0:
            row["batches"] = int(batch.count)
            row["batch_mean"] = batch.mean
            row["batch_p95"] = batch.quantile(0.95)
        lookups = {r: v for (m, r), v in snap.cache.items() if m == model and r != "saved_s"}
        if any(lookups.values()):
            hits, looked = lookups.get("hit", 0.0), lookups.get("hit", 0.0) + lookups.get("miss", 0.0)
            hit_s = snap.histograms.get(("cache_hit", model, ""))
            row["cache"] = {
                "hits": int(hits),
                "misses": int(lookups.get("miss", 0.0)),
                "bypass": int(lookups.get("bypass", 0.0)),
                "hit_rate": hits / looked if looked else None,
                "hit_p50_ms": _ms(hit_s.quantile(0.5)) if hit_s is not None else None,
                "saved_s": snap.cache.get((model, "saved_s"), 0.0),
            }
        row["queue_depth"] = int(snap.gauges.get(("edgekit_queue_depth", model), 0))
        row["inflight"] = int(snap.gauges.get(("edgekit_inflight", model), 0))
        out[model] = row
    return out


def exact_percentiles(samples: list[float]) -> dict[str, float | int]:
    """p50/p90/p99 in ms of raw samples in seconds (nearest rank), and how many there were."""
    ordered = sorted(samples)
    n = len(ordered)

    def rank(q: float) -> float:
        return round(ordered[min(n - 1, max(0, math.ceil(q * n) - 1))] * 1000, 4)

    return {"p50_ms": rank(0.5), "p90_ms": rank(0.9), "p99_ms": rank(0.99), "samples": n}


def table(stats: dict[str, Any]) -> str:
    """The live table ``edgekit-agent stats`` prints."""
    head = ("MODEL", "REQ/S", "REQS", "ERR", "P50 ms", "P95 ms", "P99 ms", "QUEUE p99", "INFER p99", "BATCH", "QUEUED")
    rows: list[tuple[str, ...]] = [head]
    for model, s in sorted(stats.items()):
        req = s.get("request", {})
        rows.append(
            (
                model,
                _fmt(s.get("throughput_rps")),
                str(s["requests"]),
                str(s["errors"]),
                _fmt(req.get("p50_ms")),
                _fmt(req.get("p95_ms")),
                _fmt(req.get("p99_ms")),
                _fmt(s.get("queue", {}).get("p99_ms")),
                _fmt(s.get("infer", {}).get("p99_ms")),
                _fmt(s.get("batch_mean")),
                str(s["queue_depth"]),
            )
        )
    if len(rows) == 1:
        return "no requests served yet"
    cached = []
    for model, s in sorted(stats.items()):
        c = s.get("cache")
        if c is not None:
            rate = None if c["hit_rate"] is None else 100 * c["hit_rate"]
            cached.append(
                (model, str(c["hits"]), str(c["misses"]), str(c["bypass"]), _fmt(rate), _fmt(c["hit_p50_ms"]),
                 _fmt(c["saved_s"]))
            )  # fmt: skip
    text = _aligned(rows)
    if cached:
        text += "\n" + _aligned([("CACHE", "HITS", "MISSES", "BYPASS", "HIT %", "HIT p50 ms", "SAVED s"), *cached])
    return text


def _aligned(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))) for r in rows
    )


def thread_cpu_line(spent: dict[str, float], seconds: float | None = None, shown: int = 8) -> str:
    """The agent's CPU by OS thread name (``ThreadCpu.since``): cores over ``seconds``, or CPU
    seconds when ``seconds`` is None (since the daemon started); the biggest ``shown`` by name."""
    scale, unit = (1 / seconds, "cores") if seconds else (1.0, "CPU s")
    ordered = sorted(spent.items(), key=lambda kv: -kv[1])
    parts = [f"{name} {s * scale:.2f}" for name, s in ordered[:shown]]
    if len(ordered) > shown:
        parts.append(f"other {sum(s for _, s in ordered[shown:]) * scale:.2f}")
    return f"agent {sum(spent.values()) * scale:.2f} {unit} by thread: " + (", ".join(parts) or "none")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 4)


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"
