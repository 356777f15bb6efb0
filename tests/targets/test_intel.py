"""The ``intel`` target (OpenVINO IR via NNCF) and the ``openvino`` device runtime.

Tiny models built in code; every artifact is checked against ONNX Runtime FP32, through the same
runtime module the agent uses, and one bundle is served by a real agent over the v2 API.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import edgekit
from device_agents.errors import IncompatibleError
from device_agents.runtimes import load_model
from device_agents.runtimes.openvino import OpenVinoRunner
from device_agents.runtimes.options import OpenVinoOptions
from edgekit.bundle.manifest import Manifest, Tolerance
from edgekit.compress.onnx_prep import prepare_model
from edgekit.errors import ConfigError, UnsupportedOpError
from edgekit.optimize.run import build as build_with_engine
from edgekit.targets.base import BuildContext
from edgekit.targets.intel import IntelOptions, IntelTarget
from edgekit.targets.op_support import TargetOpError
from tests.agent.conftest import RunningAgent, agent_cli, start_agent, write_config
from tests.factories import sample_inputs, tiny_classifier, tiny_dense

CALIB = sample_inputs(60, seed=3) * 3.0  # scaled so that the tiny classifier's classes are well apart


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("intel-model") / "tiny.onnx")


@pytest.fixture(scope="module")
def int8_bundle(tmp_path_factory: pytest.TempPathFactory, classifier: Path, keypair: tuple[Path, Path]) -> Path:
    out = tmp_path_factory.mktemp("intel-bundles")
    result = edgekit.package(
        classifier, targets=["intel"], precision="int8", calib={"input": CALIB}, key=keypair[0], out_dir=out
    )
    return result.bundles["intel"]


def _ort(model: Path, x: np.ndarray) -> np.ndarray:
    session = ort.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]  # type: ignore[no-any-return]  # an array


def _context(tmp_path: Path, model: Path, precision: str, options: IntelOptions) -> BuildContext:
    prepared = prepare_model(model, tmp_path / "prepared")
    (tmp_path / "out").mkdir()
    (tmp_path / "work").mkdir()
    return BuildContext(
        model_path=prepared.path,
        served=prepared.served,
        precision=precision,
        calib={"input": CALIB},
        static_shapes={"input": (1, 3, 16, 16)},
        out_dir=tmp_path / "out",
        work_dir=tmp_path / "work",
        options=options,
        progress=lambda _msg: None,
    )


def test_intel_int8_bundle_runs_in_the_openvino_runtime_like_fp32(
    int8_bundle: Path, classifier: Path, open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    model_dir, manifest = open_bundle(int8_bundle)
    assert manifest.target == "intel" and manifest.compatibility.runtime == "openvino"
    assert manifest.precision.label == "w8a8" and manifest.precision.method.startswith("nncf ")
    assert {f.path for f in manifest.artifact_files()} == {"model.xml", "model.bin"}
    assert manifest.validation.passed and manifest.validation.measured_on.startswith("host openvino")
    # Op placement comes from OpenVINO's query_model: real OpenVINO op types on the CPU plugin.
    placement = manifest.op_placement
    assert placement is not None and placement.tool == "openvino query_model(CPU)"
    assert {"Convolution", "FakeQuantize"} <= {e.op for e in placement.entries}
    assert placement.fallback == 0 and placement.accelerated == len(placement.entries)
    served = load_model(model_dir, manifest, OpenVinoOptions(device="CPU", threads=1))
    try:
        x = sample_inputs(64, seed=11) * 3.0
        got = np.concatenate([served.infer({"input": x[i : i + 8]})["probs"] for i in range(0, 64, 8)])  # dynamic batch
        assert served.runner.describe()["execution_devices"] == ["CPU"]
    finally:
        served.close()
    want = _ort(classifier, x)
    assert got.shape == want.shape and got.dtype == np.float32
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.95


@pytest.fixture(scope="module")
def agent(
    tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path], int8_bundle: Path
) -> Iterator[RunningAgent]:
    runtimes = '[runtimes.openvino]\ndevice = "CPU"\nthreads = 1\n'
    config = write_config(tmp_path_factory.mktemp("intel-agent"), keypair[1], runtimes)
    done = agent_cli("install", str(int8_bundle), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    running = start_agent(config)
    yield running
    assert running.stop() == 0


def test_intel_bundle_is_served_by_the_agent_over_v2(agent: RunningAgent, classifier: Path) -> None:
    import tritonclient.http as triton

    client = triton.InferenceServerClient(agent.address)
    meta = client.get_model_metadata("tiny")
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 16, 16]}]
    x = sample_inputs(4, seed=21) * 3.0
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    got = client.infer("tiny", [inp]).as_numpy("probs")
    want = _ort(classifier, x)
    np.testing.assert_allclose(got.sum(axis=1), 1.0, rtol=1e-3)
    assert np.abs(got - want).max() < 0.05


def test_intel_fp32_keeps_fp32_arithmetic_where_the_cpu_would_pick_bf16(
    tmp_path: Path, classifier: Path, keypair: tuple[Path, Path], open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    result = edgekit.package(
        classifier, targets=["intel"], precision="fp32", calib={"input": CALIB}, key=keypair[0], out_dir=tmp_path
    )
    model_dir, manifest = open_bundle(result.bundles["intel"])
    assert manifest.target_options["inference_precision"] == "f32"
    runner = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU"))
    try:
        assert str(runner.compiled.get_property("INFERENCE_PRECISION_HINT")) in ("f32", "<Type: 'float32'>")
        x = sample_inputs(8, seed=5) * 3.0
        np.testing.assert_allclose(runner.run({"input": x})["probs"], _ort(classifier, x), atol=1e-5)
    finally:
        runner.close()


def test_intel_int4_weights_compress_matmul_weights_and_pass_the_dense_gate(
    tmp_path: Path, keypair: tuple[Path, Path], open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    import openvino as ov

    model = tiny_dense(tmp_path / "dense.onnx")
    calib = {"image": sample_inputs(40, seed=2)}
    result = edgekit.package(
        model,
        targets=["intel"],
        precision="int4-weights",
        calib=calib,
        key=keypair[0],
        out_dir=tmp_path,
        options={"intel": IntelOptions(int4_group_size=32, int4_ratio=1.0, int4_all_layers=True)},
        allow_small_eval=True,  # 8 held out: the int4 weights are tested, not the gate
    )
    model_dir, manifest = open_bundle(result.bundles["intel"])
    assert manifest.precision.label == "w4a32" and "group_size=32" in manifest.precision.method
    assert manifest.validation.passed and manifest.validation.cosine is not None and manifest.validation.cosine >= 0.96
    ir = ov.Core().read_model(str(model_dir / "model.xml"))
    weight_types = {
        op.get_output_element_type(0).get_type_name() for op in ir.get_ordered_ops() if op.get_type_name() == "Constant"
    }
    assert "i4" in weight_types


def test_intel_int4_group_size_that_divides_nothing_names_the_option(tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "dense.onnx")
    prepared = prepare_model(model, tmp_path / "prepared")
    ctx = BuildContext(
        model_path=prepared.path, served=prepared.served, precision="int4-weights",
        calib={"image": sample_inputs(4, seed=2)}, static_shapes={}, out_dir=tmp_path, work_dir=tmp_path,
        options=IntelOptions(int4_group_size=48, int4_ratio=1.0, int4_all_layers=True), progress=lambda _m: None,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"targets\.intel\.int4_group_size"):
        build_with_engine(IntelTarget(), ctx)


def test_intel_int4_that_nncf_leaves_in_int8_is_refused_not_mislabelled(tmp_path: Path) -> None:
    model = tiny_dense(tmp_path / "dense.onnx")  # one MatMul, the last layer: NNCF keeps it int8 by default
    prepared = prepare_model(model, tmp_path / "prepared")
    ctx = BuildContext(
        model_path=prepared.path, served=prepared.served, precision="int4-weights",
        calib={"image": sample_inputs(4, seed=2)}, static_shapes={}, out_dir=tmp_path, work_dir=tmp_path,
        options=IntelOptions(int4_group_size=32), progress=lambda _m: None,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=r"targets\.intel\.int4_all_layers: NNCF put no weight in int4"):
        build_with_engine(IntelTarget(), ctx)


def test_intel_int8_tries_the_accurate_nncf_recipes_when_the_first_misses_the_gate(
    tmp_path: Path, classifier: Path
) -> None:
    from edgekit.optimize.run import EngineSettings, optimize

    # A gate no quantized model can meet (top-1 agreement > 100%), judged on real outputs.
    impossible = Tolerance(min_top1_agreement=1.01)
    ctx = _context(tmp_path, classifier, "int8", IntelOptions())
    result = optimize(IntelTarget(), ctx, EngineSettings(tolerance=impossible)).build
    tried = [n for n in result.notes if n.startswith("tried nncf")]
    assert [t.split(":")[0] for t in tried] == [
        "tried nncf int8 preset=performance bias_correction=fast",
        "tried nncf int8 preset=mixed bias_correction=full",
        "tried nncf int8 preset=performance bias_correction=fast accuracy-control",
    ]
    assert all("failed: top-1 agreement" in t for t in tried), tried
    assert any(n.startswith("chose nncf int8 preset=") for n in result.notes)


def test_intel_for_an_absent_gpu_validates_on_the_cpu_plugin_and_the_runtime_refuses_to_load(
    tmp_path: Path, classifier: Path, keypair: tuple[Path, Path], open_bundle: Callable[[Path], tuple[Path, Manifest]]
) -> None:
    result = edgekit.package(
        classifier, targets=["intel"], precision="fp16", calib={"input": CALIB}, key=keypair[0], out_dir=tmp_path,
        options={"intel": IntelOptions(device="GPU")},
    )  # fmt: skip
    model_dir, manifest = open_bundle(result.bundles["intel"])
    assert manifest.compatibility.accelerator == "intel-gpu"
    assert manifest.precision.label == "w16a16" and manifest.target_options["inference_precision"] == "f16"
    assert manifest.validation.passed and "openvino CPU plugin (same IR)" in manifest.validation.measured_on
    assert any("op placement queried for CPU: GPU is not on this host" in n for n in manifest.validation.notes)
    with pytest.raises(IncompatibleError, match="OpenVINO device 'GPU' is not available here"):
        OpenVinoRunner(model_dir, manifest, OpenVinoOptions())
    # The agent's config picks the device: the same bundle runs on this host's CPU when told so.
    runner = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU"))
    try:
        x = sample_inputs(4, seed=9) * 3.0
        np.testing.assert_allclose(runner.run({"input": x})["probs"], _ort(classifier, x), atol=2e-3)
    finally:
        runner.close()


def test_intel_check_model_names_the_op_the_node_and_who_can_take_it(tmp_path: Path) -> None:
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="relu"),
        helper.make_node("FancyOp", ["a"], ["y"], name="my_fancy_node", domain="com.example"),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13), helper.make_opsetid("com.example", 1)])
    path = tmp_path / "custom.onnx"
    onnx.save(model, str(path))
    with pytest.raises(UnsupportedOpError) as caught:
        IntelTarget().check_model(path)
    err = caught.value
    assert isinstance(err, TargetOpError)
    assert "com.example.FancyOp" in str(err) and "'my_fancy_node'" in str(err) and "OpenVINO" in str(err)
    # Which other targets can take it is asked of their own checkers: coral's onnx2tf has no such op.
    assert "coral" not in err.alternatives


def test_intel_options_reject_an_unknown_device_with_the_nearest_choice() -> None:
    with pytest.raises(
        ConfigError, match=r"targets\.intel\.device: 'GPX' is not one of CPU, GPU, NPU, AUTO; did you mean 'GPU'"
    ):
        IntelOptions(device="GPX")


def test_intel_accuracy_control_is_bounded_by_the_target_options(tmp_path: Path, classifier: Path) -> None:
    """NNCF's accuracy control reverts every quantized layer by default (one evaluation each: minutes
    on a MobileNetV3-small); the target passes its bounds to NNCF and records them."""
    import nncf

    from edgekit.optimize.openvino_candidates import NncfRecipe, restorer_parameters
    from edgekit.optimize.run import EngineSettings, optimize

    options = IntelOptions(accuracy_control_max_layers=2, accuracy_control_ranking_samples=5)
    ctx = _context(tmp_path, classifier, "int8", options)
    search = optimize(IntelTarget(), ctx, EngineSettings(tolerance=Tolerance(min_top1_agreement=1.01))).search
    [control] = [o for o in search.outcomes if o.name.endswith("accuracy-control")]
    assert (control.settings["max_reverted_layers"], control.settings["ranking_samples"]) == (2, 5)
    assert control.status == "failed", control.reason  # it ran (bounded) and missed the impossible gate
    bounds = restorer_parameters(nncf, NncfRecipe("performance", True, accuracy_control=True), 20)
    assert (bounds.max_num_iterations, bounds.ranking_subset_size) == (8, 20)  # the default; never more than we have


def test_int8_with_float_ops_in_bf16_reuses_the_quantized_ir_and_runs_with_the_bf16_hint(
    tmp_path: Path, classifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import nncf

    from edgekit.optimize.candidates import BuildSpace
    from edgekit.optimize.openvino_candidates import FLOAT_OPS_BF16, NncfRecipe, bf16_unavailable, nncf_bf16_offer

    prepared = prepare_model(classifier, tmp_path / "prepared")
    recipe = NncfRecipe("performance", True)
    offered, skipped = nncf_bf16_offer(prepared.path, recipe, "CPU", prepared.path, {})
    why = bf16_unavailable("CPU")
    if why:  # a CPU without AVX512-BF16 / AMX: the candidate is not offered, and the reason is kept
        assert not offered and skipped == ((f"{recipe.label}, {FLOAT_OPS_BF16}", why),)
        pytest.skip(f"bf16 not measurable on this CPU: {why}")
    [sibling] = offered  # no head outputs: no head-in-float form
    assert sibling.name.endswith(FLOAT_OPS_BF16) and sibling.settings["inference_precision"] == "bf16"
    calls = []
    real = nncf.quantize

    def counted(*args, **kwargs):  # the real quantizer, counted
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(nncf, "quantize", counted)
    from edgekit.optimize.openvino_candidates import nncf_candidate

    built = {}
    for name, cand in (("base", nncf_candidate(prepared.path, recipe, "CPU", prepared.path)), ("bf16", sibling)):
        folder = tmp_path / name
        folder.mkdir()
        space = BuildSpace(folder, {"input": CALIB}, prepared.served, 4, progress=lambda _m: None)
        built[name] = (cand.build(space), folder)
    assert len(calls) == 1  # the bf16 form read the recipe's IR instead of quantizing again
    base, bf16 = built["base"][0], built["bf16"][0]
    assert (base.precision.label, bf16.precision.label) == ("w8a8", "w8abf16")
    assert FLOAT_OPS_BF16 in bf16.precision.method
    assert (built["bf16"][1] / "model.bin").read_bytes() == (built["base"][1] / "model.bin").read_bytes()
    x = sample_inputs(8, seed=5) * 3.0
    got, want = bf16.open(0)({"input": x})["probs"], base.open(0)({"input": x})["probs"]
    assert np.argmax(got, -1).tolist() == np.argmax(want, -1).tolist()
    assert np.abs(got - want).max() < 0.05  # bf16 float ops: close to, not equal to, the f32 ones


def test_accuracy_control_cost_counts_one_evaluation_per_quantized_layer(classifier: Path) -> None:
    from edgekit.optimize.openvino_candidates import QUANTIZED_LAYERS, NncfRecipe, accuracy_control_cost

    layers = sum(1 for n in onnx.load(str(classifier)).graph.node if n.op_type in QUANTIZED_LAYERS)
    assert layers >= 2
    recipe = NncfRecipe("performance", True, accuracy_control=True, max_reverted_layers=3, ranking_samples=50)
    seconds, how = accuracy_control_cost(classifier, recipe, 20.0, 96)
    assert seconds == (layers + 3 + 2) * 50 * 20.0 / 1000  # ranking samples bounded by the recipe
    assert f"up to {layers + 5} times ({layers} quantized layers to rank" in how
    assert "up to 50 samples at ~20.0 ms" in how
    assert accuracy_control_cost(classifier, recipe, 20.0, 10)[0] == (layers + 5) * 10 * 20.0 / 1000


def test_intel_options_reject_an_accuracy_control_bound_below_one() -> None:
    with pytest.raises(ConfigError, match=r"targets\.intel\.accuracy_control_max_layers: must be >= 1, got 0"):
        IntelOptions(accuracy_control_max_layers=0)


def test_openvino_runner_sizes_its_default_threads_to_a_cgroup_cpu_quota(
    int8_bundle: Path, open_bundle: Callable[[Path], tuple[Path, Manifest]], monkeypatch: pytest.MonkeyPatch
) -> None:
    # OpenVINO follows the CPU affinity but not a quota: it took 2 threads under a 1-CPU cgroup quota here
    from device_agents import cpus

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two CPUs for a quota under the machine's count")
    model_dir, manifest = open_bundle(int8_bundle)
    monkeypatch.setattr(cpus, "cgroup_cpu_quota", lambda: 1.0)
    quota = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU"))
    configured = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU", threads=2))
    try:
        assert int(quota.compiled.get_property("INFERENCE_NUM_THREADS")) == 1
        assert int(configured.compiled.get_property("INFERENCE_NUM_THREADS")) == 2  # the config wins
    finally:
        quota.close()
        configured.close()
