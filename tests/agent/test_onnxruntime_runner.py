"""The ONNX Runtime runner's call path: the C++ session's run with prebound output names, and
ONNX Runtime's own provider fallback kept for an ``EPFail``."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
from onnxruntime.capi.onnxruntime_pybind11_state import EPFail

from device_agents.runtimes.onnxruntime import OnnxRuntimeRunner
from device_agents.runtimes.options import OnnxRuntimeOptions
from tests.agent.bundles import read_manifest
from tests.agent.conftest import Bundles, needs_two_cpus, one_cpu


@pytest.fixture()
def runner(tmp_path: Path, tiny_model: Path, bundles: Bundles) -> OnnxRuntimeRunner:
    return _runner(tmp_path, tiny_model, bundles, OnnxRuntimeOptions(threads=1))


def _expected(tiny_model: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(tiny_model), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"input": x})[0])


def test_onnxruntime_runner_runs_without_the_python_session_wrapper(
    runner: OnnxRuntimeRunner, tiny_model: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def wrapper_called(*args: object) -> None:
        raise AssertionError("InferenceSession.run (the Python wrapper) was called")

    monkeypatch.setattr(runner.session, "run", wrapper_called)
    x = np.ones((1, 3, 16, 16), np.float32)
    out = runner.run({"input": x})
    np.testing.assert_allclose(out["probs"], _expected(tiny_model, x), rtol=1e-6)


def test_onnxruntime_runner_falls_back_through_the_session_on_an_ep_failure(
    runner: OnnxRuntimeRunner, tiny_model: Path
) -> None:
    def ep_fails(*args: object) -> None:
        raise EPFail("the execution provider failed")

    runner._run = ep_fails  # the fast path fails as a CUDA/TensorRT provider would
    x = np.ones((2, 3, 16, 16), np.float32)
    out = runner.run({"input": x})  # answered by InferenceSession.run (its fallback), fast path rebound
    np.testing.assert_allclose(out["probs"], _expected(tiny_model, x), rtol=1e-6)
    assert runner._run is not ep_fails


def test_onnxruntime_runner_still_refuses_a_missing_input(runner: OnnxRuntimeRunner) -> None:
    with pytest.raises(Exception, match="input"):
        runner.run({})


def _session_entry(runner: OnnxRuntimeRunner, entry: str) -> str | None:
    """A session config entry of ``runner``'s session; None where it was left at ORT's default."""
    try:
        return str(runner.session.get_session_options().get_session_config_entry(entry))
    except RuntimeError as exc:
        assert "does not have configuration" in str(exc)
        return None


def _runner(tmp_path: Path, tiny_model: Path, bundles: Bundles, options: OnnxRuntimeOptions) -> OnnxRuntimeRunner:
    manifest = read_manifest(bundles.v1)
    (artifact,) = [f for f in manifest.artifact_files() if f.path.endswith(".onnx")]
    shutil.copy(tiny_model, tmp_path / artifact.path)
    return OnnxRuntimeRunner(tmp_path, manifest, options)


@pytest.mark.parametrize(
    ("setting", "entry", "value"),
    [
        ({"spinning": False}, "session.intra_op.allow_spinning", "0"),
        ({"spin_between_runs": False}, "session.force_spinning_stop", "1"),
    ],
    ids=["spinning-off", "no-spin-between-runs"],
)
def test_onnxruntime_runner_sets_a_thread_spinning_option_only_when_configured(
    tmp_path: Path, tiny_model: Path, bundles: Bundles, setting: dict[str, bool], entry: str, value: str
) -> None:
    configured = _runner(tmp_path, tiny_model, bundles, OnnxRuntimeOptions(threads=2, **setting))
    default = _runner(tmp_path, tiny_model, bundles, OnnxRuntimeOptions(threads=2))
    assert _session_entry(configured, entry) == value
    assert _session_entry(default, entry) is None  # ORT's default left alone


def test_onnxruntime_runner_that_stops_spinning_between_runs_still_spins_inside_one(
    tmp_path: Path, tiny_model: Path, bundles: Bundles
) -> None:
    between = _runner(tmp_path, tiny_model, bundles, OnnxRuntimeOptions(threads=2, spin_between_runs=False))
    assert _session_entry(between, "session.intra_op.allow_spinning") is None
    x = np.ones((2, 3, 16, 16), np.float32)
    np.testing.assert_allclose(between.run({"input": x})["probs"], _expected(tiny_model, x), rtol=1e-6)


@needs_two_cpus
def test_onnxruntime_runner_sizes_its_default_pool_to_the_cpus_the_process_may_use(
    tmp_path: Path, tiny_model: Path, bundles: Bundles
) -> None:
    # ORT's own default is one thread per physical core of the machine, whatever the affinity
    # (microsoft/onnxruntime#29510): two threads on one CPU ran the bench MLP 2.5x slower here
    with one_cpu():
        default = _runner(tmp_path, tiny_model, bundles, OnnxRuntimeOptions())
        configured = _runner(tmp_path, tiny_model, bundles, OnnxRuntimeOptions(threads=3))
    assert default.session.get_session_options().intra_op_num_threads == 1
    assert configured.session.get_session_options().intra_op_num_threads == 3  # what the config says wins
    x = np.ones((2, 3, 16, 16), np.float32)
    np.testing.assert_allclose(default.run({"input": x})["probs"], _expected(tiny_model, x), rtol=1e-6)
