"""What the self-test's latency is compared with when the child could not time the serving
version side by side: the serving version's live requests over the same window, else its
recorded self-test p50, else the host's; and the window of live times each served model keeps."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from device_agents.config import load_config
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Request
from device_agents.runtimes.latency import LatencyWindow
from device_agents.selftest import SelfTestReport
from device_agents.service import AgentService
from tests.agent.conftest import Bundles
from tests.factories import sample_inputs


@pytest.fixture()
def manager(config_path: Path) -> Iterator[Lifecycle]:
    m = Lifecycle(load_config(config_path))
    m.start()
    yield m
    m.stop()


def test_install_records_a_side_by_side_baseline(manager: Lifecycle, bundles: Bundles) -> None:
    first = manager.install(bundles.v1)
    assert first.selftest is not None and first.selftest.baseline_source in ("host", "")  # nothing served yet
    second = manager.install(bundles.v2)
    assert second.selftest is not None and second.selftest.baseline_source == "side_by_side"
    assert manager.selftest_report("tiny") == second.selftest  # recorded next to the model


def test_live_requests_over_the_window_are_the_baseline_when_not_side_by_side(
    manager: Lifecycle, bundles: Bundles
) -> None:
    manager.install(bundles.v1)
    service = AgentService(manager.config, manager)  # through the pipeline: its batcher's runtime calls record
    start = time.monotonic()
    try:
        for _ in range(10):
            service.infer(
                "tiny", None, lambda model: Request("tiny", {"input": sample_inputs(1, seed=3)}), lambda r: r.outputs
            )
    finally:
        service.drain()
    end = time.monotonic()
    alone = SelfTestReport(passed=True, latency_p50_ms=0.5, latency_window_s=(start, end))
    live = manager._with_baseline("tiny", alone, host_p50_ms=None)
    assert live.baseline_source == "live" and live.baseline_p50_ms is not None and live.baseline_p50_ms > 0
    idle = manager._with_baseline("tiny", replace(alone, latency_window_s=(end + 1, end + 2)), host_p50_ms=None)
    recorded = manager.selftest_report("tiny")
    assert recorded is not None
    assert (idle.baseline_source, idle.baseline_p50_ms) == ("recorded", recorded.latency_p50_ms)


def test_latency_window_takes_the_median_of_calls_inside_the_window() -> None:
    window = LatencyWindow(keep=4)
    for t, ms in [(1.0, 9.0), (2.0, 1.0), (3.0, 2.0), (4.0, 3.0), (5.0, 100.0)]:
        window.record(t, ms)
    assert window.p50_between(2.0, 4.0) == (2.0, 3)  # (1.0, 9.0) fell out of the 4 kept
    assert window.p50_between(6.0, 7.0) == (None, 0)
