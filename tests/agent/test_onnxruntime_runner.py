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
from tests.agent.conftest import Bundles


@pytest.fixture()
def runner(tmp_path: Path, tiny_model: Path, bundles: Bundles) -> OnnxRuntimeRunner:
    manifest = read_manifest(bundles.v1)
    (artifact,) = [f for f in manifest.artifact_files() if f.path.endswith(".onnx")]
    shutil.copy(tiny_model, tmp_path / artifact.path)
    return OnnxRuntimeRunner(tmp_path, manifest, OnnxRuntimeOptions(threads=1))


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


def test_onnxruntime_runner_turns_thread_spinning_off_when_configured(
    tmp_path: Path, tiny_model: Path, bundles: Bundles
) -> None:
    manifest = read_manifest(bundles.v1)
    (artifact,) = [f for f in manifest.artifact_files() if f.path.endswith(".onnx")]
    shutil.copy(tiny_model, tmp_path / artifact.path)
    quiet = OnnxRuntimeRunner(tmp_path, manifest, OnnxRuntimeOptions(threads=2, spinning=False))
    default = OnnxRuntimeRunner(tmp_path, manifest, OnnxRuntimeOptions(threads=2))
    entry = "session.intra_op.allow_spinning"
    assert quiet.session.get_session_options().get_session_config_entry(entry) == "0"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # ORT's default (spinning) left alone
        default.session.get_session_options().get_session_config_entry(entry)


def test_onnxruntime_runner_stops_spinning_after_each_run_when_configured(
    tmp_path: Path, tiny_model: Path, bundles: Bundles
) -> None:
    manifest = read_manifest(bundles.v1)
    (artifact,) = [f for f in manifest.artifact_files() if f.path.endswith(".onnx")]
    shutil.copy(tiny_model, tmp_path / artifact.path)
    between = OnnxRuntimeRunner(tmp_path, manifest, OnnxRuntimeOptions(threads=2, spin_between_runs=False))
    default = OnnxRuntimeRunner(tmp_path, manifest, OnnxRuntimeOptions(threads=2))
    entry = "session.force_spinning_stop"
    assert between.session.get_session_options().get_session_config_entry(entry) == "1"
    with pytest.raises(RuntimeError, match="does not have configuration"):  # ORT's default left alone
        default.session.get_session_options().get_session_config_entry(entry)
    with pytest.raises(RuntimeError, match="does not have configuration"):  # it still spins inside a run
        between.session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning")
    x = np.ones((2, 3, 16, 16), np.float32)
    np.testing.assert_allclose(between.run({"input": x})["probs"], _expected(tiny_model, x), rtol=1e-6)
