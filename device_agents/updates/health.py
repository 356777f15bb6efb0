"""Health of a version just switched to, judged by the requests it serves on this device.

Before the switch the lifecycle's self-test already compared the candidate's golden outputs and
p50 latency with the previous version's on this device. What it cannot see is real traffic: a
model that passes its golden vectors but fails on inputs met in the field. During the health
window the update client compares the new version's failed requests (HTTP 500: the runtime
raised or hung) with the previous version's, from the agent's own request counters, and rolls back when
the new version fails clearly more often.
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
    failed: int = 0  # answered 500

    def since(self, earlier: Traffic) -> Traffic:
        return Traffic(self.requests - earlier.requests, self.failed - earlier.failed)

    @property
    def failure_rate(self) -> float:
        return self.failed / self.requests if self.requests else 0.0


def traffic(metrics: AgentMetrics, name: str) -> Traffic:
    """Inference requests served for model ``name`` since the agent started."""
    requests = failed = 0
    for family in metrics.registry.collect():
        if family.name != "edgekit_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total") and sample.labels.get("model") == name:
                n = int(sample.value)
                requests += n
                # 500 only: the runtime raised or hung. 503/504/429 (queue full, deadline passed,
                # draining) and 4xx (bad input) say nothing about the model.
                if sample.labels.get("code", "") == "500":
                    failed += n
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
