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
from device_agents.errors import (
    AnsweredError,
    DeadlineExceededError,
    OverloadedError,
    RuntimeFailure,
    UnavailableError,
)
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Pipeline, Request
from device_agents.pipeline.batching import Batcher
from device_agents.pipeline.jobs import Job
from device_agents.pipeline.policy import CallCost
from edgekit.bundle.errors import ConfigError, EdgekitError
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
        self.threads: list[int] = []  # the thread each call ran in

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.entered.set()
        self.opened.wait(30)
        self.rows.append(len(next(iter(inputs.values()))))
        self.threads.append(threading.get_ident())
        return dict(self.inner.run(inputs))

    def describe(self) -> dict[str, Any]:
        return dict(self.inner.describe())

    def close(self) -> None:
        self.inner.close()


@pytest.fixture(scope="module")
def lifecycle(installed: Lifecycle) -> Lifecycle:
    return installed


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


class _Recorded(CallCost):
    """A cost model holding recorded call times only (the test's calls, held at the gate, would
    add their own)."""

    def __init__(self, calls: list[tuple[int, float]]) -> None:
        super().__init__()
        for rows, seconds in calls:
            super().record(rows, seconds)

    def record(self, rows: int, seconds: float) -> None:
        pass


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
        return pipeline.run(None, lambda model: Request("tiny", {"input": x}), lambda r: (r.outputs, r.served_version))

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


def test_a_batched_model_forms_its_next_batch_while_its_only_slot_is_busy(lifecycle: Lifecycle, gate: Gate) -> None:
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=1.0))  # workers = 1
    try:
        assert sum(t.is_alive() for t in batcher._threads) == 2  # one slot, and a thread to form the next batch
        running = _job(1)
        batcher.submit(running)
        assert gate.entered.wait(10)
        queued = [_job(1, seed=i) for i in range(2)]
        for job in queued:
            batcher.submit(job)
        deadline = time.monotonic() + 10
        while batcher._incoming.qsize() > 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        # the next batch's head was taken off the queue while the running batch still holds the slot
        assert batcher._incoming.qsize() == 1 and not queued[0].started
        gate.opened.set()
        for job in (running, *queued):
            batcher.wait(job)
        assert gate.rows == [1, 2] and len(set(gate.threads)) == 2
    finally:
        batcher.stop(5)


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


# -- inline calls: a request to an idle model runs in the caller's thread --------------------------


def _pipeline(lifecycle: Lifecycle, batching: BatchingConfig | None = None, **server: Any) -> Pipeline:
    return Pipeline("tiny", lifecycle.registry, _config(lifecycle, batching, **server), lifecycle.metrics,
                    threading.Semaphore(4))  # fmt: skip


def _request(pipeline: Pipeline, answers: list[EdgekitError] | None, seed: int = 0) -> dict[str, np.ndarray]:
    """One request through ``pipeline``; ``answers``: the front-end can be answered from another thread."""
    x = sample_inputs(1, seed=seed)
    answer = None if answers is None else answers.append
    out: dict[str, np.ndarray] = pipeline.run(
        None, lambda model: Request("tiny", {"input": x}, answer=answer), lambda r: r.outputs
    )
    return out


def test_a_request_to_an_idle_unbatched_model_runs_in_the_calling_thread(lifecycle: Lifecycle, gate: Gate) -> None:
    gate.opened.set()
    pipeline = _pipeline(lifecycle)
    try:
        _request(pipeline, [])  # answerable from another thread: inline
        assert gate.threads == [threading.get_ident()]
        _request(pipeline, None)  # not answerable if it hung: handed to a worker
        assert gate.threads[1] != threading.get_ident()
        assert gate.threads[1] in {t.ident for t in pipeline.batcher._threads}
    finally:
        pipeline.stop(5)


def test_a_request_to_a_busy_model_is_queued_within_its_concurrency_limit(lifecycle: Lifecycle, gate: Gate) -> None:
    pipeline = _pipeline(lifecycle)  # workers = 1: one runtime call at a time
    results: list[dict[str, np.ndarray]] = []
    first = threading.Thread(target=lambda: results.append(_request(pipeline, [])))
    first.start()
    assert gate.entered.wait(10)  # the first request runs inline, holding the model's one call slot
    second = threading.Thread(target=lambda: results.append(_request(pipeline, [], seed=1)))
    second.start()
    deadline = time.monotonic() + 10
    while pipeline.batcher.depth() != 1 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert pipeline.batcher.depth() == 1 and len(gate.rows) == 0  # queued, not run beside the first
    gate.opened.set()
    first.join(10)
    second.join(10)
    assert len(results) == 2
    assert gate.threads[0] == first.ident and gate.threads[1] in {t.ident for t in pipeline.batcher._threads}
    pipeline.stop(5)


