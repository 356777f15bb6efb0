"""The per-request series (``RequestSeries``): plain counts exported as Prometheus histograms and
counters that parse back to what was observed."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from device_agents.metrics import AgentMetrics
from device_agents.stats import snapshot, summarize


def test_request_series_export_the_stages_requests_and_batches_observed() -> None:
    metrics = AgentMetrics()
    for ms in (0.04, 0.09, 0.4, 3.0, 12.0):  # one value per decade or so, each in its own bucket
        metrics.observe_stages("m", [("decode", ms / 1000), ("infer", 2 * ms / 1000)])
    metrics.observe_request("m", 200, 0.001)
    metrics.observe_request("m", 429, 0.0001)
    metrics.observe_batch("m", 3)
    metrics.observe_batch("m", 16)
    text = metrics.exposition().decode()
    assert 'edgekit_requests_total{code="200",model="m"} 1.0' in text
    assert 'edgekit_stage_seconds_bucket{le="0.0005",model="m",stage="decode"} 3.0' in text
    assert 'edgekit_stage_seconds_bucket{le="+Inf",model="m",stage="decode"} 5.0' in text
    snap = snapshot(text_string_to_metric_families(text))
    decode = snap.histograms[("stage", "m", "decode")]
    assert decode.count == 5 and abs(decode.total - 0.01553) < 1e-9
    stats = summarize(snap)["m"]
    assert 0.4 <= stats["decode"]["p50_ms"] <= 0.5  # the 3rd of 5 values, inside its (0.3, 0.5] ms bucket
    assert stats["batch_mean"] == 9.5


def test_queue_plus_infer_is_kept_per_request_for_exact_percentiles() -> None:
    metrics = AgentMetrics()
    metrics.observe_stages("m", [("decode", 0.001), ("queue", 0.010), ("infer", 0.002), ("encode", 0.001)])
    metrics.observe_stages("m", [("decode", 0.001), ("queue", 0.001), ("infer", 0.010)])
    metrics.observe_stages("m", [("decode", 0.001)])  # refused before it ran: no queue + infer of its own
    assert metrics.queue_infer_samples() == {"m": [0.012, 0.011]}
