"""Tail servers: ``edgekit serve-tail`` (the agent's own v2 front-end) and the Triton / KServe
exports, each answered by a real v2 client (tritonclient) against ONNX Runtime's own outputs."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.cli import main
from edgekit.split import graph
from tests.split.models import inputs, shrinking_convnet
from tests.split.servers import kserve_tail, serve_tail


@pytest.fixture()
def tail_and_mid(tmp_path: Path) -> tuple[Path, np.ndarray, np.ndarray]:
    """The tail after conv2 (input r2), a head output for it, and the full model's answer."""
    import onnxruntime as ort

    model_path = shrinking_convnet(tmp_path / "m.onnx")
    model = graph.load_model(model_path)
    cut = next(c for c in graph.enumerate_cuts(model) if c.tensors == ("r2",))
    head, tail = graph.extract(model, cut)
    tail_path = graph.save(tail, tmp_path / "tails" / "cut4.onnx")
    x = inputs(2)
    mid = ort.InferenceSession(head.SerializeToString()).run(None, {"x": x})[0]
    want = ort.InferenceSession(str(model_path)).run(None, {"x": x})[0]
    return tail_path, mid, want


def _v2_infer(url: str, model: str, mid: np.ndarray) -> np.ndarray:
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(url.removeprefix("http://"))
    try:
        inp = httpclient.InferInput("r2", list(mid.shape), "FP32")
        inp.set_data_from_numpy(mid, binary_data=True)
        result = client.infer(model, [inp], outputs=[httpclient.InferRequestedOutput("probs", binary_data=True)])
        out = result.as_numpy("probs")
        assert out is not None
        return np.asarray(out)
    finally:
        client.close()


def test_serve_tail_answers_v2_requests_with_the_full_models_outputs(
    tail_and_mid: tuple[Path, np.ndarray, np.ndarray],
) -> None:
    tail_path, mid, want = tail_and_mid
    with serve_tail([tail_path], name_prefix="m-tail") as (url, _):
        np.testing.assert_allclose(_v2_infer(url, "m-tail-cut4", mid), want, rtol=1e-5, atol=1e-6)


def test_serve_tail_refuses_a_bundle_without_a_trusted_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "t.ekb").write_bytes(b"")
    assert main(["serve-tail", str(tmp_path / "t.ekb")]) == 2
    assert "--trust" in capsys.readouterr().err


def test_export_triton_repo_writes_config_with_the_batch_axis(
    tail_and_mid: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    tail_path, _, _ = tail_and_mid
    repo = tmp_path / "repo"
    assert main(["serve-tail", str(tail_path), "--name-prefix", "m-tail", "--triton-repo", str(repo)]) == 0
    config = (repo / "m-tail-cut4" / "config.pbtxt").read_text()
    assert 'name: "m-tail-cut4"' in config and 'platform: "onnxruntime_onnx"' in config
    assert "max_batch_size: 8" in config
    assert 'name: "r2"\n    data_type: TYPE_FP32\n    dims: [ 8, 12, 12 ]' in config
    assert 'name: "probs"\n    data_type: TYPE_FP32\n    dims: [ 10 ]' in config
    assert (repo / "m-tail-cut4" / "1" / "model.onnx").read_bytes() == tail_path.read_bytes()


def test_kserve_model_server_serves_the_exported_tail(
    tail_and_mid: tuple[Path, np.ndarray, np.ndarray], tmp_path: Path
) -> None:
    tail_path, mid, want = tail_and_mid
    root = tmp_path / "kserve"
    assert main(["serve-tail", str(tail_path), "--name-prefix", "m-tail", "--kserve", str(root)]) == 0
    with kserve_tail(root) as (url, _):
        np.testing.assert_allclose(_v2_infer(url, "m-tail-cut4", mid), want, rtol=1e-5, atol=1e-6)
