"""OpenVINO's bf16 as a candidate of its own: the FP32 IR computed in bf16 by the CPU plugin.

Where this CPU's OpenVINO reports ``BF16`` (AVX512-BF16, AMX) the search builds it, times it and
gates it like any lossy candidate, and an explicit ``bf16`` bundle is served with the bf16 hint.
Where it does not, the candidate is absent with the reason. A CPU without BF16 is played by
replacing OpenVINO's capability query (``cpu_capabilities``), the boundary both host and agent ask.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import edgekit
from device_agents.runtimes import openvino as ov_runtime
from device_agents.runtimes.openvino import OpenVinoRunner
from device_agents.runtimes.options import OpenVinoOptions
from device_agents.runtimes.runs_on import runs_on
from edgekit.bundle.manifest import Manifest
from edgekit.compress.onnx_prep import prepare_model
from edgekit.errors import ConfigError
from edgekit.optimize.openvino_candidates import BF16_NAME
from edgekit.optimize.run import EngineSettings, optimize
from edgekit.targets.base import BuildContext
from edgekit.targets.cpu import CpuOptions, CpuTarget
from edgekit.targets.intel import IntelOptions, IntelTarget
from tests.factories import sample_inputs, tiny_classifier

CALIB = sample_inputs(60, seed=3) * 3.0  # scaled so that the tiny classifier's classes are well apart
NO_BF16 = ("WINOGRAD", "FP32", "INT8", "BIN", "EXPORT_IMPORT")  # what a CPU without AVX512-BF16/AMX reports

_has_bf16 = "BF16" in ov_runtime.cpu_capabilities()
needs_bf16 = pytest.mark.skipif(not _has_bf16, reason="this CPU's OpenVINO reports no BF16 (no AVX512-BF16 / AMX)")


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_classifier(tmp_path_factory.mktemp("bf16-model") / "tiny.onnx")


@pytest.fixture
def without_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ov_runtime, "cpu_capabilities", lambda core=None: NO_BF16)


def _context(tmp_path: Path, model: Path, precision: str, options: object) -> BuildContext:
    prepared = prepare_model(model, tmp_path / "prepared")
    (tmp_path / "out").mkdir()
    (tmp_path / "work").mkdir()
    return BuildContext(
        model_path=prepared.path, served=prepared.served, precision=precision, calib={"input": CALIB},
        static_shapes={"input": (1, 3, 16, 16)}, out_dir=tmp_path / "out", work_dir=tmp_path / "work",
        options=options, progress=lambda _msg: None, source_path=model,
    )  # fmt: skip


@needs_bf16
def test_intel_auto_times_and_gates_the_bf16_candidate_where_the_cpu_has_bf16(tmp_path: Path, classifier: Path) -> None:
    ctx = _context(tmp_path, classifier, "auto", IntelOptions())
    search = optimize(IntelTarget(), ctx, EngineSettings()).search
    [bf16] = [o for o in search.outcomes if o.name == BF16_NAME]
    assert bf16.precision == "bf16" and bf16.settings["inference_precision"] == "bf16"
    assert bf16.status in ("passed", "chosen", "failed"), bf16.reason  # built, not skipped
    # gated against FP32 like any lossy candidate, and timed side by side with the others
    assert bf16.comparison is not None and bf16.comparison.top1_agreement is not None
    assert bf16.status == "failed" or bf16.comparison.passed
    assert bf16.p50_ms is not None and bf16.p50_ms > 0


def test_intel_auto_leaves_bf16_out_with_the_reason_where_openvino_reports_no_bf16(
    tmp_path: Path, classifier: Path, without_bf16: None
) -> None:
    plan = IntelTarget().candidates(_context(tmp_path, classifier, "auto", IntelOptions()))
    assert BF16_NAME not in [c.name for c in plan.first]
    assert (BF16_NAME, f"this CPU's OpenVINO reports no BF16 (OPTIMIZATION_CAPABILITIES: {', '.join(NO_BF16)})") in (
        plan.skipped
    )


def test_cpu_auto_offers_the_openvino_bf16_candidate_exactly_where_openvino_reports_bf16(
    tmp_path: Path, classifier: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ctx = _context(tmp_path, classifier, "auto", CpuOptions())
    for capabilities in (("FP32", "BF16", "INT8"), NO_BF16):
        monkeypatch.setattr(ov_runtime, "cpu_capabilities", lambda core=None, c=capabilities: c)
        plan = CpuTarget().candidates(ctx)
        offered = [c for c in plan.first if c.name == BF16_NAME]
        skipped = [why for name, why in plan.skipped if name == BF16_NAME]
        if "BF16" in capabilities:
            assert [c.precision for c in offered] == ["bf16"] and not skipped
        else:
            assert not offered and skipped[0].startswith("this CPU's OpenVINO reports no BF16")


def test_intel_explicit_bf16_is_refused_where_the_host_cannot_measure_it(
    tmp_path: Path, classifier: Path, without_bf16: None
) -> None:
    ctx = _context(tmp_path, classifier, "bf16", IntelOptions())
    with pytest.raises(ConfigError, match=r"--precision bf16: this CPU's OpenVINO reports no BF16 .*AMX, or choose"):
        IntelTarget().candidates(ctx)
    gpu = _context(tmp_path / "gpu", classifier, "bf16", IntelOptions(device="GPU"))
    with pytest.raises(ConfigError, match=r"bf16 is a CPU plugin precision \(targets\.intel\.device is GPU\)"):
        IntelTarget().candidates(gpu)


@pytest.fixture(scope="module")
def bf16_bundle(tmp_path_factory: pytest.TempPathFactory, classifier: Path, keypair: tuple[Path, Path]) -> Path:
    if not _has_bf16:
        pytest.skip("this CPU's OpenVINO reports no BF16 (no AVX512-BF16 / AMX)")
    out = tmp_path_factory.mktemp("bf16-bundle")
    result = edgekit.package(
        classifier, targets=["intel"], precision="bf16", calib={"input": CALIB}, key=keypair[0], out_dir=out
    )
    return result.bundles["intel"]


def test_intel_bf16_bundle_is_served_with_the_bf16_hint_close_to_fp32_but_not_identical(
    bf16_bundle: Path, open_bundle: Callable[[Path], tuple[Path, Manifest]], monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir, manifest = open_bundle(bf16_bundle)
    assert manifest.precision.label == "w16abf16" and "INFERENCE_PRECISION_HINT bf16" in manifest.precision.method
    assert manifest.target_options["inference_precision"] == "bf16" and manifest.validation.passed
    x = sample_inputs(16, seed=5) * 3.0
    bf16 = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU"))
    f32 = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU", inference_precision="f32"))
    try:
        assert str(bf16.compiled.get_property("INFERENCE_PRECISION_HINT")) in ("bf16", "<Type: 'bfloat16'>")
        assert bf16.describe()["inference_precision"] == "bf16" and "precision_note" not in bf16.describe()
        got, want = bf16.run({"input": x})["probs"], f32.run({"input": x})["probs"]
    finally:
        bf16.close()
        f32.close()
    np.testing.assert_allclose(got, want, atol=0.05)
    assert np.mean(got.argmax(1) == want.argmax(1)) >= 0.9
    assert not np.array_equal(got, want)  # bf16 arithmetic reached the runtime
    # The same bundle on a CPU without BF16: served in f32, said so, and f32's outputs exactly.
    monkeypatch.setattr(ov_runtime, "cpu_capabilities", lambda core=None: NO_BF16)
    fallback = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU"))
    try:
        assert "this CPU's OpenVINO reports no BF16" in fallback.describe()["precision_note"]
        np.testing.assert_array_equal(fallback.run({"input": x})["probs"], want)
    finally:
        fallback.close()


def test_openvino_runner_without_bf16_serves_f32_and_says_so_in_the_log_and_describe(
    tmp_path: Path,
    classifier: Path,
    keypair: tuple[Path, Path],
    open_bundle: Callable[[Path], tuple[Path, Manifest]],
    without_bf16: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A bf16 bundle cannot be built without BF16: the agent's own override asks for bf16 the same way.
    result = edgekit.package(
        classifier, targets=["intel"], precision="fp32", calib={"input": CALIB}, key=keypair[0], out_dir=tmp_path
    )
    model_dir, manifest = open_bundle(result.bundles["intel"])
    with caplog.at_level(logging.WARNING, logger="edgekit.agent"):
        runner = OpenVinoRunner(model_dir, manifest, OpenVinoOptions(device="CPU", inference_precision="bf16"))
    try:
        assert str(runner.compiled.get_property("INFERENCE_PRECISION_HINT")) in ("f32", "<Type: 'float32'>")
        described = runner.describe()
        note = "bf16 asked, computing in f32 (this CPU's OpenVINO reports no BF16): more accurate, slower than measured"
        assert described["inference_precision"] == "f32" and described["precision_note"] == note
        assert runs_on(described).endswith(f"(execution devices: CPU); {note}")
        assert f"{manifest.name}: {note}" in caplog.text
    finally:
        runner.close()
