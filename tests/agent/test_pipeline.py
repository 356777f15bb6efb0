"""The serving pipeline in-process, on a real installed model: dynamic batching, the bounded
queue, deadlines, draining and hung-call detection.

The runtime call is held at a gate (the test's fault point: the real runner behind a latch), so
what queues up while a call runs is decided by the test, not by timing luck.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device_agents.config import AgentConfig, BatchingConfig, ModelConfig, load_config
from device_agents.errors import DeadlineExceededError, OverloadedError, RuntimeFailure, UnavailableError
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Decoded, Pipeline
from device_agents.pipeline.batching import Batcher, Job
from edgekit.bundle.errors import ConfigError
from tests.agent.bundles import read_manifest, rebundle
from tests.agent.conftest import Bundles, write_config
from tests.factories import sample_inputs


class Gate:
    """The real runner behind a latch: ``run`` waits until the test opens it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.rows: list[int] = []

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.entered.set()
        self.opened.wait(30)
        self.rows.append(len(next(iter(inputs.values()))))
        return dict(self.inner.run(inputs))

    def describe(self) -> dict[str, Any]:
        return dict(self.inner.describe())

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def lifecycle(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], bundles: Bundles
) -> Iterator[Lifecycle]:
    config = write_config(tmp_path_factory.mktemp("pipeline"), keypair[1])
    lc = Lifecycle(load_config(config))
    lc.start()
    lc.install(bundles.v1)
    yield lc
    lc.stop()


@pytest.fixture()
def gate(lifecycle: Lifecycle) -> Iterator[Gate]:
    model = lifecycle.registry.get("tiny")
    g = Gate(model.runner)
    model.runner = g
    yield g
    g.opened.set()
    model.runner = g.inner


def _config(lifecycle: Lifecycle, batching: BatchingConfig | None = None, **server: Any) -> AgentConfig:
    base = lifecycle.config
    models = {"tiny": ModelConfig(batching=batching)} if batching else {}
    return replace(base, server=replace(base.server, workers=1, **server), models=models)


def _batcher(lifecycle: Lifecycle, batching: BatchingConfig | None = None, **server: Any) -> Batcher:
    s = _config(lifecycle, batching, **server).server
    return Batcher(
        "tiny",
        lambda version: lifecycle.registry.lease("tiny", version),
        batching=batching,
        workers=s.workers,
        queue_size=s.queue_size,
        hung_call_s=s.hung_call_s,
        retry_after_s=s.retry_after_s,
    )


def _job(rows: int, deadline_s: float = 30.0, seed: int = 0) -> Job:
    return Job({"input": sample_inputs(rows, seed=seed)}, None, time.monotonic() + deadline_s)


def _reference(lifecycle: Lifecycle, gate: Gate, x: np.ndarray) -> np.ndarray:
    return np.asarray(gate.inner.run({"input": x})["probs"])


def test_batcher_coalesces_requests_of_different_batch_sizes_and_splits_the_results(
    lifecycle: Lifecycle, gate: Gate
) -> None:
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=5.0))
    first = _job(1)
    batcher.submit(first)
    assert gate.entered.wait(10)  # the worker is inside the runtime call with the first job alone
    queued = [_job(1, seed=1), _job(2, seed=2), _job(3, seed=3)]
    for job in queued:
        batcher.submit(job)
    time.sleep(0.02)  # past max_wait_ms: the next batch runs with what is queued
    gate.opened.set()
    for job in (first, *queued):
        batcher.wait(job)
    assert gate.rows == [1, 6]
    assert [j.batch_rows for j in queued] == [6, 6, 6]
    for job in queued:
        assert job.outputs is not None
        np.testing.assert_allclose(job.outputs["probs"], _reference(lifecycle, gate, job.inputs["input"]), rtol=1e-5)
    batcher.stop(5)


def test_batcher_keeps_queue_order_when_a_job_does_not_fit(lifecycle: Lifecycle, gate: Gate) -> None:
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=1.0))
    batcher.submit(_job(1))
    assert gate.entered.wait(10)
    small, big, last = _job(1), _job(8), _job(1)
    for job in (small, big, last):
        batcher.submit(job)
    time.sleep(0.01)
    gate.opened.set()
    for job in (small, big, last):
        batcher.wait(job)
    # the 8-row job does not fit after the 1-row one; the 1-row job behind it does not overtake it
    assert gate.rows == [1, 1, 8, 1]
    batcher.stop(5)


def test_batcher_min_batch_size_waits_for_more_until_the_deadline_nears(lifecycle: Lifecycle, gate: Gate) -> None:
    gate.opened.set()
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=1.0, min_batch_size=4))
    job = _job(1, deadline_s=1.0)
    batcher.submit(job)
    batcher.wait(job)  # ran alone, before its deadline, although min_batch_size was never reached
    assert gate.rows == [1] and job.outputs is not None
    batcher.stop(5)


def test_a_full_queue_is_refused_with_retry_after(lifecycle: Lifecycle, gate: Gate) -> None:
    batcher = _batcher(lifecycle, queue_size=2, retry_after_s=3)
    jobs = [_job(1)]
    batcher.submit(jobs[0])
    assert gate.entered.wait(10)
    jobs += [_job(1), _job(1)]
    for job in jobs[1:]:
        batcher.submit(job)
    with pytest.raises(OverloadedError, match=r"2 requests are waiting \(server.queue_size\)") as err:
        batcher.submit(_job(1))
    assert (err.value.http_status, err.value.retry_after_s) == (429, 3)
    gate.opened.set()
    for job in jobs:
        batcher.wait(job)
    batcher.stop(5)


