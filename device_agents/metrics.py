"""Prometheus metrics of one agent (its own ``CollectorRegistry``, served at ``GET /metrics``).

The serving pipeline observes the per-stage histograms in one place (``pipeline.Pipeline``);
the lifecycle counts installs, self-tests and rollbacks; the front-end counts requests by code.
Process RSS, CPU and open fds come from ``prometheus_client``'s process collector.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Loopback inference of small models takes 0.1-10 ms; big ones on slow CPUs up to seconds.
_LATENCY_BUCKETS_S = (
    0.00005,
    0.0001,
    0.0002,
    0.0005,
    0.001,
    0.002,
    0.005,
    0.01,
    0.02,
    0.05,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STAGES = ("decode", "queue", "infer", "encode")
REJECT_REASONS = ("queue_full", "deadline", "decode_busy", "connections", "draining", "hung")


class _QueueDepth(Collector):
    """``edgekit_queue_depth{model}`` and ``edgekit_inflight{model}``, read when scraped."""

    def __init__(self, source: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        self.source = source

    def collect(self) -> Iterable[GaugeMetricFamily]:
        depth = GaugeMetricFamily("edgekit_queue_depth", "Requests waiting for a worker, per model", labels=["model"])
        inflight = GaugeMetricFamily(
            "edgekit_inflight", "Requests admitted and not yet answered, per model", labels=["model"]
        )
        for model, waiting, running in self.source():
            depth.add_metric([model], waiting)
            inflight.add_metric([model], running)
        yield depth
        yield inflight


class AgentMetrics:
    """Counters the lifecycle, the pipeline and the HTTP server update. ``model=""`` labels
    unknown model names, so that requests for arbitrary names cannot grow the label set."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.requests = Counter(
            "edgekit_requests", "Inference requests by model and HTTP status code", ["model", "code"], registry=r
        )
        self.request_seconds = Histogram(
            "edgekit_request_duration_seconds",
            "Inference request time in the server (request received -> response written)",
            ["model"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.stage_seconds = Histogram(
            "edgekit_stage_seconds",
            "Time per serving stage (decode, queue, infer, encode), per model",
            ["model", "stage"],
            buckets=_LATENCY_BUCKETS_S,
            registry=r,
        )
        self.batch_size = Histogram(
            "edgekit_batch_size", "Samples per runtime call, per model", ["model"], buckets=_BATCH_BUCKETS, registry=r
        )
        self.rejects = Counter(
            "edgekit_rejects", "Requests refused for lack of capacity, by reason", ["model", "reason"], registry=r
        )
        self.hung_calls = Counter(
            "edgekit_hung_calls",
            "Runtime calls past server.hung_call_s (the model was reloaded)",
            ["model"],
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
            "replaced, replayed on the same inputs, did not fail too; a hung call always counts)",
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
        self._stage_children: dict[tuple[str, str], Histogram] = {}
        self._lock = threading.Lock()

    def watch_queues(self, source: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """Export queue depth and in-flight counts from ``source`` (model, waiting, in flight)."""
        self.registry.register(_QueueDepth(source))

    def observe_request(self, model: str, code: int, seconds: float) -> None:
        key = (model, code)
        pair = self._children.get(key)
        if pair is None:
            with self._lock:
                pair = (self.requests.labels(model, str(code)), self.request_seconds.labels(model))
                self._children[key] = pair
        pair[0].inc()
        pair[1].observe(seconds)

    def observe_stage(self, model: str, stage: str, seconds: float) -> None:
        key = (model, stage)
        child = self._stage_children.get(key)
        if child is None:
            with self._lock:
                child = self._stage_children[key] = self.stage_seconds.labels(model, stage)
        child.observe(seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
