"""Health of a version just switched to, judged by the requests it serves on this device.

Before the switch the lifecycle's self-test already compared the candidate's golden outputs and
p50 latency with the previous version's on this device. What it cannot see is real traffic: a
model that passes its golden vectors but fails on inputs met in the field. During the health
window the update client compares the new version's failed requests with the previous
version's, from the agent's own counters, and rolls back when the new version fails clearly
more often. Only failures the previous version did not have count: a request the runtime fails
to run (an HTTP 500: the runtime raised or hung) is replayed on the replaced version, kept
loaded through the window (``Registry.count_failure``), and counted (``edgekit_model_failures``)
only when that one runs it; a hung call counts without a replay. 503/504/429 (queue full,
deadline passed, draining) and 4xx (bad input) say nothing about the model and never count.
"""

from __future__ import annotations

from dataclasses import dataclass

from device_agents.metrics import AgentMetrics

# Roll back once the new version has failed at least this many requests ...
MIN_FAILED_REQUESTS = 3
# ... and its failure rate is this much above the previous version's (0.05 = 5 points).
MAX_FAILURE_RATE_INCREASE = 0.05


@dataclass(frozen=True)
class Traffic:
    """Request counters of one model since some moment (a difference of two snapshots)."""

    requests: int = 0
    failed: int = 0  # failed to run, and counted against the version (edgekit_model_failures)

    def since(self, earlier: Traffic) -> Traffic:
        return Traffic(self.requests - earlier.requests, self.failed - earlier.failed)

    @property
    def failure_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0


def traffic(metrics: AgentMetrics, name: str) -> Traffic:
    """Inference requests served for model ``name`` since the agent started, and its failures
    that count against the version serving them."""
    requests = failed = 0
    for family in metrics.registry.collect():
        if family.name not in ("edgekit_requests", "edgekit_model_failures"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == name:
                if family.name == "edgekit_requests":
                    requests += int(sample.value)
                else:
                    failed += int(sample.value)
    return Traffic(requests, failed)


def failure_verdict(new: Traffic, old: Traffic, new_version: int, old_version: int | None) -> str:
    """Why ``new`` (the switched-to version's traffic) is unhealthy against ``old``, or ""."""
    if new.failed < MIN_FAILED_REQUESTS:
        return ""
    if new.failure_rate <= old.failure_rate + MAX_FAILURE_RATE_INCREASE:
        return ""
    before = f"v{old_version} failed {old.failed} of {old.requests}" if old_version else "no previous traffic"
    return (
        f"v{new_version} failed {new.failed} of {new.requests} requests in its health window "
        f"({new.failure_rate:.0%}; {before})"
    )
