"""Runtime settings that follow the memory budget (``device_agents.budgets.knobs``): what each
runtime is given under a budget, read back from the real runtime where it says (ONNX Runtime's
session options, OpenVINO's compiled-model properties, LiteRT's worker threads), and the TensorRT
workspace bound its builder and ONNX Runtime fallback take."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from device_agents.budgets.knobs import Room, follow_budget
from device_agents.budgets.memory import MemoryBudget
from device_agents.runtimes.options import LiteRtOptions, OnnxRuntimeOptions, OpenVinoOptions, TensorRtOptions
from edgekit.bundle import TrustStore, extract, file_entries, read_verified_manifest
from edgekit.bundle.manifest import Estimates, Manifest
from tests.factories import make_cpu_bundle, sample_inputs, tiny_classifier

MB = 1024 * 1024
ROOMY = Room(free_bytes=400 * MB, need_bytes=40 * MB)
TIGHT = Room(free_bytes=60 * MB, need_bytes=40 * MB)
REPO = Path(__file__).resolve().parents[2]


def _cpu_model(tmp_path: Path, keypair: tuple[Path, Path]) -> tuple[Path, Manifest]:
    onnx_path = tiny_classifier(tmp_path / "m.onnx")
    bundle = make_cpu_bundle(tmp_path / "m.ekb", onnx_path, keypair[0], golden_inputs=sample_inputs(2))
    verified = read_verified_manifest(bundle, TrustStore.from_files([keypair[1]]))
    return extract(bundle, verified, tmp_path / "model"), verified.manifest


def test_follow_budget_fills_in_only_what_the_user_left_to_the_runtime() -> None:
    roomy = follow_budget(OnnxRuntimeOptions(), ROOMY)
    assert isinstance(roomy, OnnxRuntimeOptions)
    assert (roomy.cpu_mem_arena, roomy.mem_pattern, roomy.threads, roomy.inter_op_threads) == (False, False, 0, 0)
    tight = follow_budget(OnnxRuntimeOptions(), TIGHT)
    assert isinstance(tight, OnnxRuntimeOptions) and (tight.threads, tight.inter_op_threads) == (1, 1)
    mine = follow_budget(OnnxRuntimeOptions(threads=3, cpu_mem_arena=True), TIGHT)
    assert isinstance(mine, OnnxRuntimeOptions) and (mine.threads, mine.cpu_mem_arena) == (3, True)
    ov = follow_budget(OpenVinoOptions(), TIGHT)
    assert isinstance(ov, OpenVinoOptions)
    assert (ov.runtime_cache_capacity, ov.threads, ov.num_streams, ov.performance_hint) == (0, 1, 1, "LATENCY")
    ov = follow_budget(OpenVinoOptions(performance_hint="THROUGHPUT", runtime_cache_capacity=10), TIGHT)
    assert isinstance(ov, OpenVinoOptions) and (ov.performance_hint, ov.runtime_cache_capacity) == ("THROUGHPUT", 10)
    assert follow_budget(LiteRtOptions(), ROOMY) == LiteRtOptions()
    assert follow_budget(LiteRtOptions(), TIGHT) == LiteRtOptions(threads=1)
    assert follow_budget(TensorRtOptions(), TIGHT) == TensorRtOptions(memory_budget_mb=60, threads=1)
    assert follow_budget(TensorRtOptions(memory_budget_mb=512), ROOMY) == TensorRtOptions(memory_budget_mb=512)
    # a need not known yet is not tight: the first load is measured as it is configured
    assert not Room(free_bytes=MB, need_bytes=0).tight


def test_memory_budget_room_takes_off_the_agent_the_other_models_and_what_else_is_held(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    from device_agents.runtimes import load_model

    model_dir, manifest = _cpu_model(tmp_path, keypair)
    rss = [100 * MB]
    budget = MemoryBudget(300 * MB, rss=lambda: rss[0])
    other = dataclasses.replace(manifest, name="other", estimates=Estimates(memory_mb=50.0))
    budget.load(other, lambda: load_model(model_dir, other))  # holds what its load measured: 0 here
    rss[0] = 180 * MB  # 80 MB beyond the agent: held by nothing it knows of, counted as taken
    want = dataclasses.replace(manifest, estimates=Estimates(memory_mb=70.0))
    room = budget.room(want)
    assert (room.free_bytes, room.need_bytes) == (120 * MB, 70 * MB) and room.tight


def test_onnxruntime_session_gets_no_arena_and_one_thread_under_a_tight_budget(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    from device_agents.runtimes.onnxruntime import OnnxRuntimeRunner

    model_dir, manifest = _cpu_model(tmp_path, keypair)
    default = OnnxRuntimeRunner(model_dir, manifest, OnnxRuntimeOptions(threads=2))
    options = follow_budget(OnnxRuntimeOptions(), TIGHT)
    assert isinstance(options, OnnxRuntimeOptions)
    budgeted = OnnxRuntimeRunner(model_dir, manifest, options)
    try:
        got = default.session.get_session_options()
        assert (got.enable_cpu_mem_arena, got.enable_mem_pattern, got.intra_op_num_threads) == (True, True, 2)
        got = budgeted.session.get_session_options()
        assert (got.enable_cpu_mem_arena, got.enable_mem_pattern) == (False, False)
        assert (got.intra_op_num_threads, got.inter_op_num_threads) == (1, 1)
        x = sample_inputs(3)
        np.testing.assert_allclose(budgeted.run({"input": x})["probs"], default.run({"input": x})["probs"], rtol=1e-6)
    finally:
        default.close()
        budgeted.close()


def test_openvino_compiles_with_one_stream_one_thread_and_no_shape_cache_under_a_tight_budget(
    tmp_path: Path, keypair: tuple[Path, Path]
) -> None:
    import openvino as ov

    from device_agents.runtimes.openvino import OpenVinoRunner

    model_dir, manifest = _cpu_model(tmp_path, keypair)
    ov.save_model(ov.convert_model(str(model_dir / "model.onnx")), str(model_dir / "model.xml"))
    manifest = dataclasses.replace(
        manifest,
        target="intel",
        files=file_entries(model_dir, {"model.xml": "artifact", "model.bin": "artifact", "golden.npz": "golden"}),
    )
    options = follow_budget(OpenVinoOptions(device="CPU", performance_hint="THROUGHPUT", num_streams=2), ROOMY)
    roomy = OpenVinoRunner(model_dir, manifest, options)  # type: ignore[arg-type]  # an OpenVinoOptions in, one out
    tight = OpenVinoRunner(model_dir, manifest, follow_budget(OpenVinoOptions(device="CPU"), TIGHT))  # type: ignore[arg-type]  # as above
    try:
        c = roomy.compiled
        assert (str(c.get_property("PERFORMANCE_HINT")), int(c.get_property("NUM_STREAMS"))) == ("THROUGHPUT", 2)
        c = tight.compiled
        assert str(c.get_property("PERFORMANCE_HINT")) == "LATENCY"
        assert int(c.get_property("NUM_STREAMS")) == 1 and int(c.get_property("INFERENCE_NUM_THREADS")) == 1
        # the CPU plugin does not read this one back; it took it (an unknown property fails the compile)
        assert tight.config["CPU_RUNTIME_CACHE_CAPACITY"] == 0 == roomy.config["CPU_RUNTIME_CACHE_CAPACITY"]
        x = sample_inputs(2)
        np.testing.assert_allclose(tight.run({"input": x})["probs"], roomy.run({"input": x})["probs"], atol=1e-5)
    finally:
        roomy.close()
        tight.close()


def test_tensorrt_workspace_is_bounded_by_the_room_the_budget_leaves() -> None:
    from device_agents.runtimes.tensorrt import workspace_bound_mb

    manifest = Manifest.from_json((REPO / "tests/golden/manifest_v1.json").read_bytes())
    manifest = dataclasses.replace(manifest, target_options={"workspace_mb": 1024})
    assert workspace_bound_mb(TensorRtOptions(), manifest) == 1024
    assert workspace_bound_mb(follow_budget(TensorRtOptions(), TIGHT), manifest) == 60  # type: ignore[arg-type]  # a TensorRtOptions in, one out
    assert workspace_bound_mb(follow_budget(TensorRtOptions(memory_budget_mb=30), TIGHT), manifest) == 30  # type: ignore[arg-type]  # as above


@pytest.fixture(scope="module")
def tflite_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tensorflow", reason="tensorflow builds the .tflite model")
    from tests.packaging.test_litert_fallback import MAKE_TFLITE

    path = tmp_path_factory.mktemp("tflite") / "tiny.tflite"
    done = subprocess.run(
        [sys.executable, "-c", MAKE_TFLITE, str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return path


def test_litert_interpreter_runs_the_threads_the_budget_leaves_it(tflite_model: Path) -> None:
    from device_agents.runtimes import litert

    manifest = Manifest.from_json((REPO / "tests/golden/manifest_v1.json").read_bytes())
    files = tuple(dataclasses.replace(f, path=tflite_model.name) if f.role == "artifact" else f for f in manifest.files)
    manifest = dataclasses.replace(
        manifest, files=files, split=None, compatibility=dataclasses.replace(manifest.compatibility, accelerator=None)
    )
    x = {"x": np.array([[1.0, -2.0, 3.0, 0.5]], np.float32)}

    def workers(options: LiteRtOptions) -> int:
        """The threads the interpreter starts (XNNPACK's pool: threads - 1) for a load and a call."""
        before = len(os.listdir("/proc/self/task"))
        runner = litert.LiteRtRunner(tflite_model.parent, manifest, options)
        runner.run(x)
        started = len(os.listdir("/proc/self/task")) - before
        runner.close()
        return started

    if not Path("/proc/self/task").is_dir():
        pytest.skip("counts threads in /proc (Linux)")
    assert workers(LiteRtOptions(threads=3)) == 2
    tight = follow_budget(LiteRtOptions(), TIGHT)
    assert isinstance(tight, LiteRtOptions) and workers(tight) == 0
    assert workers(follow_budget(LiteRtOptions(threads=3), TIGHT)) == 2  # type: ignore[arg-type]  # the user's count stays


@pytest.mark.parametrize("budget", ["", "[budgets]\nmemory_mb = 100000\n"])
def test_agent_loads_models_with_the_settings_its_memory_budget_calls_for(
    tmp_path: Path, keypair: tuple[Path, Path], budget: str
) -> None:
    from device_agents.config import load_config
    from device_agents.lifecycle import Lifecycle
    from tests.agent.conftest import write_config

    onnx_path = tiny_classifier(tmp_path / "m.onnx")
    bundle = make_cpu_bundle(tmp_path / "m.ekb", onnx_path, keypair[0], golden_inputs=sample_inputs(2))
    lc = Lifecycle(load_config(write_config(tmp_path / "agent", keypair[1], budget)))
    lc.start()
    try:
        lc.install(bundle)
        entry = lc.registry.peek("tiny")
        assert entry is not None
        got = entry.model.runner.session.get_session_options()  # type: ignore[attr-defined]  # an OnnxRuntimeRunner
        arena = not budget  # off under a memory budget, ONNX Runtime's default without one
        assert (got.enable_cpu_mem_arena, got.enable_mem_pattern, got.intra_op_num_threads) == (arena, arena, 1)
    finally:
        lc.stop()
