"""Prometheus metrics of one agent (its own ``CollectorRegistry``, served at ``GET /metrics``).

The serving pipeline observes the per-stage histograms in one place (``pipeline.Pipeline``);
the lifecycle counts installs, self-tests and rollbacks; the front-end counts requests by code.
Process RSS, CPU and open fds come from ``prometheus_client``'s process collector.

The series updated on every request (stage and request durations, batch sizes, requests by
code) are plain counts behind one lock (``RequestSeries``), exported in the Prometheus format as
usual: ``prometheus_client``'s ``Histogram.observe`` takes two locks and validates its state on
every call (microseconds each on a small device), and a request makes six of them.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Loopback inference of small models takes 0.1-10 ms; big ones on slow CPUs up to seconds. Steps of
# ~1.5x: percentiles are interpolated inside a bucket, so a 1-2-5 series could misplace a p99 by 2x.
_LATENCY_BUCKETS_S = (
    0.00005,
    0.000075,
    0.0001,
    0.00015,
    0.0002,
    0.0003,
    0.0005,
    0.00075,
    0.001,
    0.0015,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.5,
    0.75,
    1.0,
    2.0,
    5.0,
)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
STAGES = ("decode", "queue", "infer", "encode")
# Exact server-side overheads and queue + infer times kept per model (the last ones), for
# percentiles finer than buckets.
OVERHEAD_SAMPLES = 4096


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


class _Series:
    """One histogram series as plain counts (bucket ``i`` counts values in (bounds[i-1], bounds[i]])."""

    __slots__ = ("counts", "total")

    def __init__(self, buckets: int) -> None:
        self.counts = [0] * (buckets + 1)  # the last one: over every bound (+Inf)
        self.total = 0.0


class RequestSeries(Collector):
    """The per-request series: ``edgekit_stage_seconds{model,stage}``,
    ``edgekit_request_duration_seconds{model}``, ``edgekit_batch_size{model}`` and
    ``edgekit_requests_total{model,code}``, each update a bisect and two additions under one lock."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stages: dict[tuple[str, str], _Series] = {}
        self._requests: dict[str, _Series] = {}
        self._batches: dict[str, _Series] = {}
        self._codes: dict[tuple[str, str], int] = {}
        self._overhead: dict[str, _Series] = {}
        self._overhead_samples: dict[str, deque[tuple[float, float]]] = {}
        self._queue_infer_samples: dict[str, deque[float]] = {}

    def observe_stages(self, model: str, stages: Iterable[tuple[str, float]]) -> None:
        with self._lock:
            self._observe_stages(model, stages)

    def _observe_stages(self, model: str, stages: Iterable[tuple[str, float]]) -> None:
        """(under the lock)"""
        bounds = _LATENCY_BUCKETS_S
        queue_infer = 0.0
        ran = False
        for stage, seconds in stages:
            series = self._stages.get((model, stage))
            if series is None:
                series = self._stages[(model, stage)] = _Series(len(bounds))
            series.counts[bisect_left(bounds, seconds)] += 1
            series.total += seconds
            if stage == "queue" or stage == "infer":
                queue_infer += seconds
                ran = ran or stage == "infer"
        if ran:  # the request's own queue + infer time (the p99 of a sum is not the sum of p99s)
            window = self._queue_infer_samples.get(model)
            if window is None:
                window = self._queue_infer_samples[model] = deque(maxlen=OVERHEAD_SAMPLES)
            window.append(queue_infer)

    def queue_infer_samples(self) -> dict[str, list[float]]:
        """Per model, the last ``OVERHEAD_SAMPLES`` requests' queue + infer seconds, oldest first."""
        with self._lock:
            return {m: list(d) for m, d in self._queue_infer_samples.items()}

    def observe_request(
        self,
        model: str,
        code: int,
        seconds: float,
        overhead_s: float | None = None,
        write_cpu_overhead_s: float | None = None,
        stages: Iterable[tuple[str, float]] | None = None,
        stage_model: str = "",
        batch_rows: int = 0,
    ) -> None:
        """One answered request; with ``stages`` (of ``stage_model``'s pipeline) and ``batch_rows``
        (the size of the call it ran in, when that was not observed already), all under one lock."""
        key = (model, str(code))
        bounds = _LATENCY_BUCKETS_S
        with self._lock:
            series = self._requests.get(model)
            if series is None:
                series = self._requests[model] = _Series(len(bounds))
            series.counts[bisect_left(bounds, seconds)] += 1
            series.total += seconds
            self._codes[key] = self._codes.get(key, 0) + 1
            if overhead_s is not None:
                series = self._overhead.get(model)
                if series is None:
                    series = self._overhead[model] = _Series(len(bounds))
                    self._overhead_samples[model] = deque(maxlen=OVERHEAD_SAMPLES)
                series.counts[bisect_left(bounds, overhead_s)] += 1
                series.total += overhead_s
                self._overhead_samples[model].append(
                    (overhead_s, overhead_s if write_cpu_overhead_s is None else write_cpu_overhead_s)
                )
            if stages:
                self._observe_stages(stage_model, stages)
            if batch_rows:
                self._observe_batch(stage_model, batch_rows)

    def overhead_samples(self) -> dict[str, list[tuple[float, float]]]:
        """Per model, the last ``OVERHEAD_SAMPLES`` server-side overheads (seconds), oldest first:
        (as measured, with the response's write counted by its own CPU time)."""
        with self._lock:
            return {m: list(d) for m, d in self._overhead_samples.items()}

    def observe_batch(self, model: str, rows: int) -> None:
        with self._lock:
            self._observe_batch(model, rows)

    def _observe_batch(self, model: str, rows: int) -> None:
        """(under the lock)"""
        series = self._batches.get(model)
        if series is None:
            series = self._batches[model] = _Series(len(_BATCH_BUCKETS))
        series.counts[bisect_left(_BATCH_BUCKETS, rows)] += 1
        series.total += rows

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            stages = [(k, list(v.counts), v.total) for k, v in self._stages.items()]
            requests = [(k, list(v.counts), v.total) for k, v in self._requests.items()]
            batches = [(k, list(v.counts), v.total) for k, v in self._batches.items()]
            codes = list(self._codes.items())
            overhead = [((k,), list(v.counts), v.total) for k, v in self._overhead.items()]
        counter = CounterMetricFamily(
            "edgekit_requests", "Inference requests by model and HTTP status code", labels=["model", "code"]
        )
        for (model, code), n in codes:
            counter.add_metric([model, code], n)
        yield counter
        yield _histogram(
            "edgekit_request_duration_seconds",
            "Inference request time in the server (request received -> response written)",
            ["model"],
            [((m,), c, t) for m, c, t in requests],
            _LATENCY_BUCKETS_S,
        )
        yield _histogram(
            "edgekit_stage_seconds",
            "Time per serving stage (decode, queue, infer, encode), per model",
            ["model", "stage"],
            stages,
            _LATENCY_BUCKETS_S,
        )
        yield _histogram(
            "edgekit_server_overhead_seconds",
            "Server-side time of a 200 inference request (request line received -> response written) "
            "minus its runtime call, per model",
            ["model"],
            overhead,
            _LATENCY_BUCKETS_S,
        )
        batch_series = [((m,), c, t) for m, c, t in batches]
        yield _histogram(
            "edgekit_batch_size", "Samples per runtime call, per model", ["model"], batch_series, _BATCH_BUCKETS
        )


