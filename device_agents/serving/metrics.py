"""Prometheus metrics of one agent (its own ``CollectorRegistry``, served at ``GET /metrics``)."""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Loopback inference of small models takes 0.1-10 ms; big ones on slow CPUs up to seconds.
_LATENCY_BUCKETS_S = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class AgentMetrics:
    """Counters the manager and the HTTP server update. ``model=""`` labels unknown model names,
    so that requests for arbitrary names cannot grow the label set."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "edgekit_requests", "Inference requests by model and HTTP status code", ["model", "code"], registry=r
        )
        self.request_seconds = Histogram(
            "edgekit_request_duration_seconds",
            "Inference request time in the server (decode, run, encode)",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.model_version = Gauge("edgekit_model_version", "Version being served, per model", ["model"], registry=r)
        self.selftests = Counter(
            "edgekit_selftests",
            "Self-test results of candidate models (passed / failed)",
            ["model", "result"],
            registry=r,
        )
        self.selftest_p50_seconds = Gauge(
            "edgekit_selftest_latency_p50_seconds", "p50 latency measured by the last self-test", ["model"], registry=r
        )
        self.installs = Counter(
            "edgekit_installs",
            "Installs by result (installed, unchanged, rejected by the self-test)",
            ["model", "result"],
            registry=r,
        )
        self.rollbacks = Counter("edgekit_rollbacks", "Rollbacks to the previous version", ["model"], registry=r)
        self.model_failures = Counter(
            "edgekit_model_failures",
            "Requests the serving version failed to run that count against it (the version it "
            "replaced, replayed on the same inputs, did not fail too)",
            ["model"],
            registry=r,
        )
        self.verify_failures = Counter(
            "edgekit_verify_failures",
            "Installed slots whose files or signature failed verification at rest",
            ["model"],
            registry=r,
        )
        # labels() costs a dict lookup under a lock; cache the children used on every request
        self._children: dict[tuple[str, int], tuple[Counter, Histogram]] = {}
        self._lock = threading.Lock()

    def observe_request(self, model: str, code: int, seconds: float) -> None:
        key = (model, code)
        pair = self._children.get(key)
        if pair is None:
            with self._lock:
                pair = (self.requests.labels(model, str(code)), self.request_seconds.labels(model))
                self._children[key] = pair
        pair[0].inc()
        pair[1].observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
