"""The stage chain: stages join an endpoint's pipeline from the stage table alone (``Pipeline`` is not
touched), in the table's order around queue + infer; one may answer early, refuse, or register a
cleanup; the pipeline times each one under its name. On a real installed model."""

from __future__ import annotations

import threading
from dataclasses import replace

import numpy as np
import pytest

from device_agents.errors import OverloadedError
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Pipeline, Request, stage
from device_agents.pipeline.slots import Slots
from device_agents.pipeline.stage import INFER, StageContext, StageFactoryRef
from edgekit.bundle.errors import ConfigError
from tests.factories import sample_inputs


@pytest.fixture(scope="module")
def lifecycle(installed: Lifecycle) -> Lifecycle:
    return installed


class Scale:
    """Multiplies every input (a stand-in pre-processing) and logs what it saw."""

    def __init__(self, name: str, factor: float, seen: list[str]) -> None:
        self.name, self.factor, self.seen = name, factor, seen

    def process(self, request: Request) -> None:
        self.seen.append(self.name)
        request.inputs = {k: (v * self.factor).astype(v.dtype) for k, v in request.inputs.items()}


class Answer:
    """Answers every request itself (a stand-in cache hit)."""

    name = "answer"

    def process(self, request: Request) -> None:
        request.outputs = {"probs": np.full((1, 10), 7.0, dtype=np.float32)}
        request.served_version = 99
        request.response_parameters["cache"] = "hit"


class Refuse:
    """Refuses every request after registering a cleanup (a stand-in budget reservation)."""

    name = "refuse"

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def process(self, request: Request) -> None:
        request.on_done.append(lambda: self.log.append("first"))
        request.on_done.append(lambda: self.log.append("second"))
        raise OverloadedError("over budget", retry_after_s=1)


class Double:
    """Doubles every output (a stand-in post-processing)."""

    name = "double"

    def process(self, request: Request) -> None:
        assert request.outputs is not None
        request.outputs = {k: v * 2 for k, v in request.outputs.items()}


def _table(
    monkeypatch: pytest.MonkeyPatch, before: dict[str, StageFactoryRef], after: dict[str, StageFactoryRef]
) -> None:
    monkeypatch.setattr(stage, "STAGE_FACTORIES", {**before, INFER: None, **after})


def _pipeline(lifecycle: Lifecycle) -> Pipeline:
    config = replace(lifecycle.config, server=replace(lifecycle.config.server, workers=1))
    return Pipeline("tiny", lifecycle.registry, config, lifecycle.metrics, Slots(2))


def _run(pipeline: Pipeline, x: np.ndarray) -> Request:
    return pipeline.run(None, lambda model: Request("tiny", {"input": x}), lambda request: request)


def _reference(lifecycle: Lifecycle, x: np.ndarray) -> np.ndarray:
    with lifecycle.registry.lease("tiny") as lease:
        return np.asarray(lease.model.infer({"input": x})["probs"])


def _stage_count(lifecycle: Lifecycle, name: str) -> int:
    series = lifecycle.metrics.series._stages.get(("tiny", name))
    return 0 if series is None else sum(series.counts)