class CacheSeries(Collector):
    """The result cache's series (device_agents/cache): ``edgekit_cache_lookups_total{model,result}``
    (hit, miss, bypass), ``edgekit_cache_hit_seconds{model}`` (a hit's lookup, key included),
    ``edgekit_cache_saved_seconds_total{model}`` (the recorded inference time of each hit minus its
    lookup: an estimate of the time saved), ``edgekit_cache_evictions_total{tier}``,
    ``edgekit_cache_entries{tier}`` and ``edgekit_cache_bytes{tier}`` (memory, disk),
    ``edgekit_cache_paused`` (1 while writing to disk is off: a full disk), ``edgekit_cache_pauses_total``,
    ``edgekit_cache_corrupt_total`` (files moved aside), ``edgekit_cache_write_drops_total``
    (entries not written: the writer was behind) and ``edgekit_cache_deferred_total`` (answers not
    stored at their key's first sighting: ``admit = "second"``). Plain counts under one lock, as
    ``RequestSeries``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lookups: dict[tuple[str, str], int] = {}
        self._hit_s: dict[str, _Series] = {}
        self._saved_s: dict[str, float] = {}
        self._evictions: dict[str, int] = {}
        self._paused = 0
        self._pauses = 0
        self._corrupt = 0
        self._drops = 0
        self._deferred = 0
        self._sizes: list[Callable[[], tuple[int, int, int, int]]] = []
        # approximate mode, per model: (distance threshold, false-hit rate or None, its 95% upper bound, rechecks)
        self._approximate: dict[str, tuple[float, float | None, float, int]] = {}

    def lookup(self, model: str, result: str, seconds: float = 0.0, saved_s: float = 0.0) -> None:
        key = (model, result)
        with self._lock:
            self._lookups[key] = self._lookups.get(key, 0) + 1
            if result == "hit":
                series = self._hit_s.get(model)
                if series is None:
                    series = self._hit_s[model] = _Series(len(_LATENCY_BUCKETS_S))
                series.counts[bisect_left(_LATENCY_BUCKETS_S, seconds)] += 1
                series.total += seconds
                self._saved_s[model] = self._saved_s.get(model, 0.0) + max(0.0, saved_s - seconds)

    def evicted(self, tier: str, n: int) -> None:
        with self._lock:
            self._evictions[tier] = self._evictions.get(tier, 0) + n

    def paused(self, on: bool) -> None:
        with self._lock:
            self._pauses += int(on and not self._paused)
            self._paused = int(on)

    def corrupt(self) -> None:
        with self._lock:
            self._corrupt += 1

    def write_dropped(self) -> None:
        with self._lock:
            self._drops += 1

    def deferred(self) -> None:
        with self._lock:
            self._deferred += 1

    def approximate(self, model: str, threshold: float, rate: float | None, bound: float, rechecked: int) -> None:
        """The approximate mode's state of ``model``: its distance threshold and measured false-hit rate."""
        with self._lock:
            self._approximate[model] = (threshold, rate, bound, rechecked)

    def watch(self, sizes: Callable[[], tuple[int, int, int, int]]) -> None:
        """Read (memory entries, memory bytes, disk entries, disk bytes) from ``sizes`` when scraped."""
        with self._lock:
            self._sizes.append(sizes)

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            lookups = list(self._lookups.items())
            hit_s = [((m,), list(v.counts), v.total) for m, v in self._hit_s.items()]
            saved = list(self._saved_s.items())
            evictions = list(self._evictions.items())
            paused, pauses, corrupt, drops = self._paused, self._pauses, self._corrupt, self._drops
            deferred = self._deferred
            sources = list(self._sizes)
            approximate = list(self._approximate.items())
        yield _counter(
            "edgekit_cache_lookups",
            "Result-cache lookups by model and result (hit, miss, bypass)",
            ["model", "result"],
            lookups,
        )
        yield _histogram(
            "edgekit_cache_hit_seconds",
            "Time of a result-cache hit (key, look-up, compare)",
            ["model"],
            hit_s,
            _LATENCY_BUCKETS_S,
        )
        yield _counter(
            "edgekit_cache_saved_seconds",
            "Estimated inference time saved by result-cache hits (recorded inference time minus the hit's time)",
            ["model"],
            [((m,), v) for m, v in saved],
        )
        yield _counter(
            "edgekit_cache_evictions",
            "Result-cache entries evicted, by tier",
            ["tier"],
            [((t,), n) for t, n in evictions],
        )
        entries = GaugeMetricFamily("edgekit_cache_entries", "Result-cache entries, by tier", labels=["tier"])
        size = GaugeMetricFamily(
            "edgekit_cache_bytes", "Result-cache bytes (keys and values), by tier", labels=["tier"]
        )
        totals = [0, 0, 0, 0]
        for source in sources:
            totals = [a + b for a, b in zip(totals, source(), strict=True)]
        if sources:
            entries.add_metric(["memory"], totals[0])
            size.add_metric(["memory"], totals[1])
            entries.add_metric(["disk"], totals[2])
            size.add_metric(["disk"], totals[3])
        yield entries
        yield size
        threshold = GaugeMetricFamily(
            "edgekit_cache_distance_threshold",
            "Approximate cache: the distance under which a hit is reused",
            labels=["model"],
        )
        rate = GaugeMetricFamily(
            "edgekit_cache_false_hit_rate",
            "Approximate cache: share of rechecked hits whose answer differed from a fresh one (this threshold)",
            labels=["model"],
        )
        bound = GaugeMetricFamily(
            "edgekit_cache_false_hit_bound",
            "Approximate cache: upper end of the false-hit rate's 95% interval",
            labels=["model"],
        )
        rechecks = GaugeMetricFamily(
            "edgekit_cache_rechecks",
            "Approximate cache: hits rechecked since the threshold last changed",
            labels=["model"],
        )
        for model, (t, r, b, n) in approximate:
            threshold.add_metric([model], t)
            if r is not None:
                rate.add_metric([model], r)
            bound.add_metric([model], b)
            rechecks.add_metric([model], n)
        yield threshold
        yield rate
        yield bound
        yield rechecks
        yield GaugeMetricFamily(
            "edgekit_cache_paused", "1 while the result cache does not write to disk (disk full)", value=paused
        )
        yield CounterMetricFamily(
            "edgekit_cache_pauses", "Times the result cache stopped writing to disk", value=pauses
        )
        yield CounterMetricFamily(
            "edgekit_cache_corrupt", "Result-cache files found corrupt and moved aside", value=corrupt
        )
        yield CounterMetricFamily(
            "edgekit_cache_write_drops", "Result-cache entries not written to disk (the writer was behind)", value=drops
        )
        yield CounterMetricFamily(
            "edgekit_cache_deferred",
            "Missed answers not stored at their key's first sighting (admit = second, memory tier full)",
            value=deferred,
        )


