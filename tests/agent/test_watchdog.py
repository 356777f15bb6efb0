"""The hung-call watchdog on its own: what follows a hang, in order (the model dropped before any
caller hears of it; each job failed and counted; an inline caller answered through its hook; a
stuck worker replaced), and its thread ending when its owner has nothing left to watch. The
calls are real ``Job`` objects on a real installed model."""

from __future__ import annotations

import threading
import time

import pytest

from device_agents.errors import RuntimeFailure
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline.jobs import Job
from device_agents.pipeline.watchdog import Call, Watchdog
from device_agents.runtimes import ServedModel
from edgekit.bundle.errors import EdgekitError
from tests.factories import sample_inputs


@pytest.fixture(scope="module")
def model(installed: Lifecycle) -> ServedModel:
    return installed.registry.get("tiny")


def _job() -> Job:
    return Job({"input": sample_inputs(1)}, None, time.monotonic() + 30)


class Recorder:
    def __init__(self) -> None:
        self.events: list[str] = []
        self.jobs: list[Job] = []

    def on_hung(self, model: ServedModel) -> None:
        # nobody has heard of the hang yet: a caller retrying at once must find the model dropped
        self.events.append("dropped" if not any(j.done.is_set() for j in self.jobs) else "dropped late")

    def on_failure(self, version: int, job: Job | None) -> None:
        self.events.append(f"counted v{version} replay={job is not None}")

    def replace(self) -> None:
        self.events.append("replaced")

    def answer(self, exc: EdgekitError) -> None:
        self.events.append(f"answered {type(exc).__name__}")


def _watchdog(rec: Recorder, collect: object = lambda now: None) -> Watchdog:
    return Watchdog("tiny", 0.2, collect, on_hung=rec.on_hung, on_failure=rec.on_failure, replace=rec.replace)  # type: ignore[arg-type]  # a test's collect


def test_watchdog_drops_the_model_before_failing_a_hung_worker_call_s_jobs_then_replaces_the_worker(
    model: ServedModel,
) -> None:
    rec = Recorder()
    rec.jobs = [_job(), _job()]
    _watchdog(rec).handle(Call(time.monotonic() - 1, model, rec.jobs), time.monotonic())
    assert rec.events == ["dropped", "counted v1 replay=False", "counted v1 replay=False", "replaced"]
    for job in rec.jobs:
        assert job.done.is_set() and isinstance(job.error, RuntimeFailure)
        assert "hung: its runtime call ran over server.hung_call_s (0.2 s)" in str(job.error)


def test_watchdog_answers_a_hung_inline_call_through_its_hook_and_replaces_no_worker(model: ServedModel) -> None:
    rec = Recorder()
    rec.jobs = [_job()]
    _watchdog(rec).handle(Call(time.monotonic() - 1, model, rec.jobs, rec.answer), time.monotonic())
    assert rec.events == ["dropped", "answered RuntimeFailure", "counted v1 replay=False"]


def test_watchdog_still_answers_when_dropping_the_model_or_the_answer_hook_raises(model: ServedModel) -> None:
    rec = Recorder()
    rec.jobs = [_job()]

    def broken(*args: object) -> None:
        raise OSError("gone")

    watchdog = Watchdog("tiny", 0.2, lambda now: None, on_hung=broken, on_failure=rec.on_failure, replace=rec.replace)
    watchdog.handle(Call(time.monotonic() - 1, model, rec.jobs, broken), time.monotonic())
    assert rec.jobs[0].done.is_set() and isinstance(rec.jobs[0].error, RuntimeFailure)
    assert rec.events == ["counted v1 replay=False"]


def test_watchdog_thread_handles_what_collect_finds_and_ends_when_it_returns_none(model: ServedModel) -> None:
    rec = Recorder()
    rec.jobs = [_job()]
    pending = [[Call(time.monotonic() - 1, model, rec.jobs)], []]
    asked: list[float] = []

    def collect(now: float) -> list[Call] | None:
        asked.append(now)
        return pending.pop(0) if pending else None

    watchdog = _watchdog(rec, collect)
    watchdog.start()
    watchdog._thread.join(10)
    assert not watchdog._thread.is_alive() and len(asked) == 3
    assert rec.events[-1] == "replaced" and rec.jobs[0].done.is_set()
    assert watchdog._thread.name == "hung-tiny" and threading.current_thread() is not watchdog._thread