def test_the_watchdog_answers_a_hung_inline_call_through_its_hook(lifecycle: Lifecycle, gate: Gate) -> None:
    hung_model = lifecycle.registry.get("tiny")
    hung_before = lifecycle.metrics.hung_calls.labels("tiny")._value.get()
    pipeline = _pipeline(lifecycle, hung_call_s=0.3)  # workers = 1
    answers: list[EdgekitError] = []
    raised: list[BaseException] = []

    def stuck() -> None:
        try:
            _request(pipeline, answers)
        except BaseException as exc:  # what the stuck caller sees once its call returns
            raised.append(exc)

    caller = threading.Thread(target=stuck)
    caller.start()
    assert gate.entered.wait(10)
    deadline = time.monotonic() + 10
    while not answers and time.monotonic() < deadline:
        time.sleep(0.01)
    # answered from the watchdog's thread while the caller's thread is still inside the runtime
    assert len(answers) == 1 and isinstance(answers[0], RuntimeFailure) and caller.is_alive()
    assert "hung: its runtime call ran over server.hung_call_s (0.3 s)" in str(answers[0])
    assert lifecycle.metrics.hung_calls.labels("tiny")._value.get() == hung_before + 1
    # the stuck call gave its slot back: the reloaded model answers the next request (gate bypassed)
    fresh = lifecycle.registry.get("tiny")
    assert fresh is not hung_model
    x = sample_inputs(1, seed=6)
    out = _request(pipeline, [], seed=6)
    np.testing.assert_allclose(out["probs"], fresh.runner.run({"input": x})["probs"], rtol=1e-5)
    gate.opened.set()
    caller.join(10)
    assert len(raised) == 1 and isinstance(raised[0], AnsweredError)  # the front-end writes nothing more
    pipeline.stop(5)


# -- when a batch waits ---------------------------------------------------------------------------


def test_an_idle_batcher_dispatches_without_waiting_max_wait(lifecycle: Lifecycle, gate: Gate) -> None:
    gate.opened.set()
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=10_000.0))
    first = _job(1)
    batcher.submit(first)
    assert first.done.wait(10)  # done, but its caller has not collected it: still counted in flight
    second = _job(1, seed=1)
    batcher.submit(second)
    # the model is idle and nothing is on its way: the batch runs now, not 10 s after its head came
    assert second.done.wait(5) and second.outputs is not None
    batcher.wait(first)
    batcher.wait(second)
    assert gate.rows == [1, 1]
    batcher.stop(5)


def test_a_batch_waits_for_requests_being_decoded_when_a_call_s_fixed_cost_is_worth_it(
    lifecycle: Lifecycle, gate: Gate
) -> None:
    gate.opened.set()
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=10_000.0))
    for rows in (1, 2, 4, 1, 2, 4):
        batcher.policy.cost.record(rows, 60.0)  # every call 60 s whatever its rows: all of it is saved by batching
    assert batcher.policy.cost.fixed_s == pytest.approx(60.0)
    batcher.arrive(1)  # a request is being decoded
    head = _job(1)
    batcher.submit(head)
    time.sleep(0.05)
    assert not head.done.is_set()  # waiting for the one on its way
    late = _job(1, seed=1)
    batcher.submit(late)
    batcher.arrive(-1)
    batcher.wait(head)
    batcher.wait(late)
    assert gate.rows == [2] and head.batch_rows == 2
    batcher.stop(5)


def test_a_batch_does_not_wait_when_a_call_has_no_fixed_cost(lifecycle: Lifecycle, gate: Gate) -> None:
    gate.opened.set()
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=10_000.0))
    for rows in (1, 2, 4, 1, 2, 4):
        batcher.policy.cost.record(rows, 0.001 * rows)  # a batch of n costs n single calls: nothing to save
    assert batcher.policy.cost.fixed_s == pytest.approx(0.0, abs=1e-9)
    batcher.arrive(1)  # a request is being decoded, but waiting for it would save nothing
    head = _job(1)
    batcher.submit(head)
    assert head.done.wait(5) and head.outputs is not None
    batcher.arrive(-1)
    batcher.wait(head)
    batcher.stop(5)


