"""The ``batch`` step of ``[budgets] degrade``: while it is on, a batched model's batches form by
its ``budget_max_batch_size`` / ``budget_max_wait_ms``; when the level falls they form as before."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest

from device_agents.config import BatchingConfig, load_config
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Pipeline
from device_agents.pipeline.jobs import Job
from device_agents.pipeline.slots import Slots
from tests.agent.conftest import Bundles, write_config
from tests.factories import sample_inputs


class _Gate:
    """The real runner behind a latch: each call waits until the test opens it; rows per call kept."""

    name: ClassVar[str] = "gate"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.opened = threading.Event()
        self.entered = threading.Event()
        self.rows: list[int] = []

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.entered.set()
        self.opened.wait(30)
        self.rows.append(len(next(iter(inputs.values()))))
        return dict(self.inner.run(inputs))

    def describe(self) -> dict[str, Any]:
        return dict(self.inner.describe())

    def close(self) -> None:
        self.inner.close()


@pytest.fixture()
def lifecycle(tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles) -> Iterator[Lifecycle]:
    (tmp_path / "sysfs").mkdir()  # no sensor: the level is what the test sets
    config = write_config(
        tmp_path / "agent",
        keypair[1],
        f'[budgets]\npower_w = 5.0\ndegrade = ["batch", "shed"]\nsysfs_root = "{tmp_path / "sysfs"}"\n'
        "[models.tiny]\nworkers = 1\n"  # one call at a time: the calls' order is the batches' order
        "[models.tiny.batching]\nmax_batch_size = 8\nmax_wait_ms = 1.0\nbudget_max_batch_size = 2\n",
    )
    lc = Lifecycle(load_config(config))
    lc.start()
    lc.install(bundles.v1)
    yield lc
    lc.stop()


def _batches(lifecycle: Lifecycle, pipeline: Pipeline) -> list[int]:
    """Rows per runtime call for one 1-row request that holds the model, then six queued behind it."""
    model = lifecycle.registry.get("tiny")
    gate = _Gate(model.runner)
    model.runner = gate
    try:
        jobs = [Job({"input": sample_inputs(1, seed=i)}, None, time.monotonic() + 30) for i in range(7)]
        pipeline.batcher.submit(jobs[0])
        assert gate.entered.wait(10)
        for job in jobs[1:]:
            pipeline.batcher.submit(job)
        time.sleep(0.05)  # all six queued, past the wait: the next batches form from the queue
        gate.opened.set()
        for job in jobs:
            pipeline.batcher.wait(job)
            assert job.outputs is not None
        return gate.rows
    finally:
        gate.opened.set()
        model.runner = gate.inner


def test_batch_step_forms_smaller_batches_while_on_and_the_usual_ones_after(lifecycle: Lifecycle) -> None:
    pipeline = Pipeline("tiny", lifecycle.registry, lifecycle.config, lifecycle.metrics, Slots(2))
    try:
        lifecycle.budgets.level = 1  # the power budget's first step: batch
        assert _batches(lifecycle, pipeline) == [1, 2, 2, 2]
        lifecycle.budgets.level = 0  # recovered
        assert _batches(lifecycle, pipeline) == [1, 6]
    finally:
        assert pipeline.stop(5)


def test_batching_degraded_waits_longer_by_default_and_caps_what_depends_on_the_size() -> None:
    cfg = BatchingConfig(max_batch_size=8, max_wait_ms=2.0, min_batch_size=4, preferred_batch_sizes=(2, 4, 8))
    assert cfg.degraded() == BatchingConfig(
        max_batch_size=8, max_wait_ms=8.0, min_batch_size=4, preferred_batch_sizes=(2, 4, 8)
    )
    small = BatchingConfig(
        max_batch_size=8, min_batch_size=4, preferred_batch_sizes=(2, 4, 8), budget_max_batch_size=3
    ).degraded()
    assert (small.max_batch_size, small.min_batch_size, small.preferred_batch_sizes) == (3, 3, (2,))
    assert BatchingConfig(max_wait_ms=2.0, budget_max_wait_ms=0.5).degraded().max_wait_ms == 0.5