def test_a_request_whose_deadline_passes_in_the_queue_is_504_and_never_runs(lifecycle: Lifecycle, gate: Gate) -> None:
    batcher = _batcher(lifecycle)
    running = _job(1)
    batcher.submit(running)
    assert gate.entered.wait(10)
    late = _job(1, deadline_s=0.05)
    batcher.submit(late)
    with pytest.raises(DeadlineExceededError, match="before a worker took it") as err:
        batcher.wait(late)
    assert err.value.http_status == 504
    gate.opened.set()
    batcher.wait(running)
    batcher.stop(5)
    assert gate.rows == [1]  # the late job was dropped, not run


def test_stop_drains_queued_jobs_and_refuses_new_ones(lifecycle: Lifecycle, gate: Gate) -> None:
    batcher = _batcher(lifecycle)
    jobs = [_job(1), _job(2)]
    for job in jobs:
        batcher.submit(job)
    assert gate.entered.wait(10)
    threading.Timer(0.1, gate.opened.set).start()
    assert batcher.stop(10)
    assert all(j.outputs is not None for j in jobs)
    with pytest.raises(UnavailableError, match="shutting down") as err:
        batcher.submit(_job(1))
    assert err.value.http_status == 503


def test_a_hung_runtime_call_fails_its_request_and_the_model_is_reloaded(lifecycle: Lifecycle, gate: Gate) -> None:
    hung_model = lifecycle.registry.get("tiny")
    pipeline = Pipeline(
        "tiny", lifecycle.registry, _config(lifecycle, hung_call_s=0.3), lifecycle.metrics, threading.Semaphore(2)
    )
    x = sample_inputs(1, seed=4)

    def call() -> tuple[dict[str, np.ndarray], int]:
        return pipeline.run(None, lambda model: Decoded(None, {"input": x}), lambda req, out, v: (out, v))

    with pytest.raises(RuntimeFailure, match=r"hung: its runtime call ran over server.hung_call_s \(0.3 s\)"):
        call()  # the gate never opens: the call hangs
    out, version = call()  # a fresh model, loaded again from the store, answers
    assert version == 1 and lifecycle.registry.get("tiny") is not hung_model
    np.testing.assert_allclose(out["probs"], _reference(lifecycle, gate, x), rtol=1e-5)
    assert lifecycle.metrics.hung_calls.labels("tiny")._value.get() == 1
    gate.opened.set()  # the stuck call returns at last: its retired model is closed then
    deadline = time.monotonic() + 10
    while hung_model.runner.inner.session is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert hung_model.runner.inner.session is None
    pipeline.stop(5)


def test_batching_a_static_batch_model_is_a_config_error_naming_its_shape(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    manifest = read_manifest(bundles.v1)
    spec = manifest.signature.inputs[0]
    static = replace(manifest.signature, inputs=(replace(spec, shape=(1, *spec.shape[1:])),))
    bundle = rebundle(bundles.v1, keypair[0], tmp_path / "static.ekb", signature=static)
    config = write_config(tmp_path / "a", keypair[1], "[models.tiny.batching]\nmax_batch_size = 8\n")
    lc = Lifecycle(load_config(config))
    lc.start()
    try:
        with pytest.raises(
            ConfigError, match=r"agent.models.tiny.batching: .* static batch \(input 'input' shape \[1, 3, 16, 16\]\)"
        ):
            lc.install(bundle)
        assert lc.store.model_state("tiny").active is None  # refused before anything was staged
        lc.install(bundles.v1)  # the same config takes the dynamic-batch bundle
    finally:
        lc.stop()


def test_a_model_s_workers_setting_sizes_its_worker_pool(lifecycle: Lifecycle) -> None:
    config = replace(_config(lifecycle), models={"tiny": ModelConfig(workers=3)})
    pipeline = Pipeline("tiny", lifecycle.registry, config, lifecycle.metrics, threading.Semaphore(2))
    try:
        assert sum(t.is_alive() for t in pipeline.batcher._threads) == 3
    finally:
        assert pipeline.stop(5)
    assert not any(t.is_alive() for t in pipeline.batcher._threads)


def test_a_lone_request_does_not_wait_for_a_batch_that_cannot_come(lifecycle: Lifecycle, gate: Gate) -> None:
    gate.opened.set()
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=10_000.0))
    job = _job(1, deadline_s=2.0)  # far shorter than max_wait_ms: waiting for company would miss it
    batcher.submit(job)
    batcher.wait(job)
    assert job.outputs is not None and gate.rows == [1]
    batcher.stop(5)


def test_batching_a_stateful_model_is_a_config_error(bundles: Bundles) -> None:
    manifest = read_manifest(bundles.v1)
    batched = ModelConfig(batching=BatchingConfig())
    batched.check("tiny", manifest)  # dynamic batch, stateless: fine
    with pytest.raises(ConfigError, match=r"agent.models.tiny.batching: model tiny v1 is stateful"):
        batched.check("tiny", manifest.with_updates(stateful=True))