def test_a_batcher_whose_calls_have_no_fixed_cost_runs_jobs_one_at_a_time(lifecycle: Lifecycle, gate: Gate) -> None:
    from device_agents.pipeline.policy import EXPLORE_EVERY

    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=1.0))
    for rows in (1, 2, 4, 1, 2, 4):
        batcher.policy.cost.record(rows, 0.001 * rows)  # batching saves nothing: run as an unbatched model would
    assert not batcher.policy.pays()
    _queue_behind_one(batcher, gate, 3)
    assert gate.rows[:4] == [1, 1, 1, 1]
    # one batch in EXPLORE_EVERY still coalesces, so that the cost model keeps seeing batch sizes
    gate.opened.clear()
    gate.entered.clear()
    batcher.policy.formed = EXPLORE_EVERY - 2
    _queue_behind_one(batcher, gate, 3)
    assert gate.rows[4:] == [1, 3]
    batcher.stop(5)


def test_an_exploring_batch_of_a_model_batching_does_not_pay_for_stays_small(lifecycle: Lifecycle, gate: Gate) -> None:
    from device_agents.pipeline.policy import EXPLORE_EVERY, EXPLORE_ROWS

    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=1.0))
    batcher.policy.cost = _Recorded([(rows, 0.001 * rows) for rows in (1, 2, 4, 1, 2, 4)])  # batching saves nothing
    batcher.policy.formed = EXPLORE_EVERY - 2  # the batch after the running one explores
    _queue_behind_one(batcher, gate, 7)
    # 7 queued while the model ran: the exploring batch takes EXPLORE_ROWS of them, not all 7
    # (a full batch of a model batching slows down), and the rest run one at a time
    assert gate.rows == [1, EXPLORE_ROWS, *[1] * (7 - EXPLORE_ROWS)]
    batcher.stop(5)


def test_a_model_batching_does_not_pay_for_is_batched_up_to_its_cheapest_size(lifecycle: Lifecycle, gate: Gate) -> None:
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=1.0))
    batcher.policy.cost = _Recorded(
        [(rows, s) for rows, s in ((1, 0.00069), (2, 0.00117), (4, 0.0055)) for _ in range(3)]
    )
    assert not batcher.policy.pays()
    _queue_behind_one(batcher, gate, 5)
    assert gate.rows == [1, 2, 2, 1]  # pairs of what queued, never the batch of 5 that costs more
    batcher.stop(5)


def _queue_behind_one(batcher: Batcher, gate: Gate, queued: int) -> None:
    """Hold one call at the gate, queue ``queued`` single-row jobs behind it, run them all."""
    running = _job(1)
    batcher.submit(running)
    assert gate.entered.wait(10)
    jobs = [_job(1, seed=i) for i in range(queued)]
    for job in jobs:
        batcher.submit(job)
    gate.opened.set()
    for job in (running, *jobs):
        batcher.wait(job)


def test_batches_never_grow_past_a_size_measured_cheaper_per_row_than_bigger_ones(
    lifecycle: Lifecycle, gate: Gate
) -> None:
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=16, max_wait_ms=1.0))
    # the line through these says batching pays (72% of a call is fixed), but 8 rows cost more per row than 4
    batcher.policy.cost = _Recorded([(rows, s) for rows, s in ((1, 0.003), (4, 0.0032), (8, 0.008)) for _ in range(3)])
    try:
        assert batcher.policy.pays()
        _queue_behind_one(batcher, gate, 7)
        assert gate.rows == [1, 4, 3]
    finally:
        batcher.stop(5)


def test_batches_grow_to_max_batch_size_while_the_biggest_size_measured_is_the_cheapest(
    lifecycle: Lifecycle, gate: Gate
) -> None:
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=16, max_wait_ms=1.0))
    # an MLP reading its weights once per call: the bigger the batch, the cheaper each row
    batcher.policy.cost = _Recorded([(rows, s) for rows, s in ((1, 0.003), (4, 0.0034), (8, 0.0038)) for _ in range(3)])
    try:
        _queue_behind_one(batcher, gate, 10)
        assert gate.rows == [1, 10]  # bigger than any size measured: not capped at 8
    finally:
        batcher.stop(5)


def test_exploring_backs_off_while_the_bigger_batches_it_tries_cost_more_per_row(
    lifecycle: Lifecycle, gate: Gate
) -> None:
    from device_agents.pipeline.policy import EXPLORE_EVERY, EXPLORE_ROWS

    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=1.0))
    # 4 rows cost 8 single calls: each exploring batch of 4 is paid for
    batcher.policy.cost = _Recorded(
        [(rows, s) for rows, s in ((1, 0.00069), (2, 0.00117), (4, 0.0055)) for _ in range(3)]
    )
    batcher.policy.formed = EXPLORE_EVERY - 2  # the batch after the running one explores
    _queue_behind_one(batcher, gate, 7)
    assert gate.rows == [1, EXPLORE_ROWS, 2, 1]
    assert batcher.policy.explore_every == 2 * EXPLORE_EVERY  # the next one comes half as often
    batcher.stop(5)


