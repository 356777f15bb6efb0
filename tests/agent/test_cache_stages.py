"""The result cache as pipeline stages, in-process on a real installed model: a repeated request
is answered without the runtime, bypass, the policy (config over the manifest's, stateful
models refused), a version switch (new keys, old entries swept) and a restart (a hit from disk).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from device_agents.cache.stage import policy, shared_cache
from device_agents.cache.store import DB_NAME
from device_agents.config import AgentConfig, load_config
from device_agents.lifecycle import Lifecycle
from device_agents.metrics import AgentMetrics
from device_agents.pipeline import Pipeline, Request
from device_agents.stats import snapshot, summarize, table
from edgekit.bundle.errors import ConfigError, InferenceInputError
from edgekit.bundle.manifest import CachePolicy
from tests.agent.bundles import read_manifest
from tests.agent.conftest import Bundles, write_config
from tests.factories import sample_inputs

CACHED = '[models.tiny.cache]\nmode = "exact"\n'


class Counting:
    """The real runner, counting its calls."""

    name: ClassVar[str] = "counting"

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.calls = 0

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.calls += 1
        return dict(self.inner.run(inputs))

    def describe(self) -> dict[str, Any]:
        return dict(self.inner.describe())

    def close(self) -> None:
        self.inner.close()


def _lifecycle(directory: Path, pub: Path, extra: str = CACHED) -> Lifecycle:
    lc = Lifecycle(load_config(write_config(directory, pub, extra)))
    lc.start()
    return lc


@pytest.fixture(scope="module")
def cached(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], bundles: Bundles
) -> Iterator[Lifecycle]:
    lc = _lifecycle(tmp_path_factory.mktemp("cached"), keypair[1])
    lc.install(bundles.v1)
    yield lc
    lc.stop()


def _pipeline(lc: Lifecycle, metrics: AgentMetrics | None = None) -> Pipeline:
    return Pipeline("tiny", lc.registry, lc.config, metrics or lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # a semaphore is what Slots wraps


def _ask(pipeline: Pipeline, x: np.ndarray, **parameters: Any) -> Request:
    return pipeline.run(None, lambda model: Request("tiny", {"input": x}, parameters=dict(parameters)), lambda r: r)


def _counting(lc: Lifecycle) -> Counting:
    model = lc.registry.get("tiny")
    runner = model.runner
    if isinstance(runner, Counting):
        return runner
    counting = Counting(runner)
    model.runner = counting
    return counting


def test_cache_stage_answers_a_repeated_request_without_the_model(cached: Lifecycle) -> None:
    pipeline = _pipeline(cached)
    runner = _counting(cached)
    x = sample_inputs(1, seed=40)
    before = runner.calls
    first = _ask(pipeline, x)
    second = _ask(pipeline, x.copy())
    assert first.response_parameters["cache"] == "miss" and second.response_parameters["cache"] == "hit"
    assert runner.calls == before + 1
    assert first.outputs is not None and second.outputs is not None
    for name, value in first.outputs.items():
        np.testing.assert_array_equal(second.outputs[name], value)
    assert second.served_version == first.served_version == 1
    other = _ask(pipeline, sample_inputs(1, seed=41))
    assert other.response_parameters["cache"] == "miss" and runner.calls == before + 2
    text = cached.metrics.exposition()
    assert b'edgekit_cache_lookups_total{model="tiny",result="hit"}' in text
    assert b'edgekit_cache_hit_seconds_count{model="tiny"}' in text


def test_cache_stage_bypass_neither_reads_nor_writes(cached: Lifecycle) -> None:
    pipeline = _pipeline(cached)
    runner = _counting(cached)
    x = sample_inputs(1, seed=42)
    before = runner.calls
    assert _ask(pipeline, x, cache="bypass").response_parameters["cache"] == "bypass"
    assert _ask(pipeline, x).response_parameters["cache"] == "miss"  # the bypassed answer was not stored
    assert _ask(pipeline, x, cache="bypass").response_parameters["cache"] == "bypass"
    assert runner.calls == before + 3
    with pytest.raises(InferenceInputError, match=r'parameters\.cache must be "bypass"'):
        _ask(pipeline, x, cache="off")


def test_cache_stage_keys_answer_changing_parameters(cached: Lifecycle) -> None:
    pipeline = _pipeline(cached)
    x = sample_inputs(1, seed=43)
    assert _ask(pipeline, x).response_parameters["cache"] == "miss"
    assert _ask(pipeline, x, priority=3).response_parameters["cache"] == "hit"  # scheduling only
    assert _ask(pipeline, x, top_k=2).response_parameters["cache"] == "miss"  # may change the answer


def test_cache_policy_is_the_manifest_s_unless_the_config_overrides_it(bundles: Bundles, tmp_path: Path) -> None:
    manifest = read_manifest(bundles.v1)
    declared = manifest.with_updates(cache=CachePolicy(ttl_s=5))

    def config(extra: str) -> AgentConfig:
        path = tmp_path / "agent.toml"
        path.write_text(f'store = "s"\ntrusted_keys = ["k.pub"]\n{extra}')
        return load_config(path)

    assert policy("tiny", config(""), manifest) is None
    got = policy("tiny", config(""), declared)
    assert got is not None and got.ttl_s == 5 and got.max_bytes is None
    got = policy("tiny", config("[models.tiny.cache]\nttl_s = 30\nmax_mb = 2\n"), declared)
    assert got is not None and got.ttl_s == 30 and got.max_bytes == 2 * 1024 * 1024
    assert policy("tiny", config("[models.tiny.cache]\nenabled = false\n"), declared) is None
    assert policy("tiny", config("[cache]\nenabled = false\n[models.tiny.cache]\n"), declared) is None
    got = policy("tiny", config("[models.tiny.cache]\n"), manifest)
    assert got is not None and got.ttl_s == 3600 and got.admit == "second"
    got = policy("tiny", config('[models.tiny.cache]\nadmit = "first"\n'), manifest)
    assert got is not None and got.admit == "first"
    got = policy("tiny", config('[models.tiny.cache]\nmode = "approximate"\nmax_distance = 0.1\n'), manifest)
    assert got is not None and got.admit == "first"


def test_cache_on_a_stateful_model_is_a_config_error(bundles: Bundles, tmp_path: Path) -> None:
    stateful = read_manifest(bundles.v1).with_updates(stateful=True, cache=CachePolicy())
    path = tmp_path / "agent.toml"
    path.write_text(f'store = "s"\ntrusted_keys = ["k.pub"]\n{CACHED}')
    config = load_config(path)
    with pytest.raises(
        ConfigError, match=r"agent.models.tiny.cache: model tiny v1 is stateful .* remove \[models.tiny.cache\]"
    ):
        config.model("tiny").check("tiny", stateful)
    with pytest.raises(ConfigError, match="is stateful"):
        policy("tiny", config, stateful)
    path.write_text('store = "s"\ntrusted_keys = ["k.pub"]\n')  # only the manifest asks: not cached
    assert policy("tiny", load_config(path), stateful) is None


def test_cache_a_model_update_changes_every_key_and_sweeps_the_old_version(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    lc = _lifecycle(tmp_path, keypair[1])
    try:
        lc.install(bundles.v1)
        pipeline = _pipeline(lc)
        x = sample_inputs(1, seed=44)
        assert _ask(pipeline, x).response_parameters["cache"] == "miss"
        assert _ask(pipeline, x).response_parameters["cache"] == "hit"
        lc.install(bundles.v2)
        after = _ask(pipeline, x)
        assert after.response_parameters["cache"] == "miss" and after.served_version == 2
        assert _ask(pipeline, x).response_parameters["cache"] == "hit"
        cache_db = lc.config.store / "cache" / DB_NAME
        assert shared_cache(lc.config, lc.metrics.cache).flush()
        versions = sqlite3.connect(cache_db).execute("SELECT DISTINCT version FROM entries").fetchall()
        assert versions == [(2,)]
    finally:
        lc.stop()


def test_cache_hit_survives_a_restart(tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles) -> None:
    lc = _lifecycle(tmp_path, keypair[1])
    x = sample_inputs(1, seed=45)
    try:
        lc.install(bundles.v1)
        pipeline = _pipeline(lc)
        first = _ask(pipeline, x)
        assert first.response_parameters["cache"] == "miss"
        once = _ask(_pipeline(lc), sample_inputs(1, seed=46))  # asked once: kept in memory only
        assert once.response_parameters["cache"] == "miss"
        assert _ask(pipeline, x).response_parameters["cache"] == "hit"  # it repeats: written to disk now
    finally:
        lc.stop()
    assert shared_cache(lc.config, lc.metrics.cache).flush()
    again = _lifecycle(tmp_path, keypair[1])  # a new agent on the same store (new metrics: a fresh cache object)
    try:
        runner = _counting(again)
        request = _ask(_pipeline(again), x)
        assert request.response_parameters["cache"] == "hit" and runner.calls == 0
        assert first.outputs is not None and request.outputs is not None
        assert list(request.outputs) == list(first.outputs)
        for name, value in first.outputs.items():
            np.testing.assert_array_equal(request.outputs[name], value)
        never_repeated = _ask(_pipeline(again), sample_inputs(1, seed=46))
        assert never_repeated.response_parameters["cache"] == "miss"
    finally:
        again.stop()


def test_cache_numbers_parse_back_into_stats_and_the_table() -> None:
    metrics = AgentMetrics()
    metrics.observe_request("tiny", 200, 0.001)
    for _ in range(3):
        metrics.cache.lookup("tiny", "hit", 0.00004, saved_s=0.01)
    metrics.cache.lookup("tiny", "miss")
    metrics.cache.lookup("tiny", "bypass")
    text = metrics.exposition().decode()
    snap = snapshot(text_string_to_metric_families(text))
    row = summarize(snap)["tiny"]["cache"]
    assert row["hits"] == 3 and row["misses"] == 1 and row["bypass"] == 1
    assert row["hit_rate"] == 0.75
    assert 0 < row["hit_p50_ms"] <= 0.05  # inside its (0, 0.05] ms bucket
    assert abs(row["saved_s"] - 3 * (0.01 - 0.00004)) < 1e-9
    lines = table(summarize(snap)).splitlines()
    assert lines[2].split() == ["CACHE", "HITS", "MISSES", "BYPASS", "HIT", "%", "HIT", "p50", "ms", "SAVED", "s"]
    assert lines[3].split()[:5] == ["tiny", "3", "1", "1", "75"]
    metrics.cache.lookup("tiny", "hit", 0.00004)  # an interval: the difference of two snapshots
    metrics.observe_request("tiny", 200, 0.001)
    later = snapshot(text_string_to_metric_families(metrics.exposition().decode()))
    interval = summarize(later.minus(snap))["tiny"]["cache"]
    assert (interval["hits"], interval["misses"], interval["hit_rate"]) == (1, 0, 1.0)


def test_cache_that_cannot_be_opened_never_stops_serving(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    lc = _lifecycle(tmp_path, keypair[1])
    try:
        lc.install(bundles.v1)
        blocker = lc.config.store / "cache"
        blocker.write_text("a file where the cache directory goes")  # no directory, no database
        pipeline = _pipeline(lc, AgentMetrics())  # a new metrics object: a cache opened now, on this store
        x = sample_inputs(1, seed=47)
        first = _ask(pipeline, x)
        assert first.response_parameters["cache"] == "miss" and first.outputs is not None
        assert _ask(pipeline, x).response_parameters["cache"] == "hit"  # the memory tier still works
        assert shared_cache(lc.config, pipeline.metrics.cache).state == "off"
    finally:
        lc.stop()
