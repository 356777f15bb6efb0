"""The lifecycle's health window, whatever installed the version: a sideloaded v2 that fails on
real requests inside its window is rolled back to v1 by the lifecycle itself (no update client);
one that serves through it is recorded healthy; the verdict is what the update client reads.
Real HTTP requests (tritonclient) on a real server on loopback, real models."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from device_agents.config import load_config
from device_agents.health import HealthWindows, Traffic, Verdict, traffic
from device_agents.metrics import AgentMetrics
from device_agents.service import AgentService
from device_agents.serving.http import AgentServer
from tests.agent.conftest import write_config
from tests.factories import make_cpu_bundle, sample_inputs, tiny_classifier
from tests.updates.bundles import fragile_classifier

FIELD = sample_inputs(1, seed=5) * 20  # the fragile model's Gather goes out of range
WINDOW = (
    '[updates]\nbroker = "mqtt://127.0.0.1:1"\nfleet = "f"\ndevice_id = "d"\nnotice_keys = ["keys/trusted.pub"]\n'
    "health_window_s = {window}\n"
)


@pytest.fixture()
def agent(tmp_path: Path, keypair: tuple[Path, Path]) -> Iterator[tuple[AgentService, triton.InferenceServerClient]]:
    """An agent serving tiny v1 (a model that takes any input) over HTTP, no update client running."""
    service = AgentService(load_config(write_config(tmp_path / "agent", keypair[1])))
    service.start()
    service.install(make_cpu_bundle(tmp_path / "v1.ekb", tiny_classifier(tmp_path / "t1.onnx", seed=1), keypair[0]))
    server = AgentServer("127.0.0.1", 0, service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    client = triton.InferenceServerClient(server.url.removeprefix("http://"))
    yield service, client
    client.close()
    server.shutdown()
    server.server_close()
    service.stop()


def _infer(client: triton.InferenceServerClient, x: np.ndarray) -> int:
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    try:
        client.infer("tiny", [inp])
    except InferenceServerException as exc:
        return int(exc.status() or 0)
    return 200


def test_lifecycle_rolls_back_a_sideloaded_version_that_fails_real_requests_in_its_window(
    agent: tuple[AgentService, triton.InferenceServerClient], tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    service, client = agent
    v2 = make_cpu_bundle(tmp_path / "v2.ekb", fragile_classifier(tmp_path / "f2.onnx", seed=2), keypair[0], version=2)
    result = service.install(v2, origin="cli")  # a sideload: nothing but the lifecycle watches it
    assert result.changed and service.models() == {"tiny": 2}
    assert _infer(client, sample_inputs(1, seed=1)) == 200  # v2 serves its usual inputs
    codes = [_infer(client, FIELD) for _ in range(4)]  # v1 (held) runs these: they count against v2
    assert codes == [500] * 4
    verdict = service.lifecycle.health_verdict("tiny", 2)
    assert verdict.outcome == "rolled_back" and "v2 failed 4 of 5 requests in its health window" in verdict.reason
    assert service.models() == {"tiny": 1}
    assert service.lifecycle.model_state("tiny").status == "rolled_back"
    assert _infer(client, FIELD) == 200  # v1 serves the field's inputs


def test_lifecycle_records_a_version_healthy_once_it_served_through_its_window(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    service = AgentService(load_config(write_config(tmp_path / "agent", keypair[1], WINDOW.format(window=0.5))))
    service.start()
    try:
        model = tiny_classifier(tmp_path / "t.onnx", seed=1)
        service.install(make_cpu_bundle(tmp_path / "v1.ekb", model, keypair[0], version=1))
        service.install(make_cpu_bundle(tmp_path / "v2.ekb", model, keypair[0], version=2))
        assert service.lifecycle.registry._probation.get("tiny") is not None  # v1 held through the window
        verdict = service.lifecycle.health_verdict("tiny", 2)
        assert verdict == Verdict("tiny", 2, "healthy")
        state = service.lifecycle.model_state("tiny")
        assert state.active_healthy and state.status == "healthy"
        assert service.lifecycle.registry._probation.get("tiny") is None  # the replaced version is closed
    finally:
        service.stop()


def test_health_windows_verdict_for_a_first_install_is_unjudged_at_once() -> None:
    metrics = AgentMetrics()
    windows = HealthWindows(metrics, 60.0, serving=lambda name: 1, rollback=lambda n, w: None, healthy=lambda n: None)
    windows.open("m", 1, None)
    started = time.monotonic()
    assert windows.wait("m", 1) == Verdict("m", 1, "unjudged")
    assert windows.wait("m", 7) == Verdict("m", 7, "replaced")  # not the version whose window is open
    assert time.monotonic() - started < 30
    windows.stop()


def test_health_windows_compare_with_the_previous_version_s_own_traffic(tmp_path: Path) -> None:
    metrics = AgentMetrics()
    serving = {"m": 1}
    rolled: list[str] = []

    def rollback(name: str, why: str) -> None:
        rolled.append(why)
        serving[name] = 1

    windows = HealthWindows(metrics, 60.0, serving=serving.get, rollback=rollback, healthy=lambda n: None,
                            poll_s=0.01)  # fmt: skip
    for _ in range(10):  # v1 served 10 requests, 4 of them failed: a 40% failure rate is its normal
        metrics.observe_request("m", 200, 0.001)
    for _ in range(4):
        metrics.model_failures.labels("m").inc()
    serving["m"] = 2
    windows.open("m", 2, 1)
    for _ in range(10):  # v2: the same rate
        metrics.observe_request("m", 200, 0.001)
    for _ in range(4):
        metrics.model_failures.labels("m").inc()
    time.sleep(0.2)
    assert rolled == []  # no worse than v1
    for _ in range(6):  # now 10 of 16 failed: 62%, clearly worse
        metrics.observe_request("m", 500, 0.001)
        metrics.model_failures.labels("m").inc()
    verdict = windows.wait("m", 2)
    assert verdict.outcome == "rolled_back" and rolled == [verdict.reason]
    assert "v2 failed 10 of 16 requests" in verdict.reason and "v1 failed 4 of 10" in verdict.reason
    assert traffic(metrics, "m").since(Traffic()) == Traffic(26, 14)
    windows.stop()


def test_health_window_retries_recording_healthy_when_the_store_cannot_be_opened_yet() -> None:
    import errno

    metrics = AgentMetrics()
    calls: list[str] = []

    def healthy(name: str) -> None:  # the first try finds no descriptor free (the store's lock file)
        calls.append(name)
        if len(calls) == 1:
            raise OSError(errno.EMFILE, "Too many open files")

    windows = HealthWindows(metrics, 0.05, serving=lambda name: 2, rollback=lambda n, w: None, healthy=healthy,
                            poll_s=0.01)  # fmt: skip
    windows.open("m", 2, 1)
    give_up = threading.Event()
    timer = threading.Timer(30, give_up.set)  # before: the window's thread died, no verdict ever came
    timer.start()
    try:
        assert windows.wait("m", 2, stop=give_up) == Verdict("m", 2, "healthy")
    finally:
        timer.cancel()
    assert calls == ["m", "m"]
    windows.stop()