def test_a_batched_model_runs_inline_while_batching_does_not_pay(lifecycle: Lifecycle, gate: Gate) -> None:
    gate.opened.set()
    pipeline = _pipeline(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=10_000.0))
    try:
        pipeline.batcher.arrive(1)  # another request on its way
        for rows in (1, 2, 4, 1, 2, 4):
            pipeline.batcher.policy.cost.record(rows, 60.0)  # all fixed: worth waiting for it, so not inline
        done: list[dict[str, np.ndarray]] = []
        waiting = threading.Thread(target=lambda: done.append(_request(pipeline, [])))
        waiting.start()
        deadline = time.monotonic() + 10
        while pipeline.batcher.depth() != 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert pipeline.batcher.depth() == 1  # queued, waiting for the one on its way
        pipeline.batcher.arrive(-1)
        waiting.join(10)
        assert done and gate.threads[-1] != waiting.ident
        pipeline.batcher.policy.cost = CallCost()
        for rows in (1, 2, 4, 1, 2, 4):
            pipeline.batcher.policy.cost.record(rows, 0.001 * rows)  # nothing saved by batching: inline
        pipeline.batcher.arrive(1)
        _request(pipeline, [])
        assert gate.threads[-1] == threading.get_ident()
        pipeline.batcher.arrive(-1)
    finally:
        pipeline.stop(5)


def test_the_infer_stall_point_is_looked_up_when_the_batcher_is_built_not_per_call(
    lifecycle: Lifecycle, gate: Gate, monkeypatch: pytest.MonkeyPatch
) -> None:
    from device_agents.pipeline import batching

    gate.opened.set()
    stalls: list[str] = []
    monkeypatch.setattr(batching, "stall_point", stalls.append)
    monkeypatch.delenv("EDGEKIT_FAULT", raising=False)
    plain = _batcher(lifecycle)
    monkeypatch.setenv("EDGEKIT_FAULT", "infer_stall")  # armed after `plain` was built: not seen by it
    armed = _batcher(lifecycle)
    try:
        for batcher in (plain, armed):
            job = _job(1)
            batcher.submit(job)
            assert batcher.wait(job).outputs is not None
        assert stalls == ["infer_stall"]  # the armed batcher's call only
    finally:
        plain.stop(5)
        armed.stop(5)


# -- closed loops: clients that send their next request when answered -----------------------------


class _Slow:
    """The real runner, each call ``seconds`` longer (a fixed cost batching saves)."""

    def __init__(self, gate: Gate, seconds: float) -> None:
        self.gate, self.seconds = gate, seconds

    def run(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(self.seconds)
        return self.gate.run(inputs)

    def describe(self) -> dict[str, Any]:
        return self.gate.describe()

    def close(self) -> None:
        self.gate.close()


def test_a_batch_waits_for_the_clients_its_last_batch_answered_in_a_closed_loop(
    lifecycle: Lifecycle, gate: Gate
) -> None:
    """Six clients, each sending its next request 2 ms after its answer, to a model whose calls
    cost 80 ms whatever their rows. Run at once with what is queued, the batches split into two
    groups that alternate forever (one group comes back while the other runs); waiting (up to a
    call's fixed cost) for the clients the last batch answered merges them into batches of six."""
    gate.opened.set()
    model = lifecycle.registry.get("tiny")
    model.runner = _Slow(gate, 0.08)
    batcher = _batcher(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=10_000.0))
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        time.sleep(0.09 * (seed % 2))  # two groups from the start: the second sent while the first runs
        try:
            for _ in range(10):
                job = _job(1, seed=seed)
                batcher.submit(job)
                batcher.wait(job)
                time.sleep(0.002)
        except BaseException as exc:
            errors.append(exc)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(6)]
    try:
        for t in clients:
            t.start()
        for t in clients:
            t.join(60)
    finally:
        batcher.stop(5)
        model.runner = gate
    assert not errors
    assert gate.rows.count(6) >= 6, gate.rows  # of the 10 to 12 batches the 60 requests make


def test_a_lone_client_of_a_batched_model_runs_inline_request_after_request(lifecycle: Lifecycle, gate: Gate) -> None:
    gate.opened.set()
    pipeline = _pipeline(lifecycle, BatchingConfig(max_batch_size=8, max_wait_ms=10_000.0))
    try:
        for rows in (1, 2, 4, 1, 2, 4):
            pipeline.batcher.policy.cost.record(rows, 60.0)  # batching pays: a batch would wait for company
        for seed in range(4):
            _request(pipeline, [], seed=seed)  # the only client, answered each time: nobody else is coming
        assert gate.threads == [threading.get_ident()] * 4
    finally:
        pipeline.stop(5)
