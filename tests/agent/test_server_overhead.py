"""The server-side overhead the agent measures itself (request line received -> response written,
minus the runtime call), over a real HTTP server on loopback driven by tritonclient.

The runtime call is made slow on purpose (the real runner behind a fixed sleep): a measurement
that did not subtract the runtime call would report at least that sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from device_agents.config import load_config
from device_agents.service import AgentService
from device_agents.serving.http import AgentServer
from tests.agent.conftest import Bundles, write_config

SLOW_RUN_S = 0.2


class SlowRunner:
    """The real runner, each call held for ``SLOW_RUN_S`` first."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(SLOW_RUN_S)
        return dict(self.inner.run(inputs))

    def describe(self) -> dict[str, Any]:
        return dict(self.inner.describe())

    def close(self) -> None:
        self.inner.close()


@pytest.fixture()
def served(tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles) -> Iterator[tuple[AgentService, str]]:
    service = AgentService(load_config(write_config(tmp_path / "agent", keypair[1])))
    service.start()
    service.install(bundles.v1)
    model = service.lifecycle.registry.get("tiny")
    model.runner = SlowRunner(model.runner)
    server = AgentServer("127.0.0.1", 0, service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield service, server.url.removeprefix("http://")
    server.shutdown()
    server.server_close()
    service.stop()


def _request(client: triton.InferenceServerClient, x: np.ndarray) -> float:
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    t0 = time.perf_counter()
    client.infer("tiny", [inp], outputs=[triton.InferRequestedOutput("probs")])
    return time.perf_counter() - t0


def test_server_overhead_is_each_request_s_server_time_without_its_runtime_call(
    served: tuple[AgentService, str],
) -> None:
    service, address = served
    client = triton.InferenceServerClient(address)
    round_trips = [_request(client, np.ones((1, 3, 16, 16), np.float32)) for _ in range(3)]
    with pytest.raises(InferenceServerException):  # a 400 (wrong shape) is not an answered inference
        _request(client, np.ones((1, 3, 8, 8), np.float32))
    client.close()
    samples = service.metrics.overhead_samples()["tiny"]
    assert len(samples) == 3
    for (overhead, write_cpu), round_trip in zip(samples, round_trips, strict=True):
        # received -> written is inside the client's round trip, and the runtime call took SLOW_RUN_S
        assert 0 < overhead < round_trip - SLOW_RUN_S
        assert 0 < write_cpu < round_trip - SLOW_RUN_S
    stats = service.stats()["tiny"]
    exact = stats["server_overhead_exact"]
    assert exact["samples"] == 3 and exact["p50_ms"] == round(sorted(s[0] for s in samples)[1] * 1000, 4)
    assert stats["server_overhead_exact_write_cpu"]["samples"] == 3
    text = service.metrics_text().decode()
    assert 'edgekit_server_overhead_seconds_count{model="tiny"} 3.0' in text


def test_starting_the_server_moves_what_the_agent_loaded_out_of_the_collector_s_sight(
    served: tuple[AgentService, str],
) -> None:
    import gc

    service, _ = served
    gc.unfreeze()  # (process-wide: the fixture's server froze already)
    assert gc.get_freeze_count() == 0
    server = AgentServer("127.0.0.1", 0, service)
    try:
        assert gc.get_freeze_count() > 0  # a full collection no longer walks the loaded SDKs and models
    finally:
        server.server_close()


def _stage_count(service: AgentService, stage: str) -> float:
    text = service.metrics_text().decode()
    prefix = f'edgekit_stage_seconds_count{{model="tiny",stage="{stage}"}} '
    return next((float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix)), 0.0)


def test_a_request_s_stage_metrics_are_recorded_after_its_answer_is_written(
    served: tuple[AgentService, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Recording the stage and batch metrics is left out of received -> written: a recording that
    waits for the client to have its answer does not wait (recorded before the write, it would
    wait until the client gave up)."""
    service, address = served
    series = service.metrics.series
    answered, recorded = threading.Event(), threading.Event()
    seen: list[bool] = []

    def waits_for_the_answer() -> None:
        seen.append(answered.wait(10))
        recorded.set()

    observe_stages, observe_batch, observe_request = series.observe_stages, series.observe_batch, series.observe_request

    def stages_first(*args: Any, **kwargs: Any) -> None:
        waits_for_the_answer()
        observe_stages(*args, **kwargs)

    def batch_first(*args: Any, **kwargs: Any) -> None:
        waits_for_the_answer()
        observe_batch(*args, **kwargs)

    def request_with_stages(*args: Any, **kwargs: Any) -> None:
        if kwargs.get("stages") or (len(args) > 5 and args[5]):
            waits_for_the_answer()
        observe_request(*args, **kwargs)

    monkeypatch.setattr(series, "observe_stages", stages_first)
    monkeypatch.setattr(series, "observe_batch", batch_first)  # the call it ran in, run in its own thread
    monkeypatch.setattr(series, "observe_request", request_with_stages)
    client = triton.InferenceServerClient(address, network_timeout=30)
    _request(client, np.ones((1, 3, 16, 16), np.float32))
    answered.set()
    assert recorded.wait(30)
    client.close()
    assert seen == [True]  # recorded once, after the client had its answer
    for stage in ("decode", "queue", "infer", "encode"):
        assert _stage_count(service, stage) == 1, stage
    assert 'edgekit_batch_size_count{model="tiny"} 1.0' in service.metrics_text().decode()


def test_every_request_s_stages_and_batch_size_are_recorded_once(served: tuple[AgentService, str]) -> None:
    service, address = served
    client = triton.InferenceServerClient(address)
    for _ in range(4):
        _request(client, np.ones((1, 3, 16, 16), np.float32))
    with pytest.raises(InferenceServerException):  # refused after decoding: a decode stage, no batch
        _request(client, np.ones((1, 3, 8, 8), np.float32))
    client.close()
    assert [_stage_count(service, s) for s in ("decode", "queue", "infer", "encode")] == [4, 4, 4, 4]
    text = service.metrics_text().decode()
    assert 'edgekit_batch_size_count{model="tiny"} 4.0' in text and 'edgekit_batch_size_sum{model="tiny"} 4.0' in text


class HangingRunner(SlowRunner):
    """The real runner, each call held until ``release`` is set."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.release = threading.Event()

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.release.wait(30)
        return dict(self.inner.run(inputs))


def test_the_stages_of_a_request_the_watchdog_answered_are_recorded_when_its_thread_comes_back(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    service = AgentService(load_config(write_config(tmp_path / "agent", keypair[1], "[server]\nhung_call_s = 0.5\n")))
    service.start()
    service.install(bundles.v1)
    runner = HangingRunner(service.lifecycle.registry.get("tiny").runner)
    service.lifecycle.registry.get("tiny").runner = runner
    server = AgentServer("127.0.0.1", 0, service)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        client = triton.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=30)
        with pytest.raises(InferenceServerException, match="hung"):
            _request(client, np.ones((1, 3, 16, 16), np.float32))  # answered by the watchdog
        client.close()
        runner.release.set()  # the handler's thread comes back from its runtime call
        deadline = time.monotonic() + 10
        while _stage_count(service, "decode") < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _stage_count(service, "decode") == 1 and _stage_count(service, "queue") == 1
    finally:
        runner.release.set()
        server.shutdown()
        server.server_close()
        service.stop()