def _counter(
    name: str, doc: str, labels: list[str], values: Iterable[tuple[tuple[str, ...], float]]
) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for label_values, value in values:
        family.add_metric(list(label_values), value)
    return family


def _histogram(
    name: str,
    doc: str,
    labels: list[str],
    series: Sequence[tuple[tuple[str, ...], list[int], float]],
    bounds: tuple[float, ...],
) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=labels)
    for values, counts, total in series:
        cumulative, running = [], 0
        for le, n in zip((*bounds, float("inf")), counts, strict=True):
            running += n
            cumulative.append((_le(le), running))
        family.add_metric(list(values), cumulative, total)
    return family


def _le(bound: float) -> str:
    return "+Inf" if bound == float("inf") else repr(float(bound))


class AgentMetrics:
    """Counters the lifecycle, the pipeline and the HTTP server update. ``model=""`` labels
    unknown model names, so that requests for arbitrary names cannot grow the label set."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)
        self.series = RequestSeries()
        r.register(self.series)
        self.cache = CacheSeries()
        r.register(self.cache)
        self.rejects = Counter(
            "edgekit_rejects", "Requests refused for lack of capacity, by reason", ["model", "reason"], registry=r
        )
        self.hung_calls = Counter(
            "edgekit_hung_calls",
            "Runtime calls past server.hung_call_s (the model was reloaded)",
            ["model"],
            registry=r,
        )
        self.hung_call_stops = Counter(
            "edgekit_hung_call_stops",
            "What became of each hung runtime call: terminated (the runtime stopped it, its core is "
            "free again) or abandoned (the runtime cannot stop a call: its thread runs on)",
            ["model", "how"],
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

    def watch_queues(self, source: Callable[[], Iterable[tuple[str, int, int]]]) -> None:
        """Export queue depth and in-flight counts from ``source`` (model, waiting, in flight)."""
        self.registry.register(_QueueDepth(source))

    def observe_request(
        self,
        model: str,
        code: int,
        seconds: float,
        overhead_s: float | None = None,
        write_cpu_overhead_s: float | None = None,
        stages: Iterable[tuple[str, float]] | None = None,
        stage_model: str = "",
        batch_rows: int = 0,
    ) -> None:
        """One answered request; ``overhead_s``: its server-side time minus the runtime call (200s);
        ``write_cpu_overhead_s``: the same with the response's write counted by its CPU time.
        ``stages`` and ``batch_rows``: what the pipeline of ``stage_model`` left to be recorded
        with the request (``pipeline.RequestTiming``), recorded under the same lock."""
        self.series.observe_request(
            model, code, seconds, overhead_s, write_cpu_overhead_s, stages, stage_model, batch_rows
        )

    def observe_stages(self, model: str, stages: Iterable[tuple[str, float]]) -> None:
        """One request's (stage, seconds) pairs, recorded together."""
        self.series.observe_stages(model, stages)

    def observe_batch(self, model: str, rows: int) -> None:
        self.series.observe_batch(model, rows)

    def overhead_samples(self) -> dict[str, list[tuple[float, float]]]:
        return self.series.overhead_samples()

    def queue_infer_samples(self) -> dict[str, list[float]]:
        return self.series.queue_infer_samples()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