def test_stage_table_entry_joins_the_pipeline_in_its_order(
    lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    _table(
        monkeypatch,
        {"first": lambda ctx: Scale("first", 2.0, seen), "second": lambda ctx: Scale("second", 3.0, seen)},
        {"double": lambda ctx: Double()},
    )
    pipeline = _pipeline(lifecycle)
    x = sample_inputs(1, seed=11)
    before = _stage_count(lifecycle, "first")
    try:
        request = _run(pipeline, x)
    finally:
        pipeline.stop(5)
    assert seen == ["first", "second"]
    assert request.outputs is not None and request.served_version == 1
    np.testing.assert_allclose(request.outputs["probs"], 2 * _reference(lifecycle, x * 6), rtol=1e-5)
    assert _stage_count(lifecycle, "first") == before + 1  # timed by the pipeline under the stage's name
    assert _stage_count(lifecycle, "double") >= 1


def test_stage_factory_returning_none_leaves_the_chain_as_it_was(
    lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    contexts: list[StageContext] = []

    def unconfigured(ctx: StageContext) -> None:
        contexts.append(ctx)
        return None

    _table(monkeypatch, {"off": unconfigured}, {})
    pipeline = _pipeline(lifecycle)
    try:
        x = sample_inputs(1, seed=12)
        request = _run(pipeline, x)
    finally:
        pipeline.stop(5)
    assert pipeline.before == () and pipeline.after == ()
    assert [(c.name, c.manifest.version) for c in contexts] == [("tiny", 1)]  # built from config + manifest
    assert request.outputs is not None
    np.testing.assert_allclose(request.outputs["probs"], _reference(lifecycle, x), rtol=1e-5)


def test_stage_answering_early_skips_queue_infer_and_later_stages(
    lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[str] = []
    _table(monkeypatch, {"answer": lambda ctx: Answer(), "later": lambda ctx: Scale("later", 2, seen)},
           {"double": lambda ctx: Double()})  # fmt: skip
    pipeline = _pipeline(lifecycle)
    infers = _stage_count(lifecycle, "infer")
    try:
        request = _run(pipeline, sample_inputs(1, seed=13))
    finally:
        pipeline.stop(5)
    assert request.outputs is not None and float(request.outputs["probs"][0, 0]) == 7.0  # not doubled
    assert request.served_version == 99 and request.response_parameters == {"cache": "hit"}
    assert seen == [] and _stage_count(lifecycle, "infer") == infers
    assert pipeline.batcher.inflight == 0 and pipeline.batcher.arriving == 0


def test_stage_refusal_raises_its_error_and_runs_cleanups_in_reverse(
    lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[str] = []
    _table(monkeypatch, {"refuse": lambda ctx: Refuse(log)}, {})
    pipeline = _pipeline(lifecycle)
    try:
        with pytest.raises(OverloadedError, match="over budget") as err:
            _run(pipeline, sample_inputs(1, seed=14))
        assert err.value.http_status == 429
        assert log == ["second", "first"]
        # the lease was given back: the registry can retire the model's entry without waiting
        entry = lifecycle.registry._loaded["tiny"]
        assert entry.inflight == 0
    finally:
        pipeline.stop(5)


def test_stage_is_shared_by_concurrent_requests(lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []
    _table(monkeypatch, {"scale": lambda ctx: Scale("scale", 1.0, seen)}, {})
    pipeline = _pipeline(lifecycle)
    errors: list[BaseException] = []

    def client(seed: int) -> None:
        try:
            x = sample_inputs(1, seed=seed)
            request = _run(pipeline, x)
            assert request.outputs is not None
            np.testing.assert_allclose(request.outputs["probs"], _reference(lifecycle, x), rtol=1e-5)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in range(8)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        pipeline.stop(5)
    assert errors == [] and len(seen) == 8


def answer_factory(context: StageContext) -> Answer:
    """A factory the stage table names by its import path."""
    return Answer()


def test_stage_table_entry_named_by_import_path_is_imported_when_a_pipeline_is_built(
    lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch
) -> None:
    _table(monkeypatch, {"answer": f"{__name__}:answer_factory"}, {})
    pipeline = _pipeline(lifecycle)
    try:
        request = _run(pipeline, sample_inputs(1, seed=15))
    finally:
        pipeline.stop(5)
    assert request.served_version == 99


@pytest.mark.parametrize("path", ["device_agents.no_such_module:f", "device_agents.pipeline.stage:no_such_factory"])
def test_stage_table_entry_that_cannot_be_imported_is_a_config_error_naming_it(
    lifecycle: Lifecycle, monkeypatch: pytest.MonkeyPatch, path: str
) -> None:
    _table(monkeypatch, {"broken": path}, {})
    with pytest.raises(ConfigError, match=f"stage 'broken': cannot load its factory '{path}'"):
        _pipeline(lifecycle)
