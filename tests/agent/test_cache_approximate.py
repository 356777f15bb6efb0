"""The result cache's approximate mode: signatures of near-duplicate inputs stay close and other
scenes do not, the false-hit meter and its interval, and the stages on a real installed model:
a near-duplicate request is a hit with its distance, and the run-time recheck tightens a threshold
that was set too loose."""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from device_agents.cache.approximate import MIN_RECHECKS, FalseHitMeter, NearIndex, agrees, signature, wilson
from device_agents.cache.stage import policy, shared_cache
from device_agents.config import load_config
from device_agents.lifecycle import Lifecycle
from device_agents.pipeline import Pipeline, Request
from edgekit.bundle.errors import ConfigError
from edgekit.bundle.manifest import ApproximateCache, CachePolicy, Manifest
from tests.agent.bundles import read_manifest, rebundle
from tests.agent.conftest import Bundles, write_config
from tests.factories import sample_inputs


def _scene(seed: int, size: int = 32) -> np.ndarray:
    """A smooth image [1, 3, size, size] in 0..1: a few soft blobs of colour."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32)
    img = np.zeros((3, size, size), np.float32)
    for _ in range(4):
        cy, cx = (float(v) for v in rng.uniform(0, size, 2))
        r = float(rng.uniform(size / 8, size / 3))
        colour = rng.uniform(0, 1, (3, 1, 1)).astype(np.float32)
        img += colour * np.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * r * r))
    out: np.ndarray = (img / img.max())[None]
    return out


def _distance(a: np.ndarray, b: np.ndarray) -> float:
    sa, sb = signature({"x": a}), signature({"x": b})
    assert sa is not None and sb is not None
    return float(1.0 - sa @ sb)


def test_signature_keeps_shifted_noisy_brighter_copies_close_and_other_scenes_far() -> None:
    x = _scene(0)
    rng = np.random.default_rng(1)
    shifted = np.roll(x, 1, axis=3)
    noisy = x + rng.normal(0, 0.02, x.shape).astype(np.float32)
    brighter = x * 1.2 + 0.1
    near = [_distance(x, y) for y in (shifted, noisy, brighter)]
    far = [_distance(x, _scene(seed)) for seed in range(2, 12)]
    assert max(near) < 0.02, near
    assert min(far) > 5 * max(near), (near, far)


def test_near_index_finds_the_closest_signature_of_its_context_only() -> None:
    index = NearIndex(capacity=4)
    sigs = {seed: signature({"x": _scene(seed)}) for seed in range(6)}
    for seed, sig in sigs.items():
        assert sig is not None
        index.add(b"ctx", sig, bytes([seed]))
    query = signature({"x": _scene(5) + 0.01})
    assert query is not None
    found = index.nearest(b"ctx", query)
    assert found is not None and found[0] == bytes([5]) and found[1] < 0.01
    assert index.nearest(b"other context", query) is None
    first = signature({"x": _scene(0)})
    assert first is not None
    oldest = index.nearest(b"ctx", first)  # capacity 4: the two oldest were replaced
    assert oldest is not None and oldest[0] != bytes([0])


def test_agrees_compares_top1_of_scores_and_cosine_of_dense_outputs() -> None:
    scores = np.array([[0.1, 0.7, 0.2]], np.float32)
    assert agrees({"p": scores}, {"p": np.array([[0.2, 0.5, 0.3]], np.float32)})
    assert not agrees({"p": scores}, {"p": np.array([[0.6, 0.3, 0.1]], np.float32)})
    dense = np.linspace(0, 1, 64, dtype=np.float32).reshape(1, 4, 4, 4)
    assert agrees({"m": dense}, {"m": dense * 1.01})
    assert not agrees({"m": dense}, {"m": dense[:, ::-1].copy()})
    cached_labels = np.array([b"cat", b"dog"], dtype=object)  # a BYTES output as the cache hands it back
    assert agrees({"label": cached_labels}, {"label": np.array(["cat", "dog"], dtype=object)})
    assert not agrees({"label": cached_labels}, {"label": np.array(["cat", "cow"], dtype=object)})


def test_false_hit_meter_tightens_only_when_the_rate_is_over_the_budget_with_confidence() -> None:
    assert wilson(0, 0) == (0.0, 1.0)
    low, high = wilson(1, 100)
    assert low < 0.01 < high
    meter = FalseHitMeter("m", threshold=0.4, budget=0.01)
    for _ in range(200):
        assert not meter.record(True)  # all agree: never tightened, however few samples
    assert meter.threshold == 0.4 and meter.rate == 0.0 and meter.bound < 0.02
    wrong = FalseHitMeter("m", threshold=0.4, budget=0.01)
    tightened = [wrong.record(False) for _ in range(MIN_RECHECKS)]
    assert tightened == [False] * (MIN_RECHECKS - 1) + [True]
    assert wrong.threshold == 0.2 and wrong.rechecked == 0  # measured afresh at the new threshold


def _calibrated(manifest: Manifest, max_distance: float) -> Manifest:
    """``manifest`` declaring an approximate cache calibrated at ``max_distance``."""
    approximate = ApproximateCache(
        embedding="input", max_distance=max_distance, agreement=0.99, samples=500, false_hit_rate=0.01,
        false_hit_bound=0.04, false_hit_budget=0.05, hits=300, bound_method="wilson one-sided 95%",
    )  # fmt: skip
    return manifest.with_updates(cache=CachePolicy(mode="approximate", approximate=approximate))


def test_approximate_policy_needs_a_threshold_from_the_config_or_the_manifest(tmp_path: Path, bundles: Bundles) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('store = "s"\ntrusted_keys = ["k.pub"]\n[models.tiny.cache]\nmode = "approximate"\n')
    agent = load_config(path)
    manifest = read_manifest(bundles.v1)
    with pytest.raises(ConfigError, match=r"agent.models.tiny.cache: mode = \"approximate\" needs max_distance"):
        policy("tiny", agent, manifest)
    got = policy("tiny", agent, _calibrated(manifest, 0.03))
    assert got is not None and got.mode == "approximate" and got.max_distance == 0.03
    path.write_text('store = "s"\ntrusted_keys = ["k.pub"]\n[models.m.cache]\nmax_distance = 0.1\n')
    with pytest.raises(ConfigError, match=r"agent.models.m.cache: max_distance goes with mode = \"approximate\""):
        load_config(path)


def _approximate(tmp_path: Path, pub: Path, bundles: Bundles, max_distance: float) -> Lifecycle:
    extra = (
        f'[models.tiny.cache]\nmode = "approximate"\nmax_distance = {max_distance}\nrecheck_fraction = 1.0\n'
        "false_hit_budget = 0.01\n"
    )
    lc = Lifecycle(load_config(write_config(tmp_path, pub, extra)))
    lc.start()
    lc.install(bundles.v1)
    return lc


def _ask(pipeline: Pipeline, x: np.ndarray) -> Request:
    return pipeline.run(None, lambda model: Request("tiny", {"input": x}), lambda r: r)


def test_approximate_stage_answers_a_near_duplicate_with_its_distance(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    lc = _approximate(tmp_path, keypair[1], bundles, max_distance=0.02)
    try:
        pipeline = Pipeline("tiny", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps
        x = _scene(20, size=16)
        assert _ask(pipeline, x).response_parameters["cache"] == "miss"
        near = _ask(pipeline, x + np.float32(0.01))
        assert near.response_parameters["cache"] == "hit" and 0 <= near.response_parameters["distance"] <= 0.02
        far = _ask(pipeline, _scene(21, size=16))
        assert far.response_parameters["cache"] == "miss" and "distance" not in far.response_parameters
        assert b'edgekit_cache_distance_threshold{model="tiny"} 0.02' in lc.metrics.exposition()
    finally:
        lc.stop()


def test_approximate_hit_survives_a_restart_with_its_signature(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    lc = _approximate(tmp_path, keypair[1], bundles, max_distance=0.02)
    x = _scene(22, size=16)
    try:
        pipeline = Pipeline("tiny", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps
        assert _ask(pipeline, x).response_parameters["cache"] == "miss"
        assert _ask(pipeline, x + np.float32(0.01)).response_parameters["cache"] == "hit"  # hit: written to disk
        assert _ask(pipeline, _scene(23, size=16)).response_parameters["cache"] == "miss"  # asked once: memory only
    finally:
        lc.stop()
    assert shared_cache(lc.config, lc.metrics.cache).flush()
    again = Lifecycle(lc.config)  # a new agent on the same store: its signature index starts empty
    again.start()
    try:
        pipeline = Pipeline("tiny", again.registry, again.config, again.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps
        near = _ask(pipeline, x + np.float32(0.02))  # never seen byte for byte: only its signature can answer it
        assert near.response_parameters["cache"] == "hit" and 0 <= near.response_parameters["distance"] <= 0.02
        assert _ask(pipeline, _scene(23, size=16) + np.float32(0.01)).response_parameters["cache"] == "miss"
    finally:
        again.stop()


def test_approximate_recheck_tightens_a_threshold_set_too_loose(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, caplog: pytest.LogCaptureFixture
) -> None:
    lc = _approximate(tmp_path, keypair[1], bundles, max_distance=2.0)  # every input is "near"
    caplog.set_level(logging.WARNING, logger="edgekit.agent")
    try:
        model = lc.registry.get("tiny")
        pipeline = Pipeline("tiny", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps
        first = sample_inputs(1, seed=100)
        top1 = int(next(iter(model.infer({"input": first}).values())).argmax())
        others = [x for x in (sample_inputs(1, seed=s) for s in range(101, 400)) if
                  int(next(iter(model.infer({"input": x}).values())).argmax()) != top1][: MIN_RECHECKS]  # fmt: skip
        assert len(others) == MIN_RECHECKS, "the tiny model gives every input the same class"
        assert _ask(pipeline, first).response_parameters["cache"] == "miss"
        for x in others:  # each answered with first's answer: the wrong class
            assert _ask(pipeline, x).response_parameters["cache"] == "hit"
            time.sleep(0.05)  # one recheck at a time in its queue of 8
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and b'edgekit_cache_distance_threshold{model="tiny"} 1.0' not in (
            lc.metrics.exposition()
        ):
            time.sleep(0.1)
        assert b'edgekit_cache_distance_threshold{model="tiny"} 1.0' in lc.metrics.exposition()
        assert any("distance threshold 2 -> 1" in r.getMessage() for r in caplog.records)
    finally:
        lc.stop()


def test_approximate_policy_takes_the_manifest_s_threshold_when_the_config_sets_none(
    tmp_path: Path, bundles: Bundles
) -> None:
    path = tmp_path / "agent.toml"
    path.write_text('store = "s"\ntrusted_keys = ["k.pub"]\n')
    calibrated = _calibrated(read_manifest(bundles.v1), 0.03)
    got = policy("tiny", load_config(path), calibrated)  # no [models.tiny.cache]: the manifest's policy
    assert got is not None and got.mode == "approximate" and got.max_distance == 0.03
    assert got.false_hit_budget == 0.05 and got.recheck_fraction == 0.0
    path.write_text(
        'store = "s"\ntrusted_keys = ["k.pub"]\n[models.tiny.cache]\nmode = "approximate"\nmax_distance = 0.5\n'
    )
    got = policy("tiny", load_config(path), calibrated)
    assert got is not None and got.max_distance == 0.5  # the config's threshold wins


def test_agent_answers_near_duplicates_with_the_manifest_s_calibrated_threshold(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    manifest = _calibrated(read_manifest(bundles.v1), 0.02)
    bundle = rebundle(bundles.v1, keypair[0], tmp_path / "tiny-calibrated.ekb", cache=manifest.cache)
    lc = Lifecycle(load_config(write_config(tmp_path, keypair[1])))  # no cache table at all
    lc.start()
    try:
        lc.install(bundle)
        pipeline = Pipeline("tiny", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps
        x = _scene(30, size=16)
        assert _ask(pipeline, x).response_parameters["cache"] == "miss"
        near = _ask(pipeline, x + np.float32(0.01))
        assert near.response_parameters["cache"] == "hit" and 0 <= near.response_parameters["distance"] <= 0.02
        assert _ask(pipeline, _scene(31, size=16)).response_parameters["cache"] == "miss"
        assert b'edgekit_cache_distance_threshold{model="tiny"} 0.02' in lc.metrics.exposition()
    finally:
        lc.stop()
