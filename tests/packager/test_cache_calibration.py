"""The approximate cache's host calibration: the threshold it picks holds its false-hit budget with
its stated bound, a fresh draw of perturbations reproduces the rate within that bound, it is the
largest such threshold, and its distances are the agent's own signature distances."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from device_agents.cache.approximate import NearIndex, signature
from edgekit.validate.cache_calibration import (
    CalibrationError,
    Pairs,
    calibrate,
    choose,
    perturb,
    replay,
    scene_bound,
    upper_bound,
)
from edgekit.validate.metrics import RunFn
from tests.agent.test_cache_approximate import _scene
from tests.factories import _save

SIZE = 32
Arrays = dict[str, np.ndarray]


def grid_classifier(path: Path, *, size: int = SIZE, classes: int = 10, seed: int = 0) -> Path:
    """Scores of ``classes`` from the mean colour of each quarter of the image (AveragePool to
    2x2, MatMul, Softmax): near copies of a scene mostly keep their class, other scenes often do
    not, and a scene near a class boundary flips under a small shift: a threshold matters."""
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((12, classes)).astype(np.float32)
    half = [size // 2, size // 2]
    nodes = [
        helper.make_node("AveragePool", ["input"], ["pooled"], kernel_shape=half, strides=half),
        helper.make_node("Flatten", ["pooled"], ["flat"]),
        helper.make_node("MatMul", ["flat", "w"], ["scores"]),
        helper.make_node("Softmax", ["scores"], ["probs"], axis=1),
    ]
    graph = helper.make_graph(
        nodes,
        "grid",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, size, size])],
        [helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", classes])],
        [numpy_helper.from_array(w, "w")],
    )
    return _save(graph, path, 13)


@pytest.fixture(scope="module")
def run_fn(tmp_path_factory: pytest.TempPathFactory) -> RunFn:
    import onnxruntime as ort

    session = ort.InferenceSession(str(grid_classifier(tmp_path_factory.mktemp("cal") / "grid.onnx")))

    def fn(arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"probs": session.run(None, {"input": arrays["input"]})[0]}

    return fn


@pytest.fixture(scope="module")
def scenes() -> dict[str, np.ndarray]:
    return {"input": np.concatenate([_scene(seed, SIZE) for seed in range(150)]).astype(np.float32)}


def test_cache_calibration_reproduces_its_rate_on_a_fresh_draw_within_its_bound(run_fn: RunFn, scenes: Arrays) -> None:
    calibration = calibrate(run_fn, scenes, budget=0.08, copies=4, seed=0)
    assert calibration.samples == 149 + 4 * 150  # the stream's look-ups and the perturbed copies'
    assert 0 < calibration.threshold < 0.1  # near copies only: other scenes are >= 0.1 away
    assert calibration.false_hit_rate <= calibration.bound <= 0.08
    false = round(calibration.false_hit_rate * calibration.hits)
    assert calibration.scenes <= 150 and calibration.scenes < calibration.hits  # several look-ups per scene
    assert calibration.bound == scene_bound(false, calibration.hits, calibration.scenes)
    assert calibration.bound > upper_bound(false, calibration.hits)  # wider than if every hit were independent
    for seed in (1, 2, 3):  # perturbations the calibration did not see
        hits, false = replay(run_fn, scenes, copies=4, seed=seed).at(calibration.threshold)
        assert hits > 100 and false / hits <= calibration.bound, (seed, hits, false, calibration)


def test_cache_calibration_picks_the_largest_threshold_within_the_budget(run_fn: RunFn, scenes: Arrays) -> None:
    pairs = replay(run_fn, scenes, copies=4, seed=0)
    assert (~pairs.agreed).sum() > 0  # the data has false hits to avoid
    calibration = choose(pairs, 0.08)
    for d in np.unique(pairs.distance[pairs.distance > calibration.threshold]):
        hits, false = pairs.at(float(d))
        assert scene_bound(false, hits, pairs.scenes_at(float(d))) > 0.08, d
    with pytest.raises(CalibrationError, match=r"no distance threshold .* under 0.02 .* give more evaluation data"):
        choose(pairs, 0.02)  # this data cannot show 2% with 95% confidence


def test_cache_calibration_all_agreeing_look_ups_take_every_distance() -> None:
    pairs = Pairs(np.linspace(0.0, 0.5, 400), np.ones(400, bool))
    calibration = choose(pairs, 0.01)
    assert calibration.threshold == 0.5 and calibration.hits == 400 and calibration.false_hit_rate == 0.0
    with pytest.raises(CalibrationError, match="about 268 hits"):
        choose(Pairs(np.linspace(0.0, 0.5, 100), np.ones(100, bool)), 0.01)


def test_cache_calibration_counts_a_scene_s_look_ups_as_one_observation() -> None:
    distance, agreed = np.linspace(0.0, 0.5, 400), np.ones(400, bool)
    assert choose(Pairs(distance, agreed), 0.01).threshold == 0.5  # 400 independent hits show 1%
    scene = np.repeat(np.arange(100), 4)  # 100 evaluation samples, four look-ups each: 100 observations
    with pytest.raises(CalibrationError, match="about 268 evaluation samples with a hit"):
        choose(Pairs(distance, agreed, scene), 0.01)
    calibration = choose(Pairs(distance, agreed, scene), 0.05)
    assert calibration.scenes == 100 and calibration.bound == pytest.approx(scene_bound(0, 400, 100))


def test_cache_calibration_distances_are_the_agent_s_signature_distances(run_fn: RunFn, scenes: Arrays) -> None:
    few = {"input": scenes["input"][:20]}
    pairs = replay(run_fn, few, copies=1, seed=7)
    index = NearIndex()
    for i in range(20):
        sig = signature({"input": few["input"][i : i + 1]})
        assert sig is not None
        index.add(b"ctx", sig, bytes([i]))
    copy = perturb(few, np.random.default_rng(7))  # the replay's first (only) draw
    for i in range(20):
        sig = signature({"input": copy["input"][i : i + 1]})
        assert sig is not None
        near = index.nearest(b"ctx", sig)
        assert near is not None and near[1] == pytest.approx(pairs.distance[19 + i], abs=1e-6)


def _package_argv(tmp_path: Path, scenes: Arrays) -> list[str]:
    """``edgekit package`` arguments for the grid classifier as ``grid`` v1 (fp32 cpu), evaluated
    on ``scenes``, signed with a new key under ``tmp_path/keys``."""
    from edgekit.cli import main

    model = grid_classifier(tmp_path / "grid.onnx")
    np.savez(tmp_path / "scenes.npz", input=scenes["input"])
    assert main(["keygen", "--out", str(tmp_path / "keys"), "--name", "k"]) == 0
    argv = [str(model), "--target", "cpu", "--precision", "fp32", "--eval", str(tmp_path / "scenes.npz")]
    return [*argv, "--key", str(tmp_path / "keys/k.key"), "--name", "grid", "-o", str(tmp_path / "out"), "-q"]


def test_package_cache_approximate_records_the_calibration_inspect_shows_it_and_the_agent_uses_it(
    tmp_path: Path, scenes: Arrays, run_fn: RunFn, capsys: pytest.CaptureFixture[str]
) -> None:
    import threading

    from device_agents.config import load_config
    from device_agents.lifecycle import Lifecycle
    from device_agents.pipeline import Pipeline, Request
    from edgekit.bundle.archive import read_unverified_manifest
    from edgekit.cli import main
    from tests.agent.conftest import write_config

    argv = _package_argv(tmp_path, scenes)
    assert main(["package", *argv, "--cache", "approximate", "--false-hit-budget", "0.08"]) == 0
    bundle = tmp_path / "out" / "grid-cpu-v1.ekb"
    manifest, _ = read_unverified_manifest(bundle)
    assert manifest.cache is not None and manifest.cache.mode == "approximate"
    recorded = manifest.cache.approximate
    expected = calibrate(run_fn, scenes, budget=0.08)  # the same replay, run here
    assert recorded is not None and recorded.max_distance == pytest.approx(expected.threshold)
    assert recorded.false_hit_rate == pytest.approx(expected.false_hit_rate)
    assert recorded.false_hit_bound is not None and recorded.false_hit_bound <= 0.08
    assert (recorded.samples, recorded.hits, recorded.false_hit_budget) == (expected.samples, expected.hits, 0.08)
    capsys.readouterr()

    assert main(["inspect", str(bundle)]) == 0
    out = capsys.readouterr().out
    assert "cache: approximate" in out
    assert f"distance threshold {recorded.max_distance:.4g} (input), {recorded.samples} look-ups replayed" in out
    bound_method = "wilson one-sided 95%, one observation per evaluation sample"
    assert f"upper bound {recorded.false_hit_bound:.4f} ({bound_method}), budget 0.08" in out

    lc = Lifecycle(load_config(write_config(tmp_path / "agent", tmp_path / "keys/k.pub")))  # no cache table
    lc.start()
    try:
        lc.install(bundle)
        pipeline = Pipeline("grid", lc.registry, lc.config, lc.metrics, threading.Semaphore(4))  # type: ignore[arg-type]  # what Slots wraps

        def ask(x: np.ndarray) -> Request:
            return pipeline.run(None, lambda model: Request("grid", {"input": x}), lambda r: r)

        x = _scene(500, SIZE)
        assert ask(x).response_parameters["cache"] == "miss"
        near = ask(x * np.float32(1.02))  # brighter: the same signature
        assert near.response_parameters["cache"] == "hit"
        assert near.response_parameters["distance"] <= recorded.max_distance
        assert ask(_scene(501, SIZE)).response_parameters["cache"] == "miss"
    finally:
        lc.stop()


def test_package_cache_approximate_a_budget_the_data_cannot_show_is_one_error_line(
    tmp_path: Path, scenes: Arrays, capsys: pytest.CaptureFixture[str]
) -> None:
    from edgekit.cli import main

    argv = _package_argv(tmp_path, scenes)
    capsys.readouterr()
    assert main(["package", *argv, "--cache", "approximate", "--false-hit-budget", "0.02"]) == 2
    err = capsys.readouterr().err
    assert "no distance threshold keeps the cache's false-hit rate under 0.02" in err
    assert not (tmp_path / "out" / "grid-cpu-v1.ekb").exists()
