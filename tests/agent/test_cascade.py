"""Cascades (``[models.<name>.route]``): a small model answers what it is sure of, a larger one the
rest; the answer says which member gave it; members stay addressable. Two real classifiers
installed in a real agent service, checked against ONNX Runtime on each model directly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from device_agents.config import load_config
from device_agents.errors import ModelNotFoundError
from device_agents.pipeline import Request
from device_agents.service import AgentService
from edgekit.bundle.errors import ConfigError
from tests.agent.conftest import write_config
from tests.factories import make_cpu_bundle, tiny_classifier

THRESHOLD = 0.6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, keypair: tuple[Path, Path]) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("cascade")
    out: dict[str, Path] = {}
    for name, seed, output in (("small", 0, "probs"), ("large", 1, "probs"), ("other", 2, "scores")):
        onnx_path = tiny_classifier(root / f"{name}.onnx", classes=4, seed=seed, output_name=output)
        out[name] = onnx_path
        out[f"{name}.ekb"] = make_cpu_bundle(root / f"{name}.ekb", onnx_path, keypair[0], name=name)
    return out


def _service(tmp: Path, pub: Path, models: dict[str, Path], route: str) -> AgentService:
    config = write_config(tmp, pub, route)
    service = AgentService(load_config(config))
    service.start()
    for name in ("small", "large", "other"):
        result = service.install(models[f"{name}.ekb"])
        assert result.changed and result.name == name, result
    return service


def _ask(
    service: AgentService, name: str, x: np.ndarray, timeout_s: float | None = None
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    def decode(model: Any) -> Request:
        return Request(name, {"input": x}, timeout_s=timeout_s)

    def encode(request: Request) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        assert request.outputs is not None
        return dict(request.response_parameters), request.outputs

    return service.infer(name, None, decode, encode)


def test_cascade_escalates_only_the_unsure_answers(
    models: dict[str, Path], keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    import onnxruntime as ort

    route = f'[models.both.route]\nmembers = ["small", "large"]\nthreshold = {THRESHOLD}\n'
    service = _service(tmp_path / "agent", keypair[1], models, route)
    try:
        small = ort.InferenceSession(str(models["small"]))
        large = ort.InferenceSession(str(models["large"]))
        rng = np.random.default_rng(5)
        seen = {"small": 0, "large": 0}
        for _ in range(40):
            x = (rng.standard_normal((1, 3, 16, 16)) * 3).astype(np.float32)
            sure = float(small.run(None, {"input": x})[0].max()) >= THRESHOLD
            params, outputs = _ask(service, "both", x)
            want = (small if sure else large).run(None, {"input": x})[0]
            assert params == {"member": "small" if sure else "large", "escalated": not sure}
            assert np.allclose(outputs["probs"], want, atol=1e-5)
            seen[params["member"]] += 1
        assert seen["small"] and seen["large"], seen  # both paths ran
        # the members answer under their own names as well
        params, outputs = _ask(service, "large", x)
        assert "member" not in params and np.allclose(outputs["probs"], large.run(None, {"input": x})[0], atol=1e-5)
        assert "both" in service.endpoints.names()
        with pytest.raises(ModelNotFoundError, match="cascade: it has no versions"):
            service.infer("both", 1, lambda m: Request("both", {"input": x}), lambda r: r)
    finally:
        service.stop()


def test_cascade_members_must_agree_on_their_signature(
    models: dict[str, Path], keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    route = '[models.mixed.route]\nmembers = ["small", "other"]\nthreshold = 0.5\n'
    service = _service(tmp_path / "agent", keypair[1], models, route)
    try:
        x = np.zeros((1, 3, 16, 16), np.float32)
        with pytest.raises(ConfigError, match=r"member 'other' takes .* answers \['scores'\]"):
            _ask(service, "mixed", x)
    finally:
        service.stop()


def test_cascade_over_http_says_which_member_answered(
    models: dict[str, Path], keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    import json
    import urllib.request

    import onnxruntime as ort

    from tests.agent.conftest import agent_cli, start_agent

    config = write_config(
        tmp_path / "agent", keypair[1], f'[models.both.route]\nmembers = ["small", "large"]\nthreshold = {THRESHOLD}\n'
    )
    for name in ("small", "large"):
        done = agent_cli("install", str(models[f"{name}.ekb"]), "--config", str(config))
        assert done.returncode == 0, done.stderr
    agent = start_agent(config)
    try:
        small = ort.InferenceSession(str(models["small"]))
        rng = np.random.default_rng(11)
        members = set()
        for _ in range(20):
            x = (rng.standard_normal((1, 3, 16, 16)) * 3).astype(np.float32)
            body = {
                "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 3, 16, 16], "data": x.ravel().tolist()}]
            }
            request = urllib.request.Request(
                f"{agent.url}/v2/models/both/infer", json.dumps(body).encode(), {"Content-Type": "application/json"}
            )
            with urllib.request.urlopen(request, timeout=30) as r:
                doc = json.loads(r.read())
            sure = float(small.run(None, {"input": x})[0].max()) >= THRESHOLD
            assert doc["parameters"] == {"member": "small" if sure else "large", "escalated": not sure}
            members.add(doc["parameters"]["member"])
        assert members == {"small", "large"}
    finally:
        agent.stop()


def test_remote_member_answers_and_a_dead_one_leaves_the_local_answer(
    models: dict[str, Path], keypair: tuple[Path, Path], tmp_path: Path
) -> None:
    import onnxruntime as ort

    from tests.agent.conftest import agent_cli, start_agent

    remote_config = write_config(tmp_path / "remote", keypair[1])
    done = agent_cli("install", str(models["large.ekb"]), "--config", str(remote_config))
    assert done.returncode == 0, done.stderr
    remote = start_agent(remote_config)
    route = (
        f'[models.both.route]\nmembers = ["small", "large"]\nthreshold = {THRESHOLD}\n'
        f'url = "{remote.url}"\ntimeout_ms = 5000\n'
    )
    config = write_config(tmp_path / "local", keypair[1], route)
    service = AgentService(load_config(config))
    service.start()
    try:
        service.install(models["small.ekb"])  # "large" is not installed here: the remote agent serves it
        small = ort.InferenceSession(str(models["small"]))
        large = ort.InferenceSession(str(models["large"]))
        rng = np.random.default_rng(5)
        unsure = []
        for _ in range(30):
            x = (rng.standard_normal((1, 3, 16, 16)) * 3).astype(np.float32)
            sure = float(small.run(None, {"input": x})[0].max()) >= THRESHOLD
            params, outputs = _ask(service, "both", x)
            assert params == {"member": "small" if sure else "large", "escalated": not sure}
            assert np.allclose(outputs["probs"], (small if sure else large).run(None, {"input": x})[0], atol=1e-5)
            if not sure:
                unsure.append(x)
        assert unsure
        # a request whose deadline is shorter than the remote member is given is not escalated
        params, _ = _ask(service, "both", unsure[0], timeout_s=1.0)
        assert params == {"member": "small", "escalated": False, "escalation": "skipped: deadline"}
        remote.stop()  # the remote server is gone: the small model's answer stands
        params, outputs = _ask(service, "both", unsure[0])
        assert params == {"member": "small", "escalated": False}
        assert np.allclose(outputs["probs"], small.run(None, {"input": unsure[0]})[0], atol=1e-5)
    finally:
        service.stop()
        remote.stop()


def test_remote_member_wire_round_trips_bytes_and_tensors_through_the_agents_codec() -> None:
    from device_agents.pipeline.remote import _datatype, _decode_answer, _wire
    from device_agents.processing.signature import WireTensor
    from device_agents.serving.codec import decode_request, encode_response
    from edgekit.bundle.manifest import TensorSpec

    image = np.empty(1, dtype=object)
    image[0] = b"\xff\xd8 an encoded image \x00\x01"
    pixels = np.arange(12, dtype=np.float32).reshape(1, 3, 2, 2)
    blobs = [_wire(image), _wire(pixels)]
    sizes = [{"binary_data_size": len(b)} for b in blobs]
    inputs = [
        {"name": "images", "datatype": _datatype(image), "shape": [1], "parameters": sizes[0]},
        {"name": "aux", "datatype": _datatype(pixels), "shape": [1, 3, 2, 2], "parameters": sizes[1]},
    ]
    header = json.dumps({"inputs": inputs}).encode()
    specs: list[WireTensor | TensorSpec] = [
        WireTensor("images", "BYTES", (1,)),
        TensorSpec("aux", "float32", (1, 3, 2, 2)),
    ]
    outs = [WireTensor("labels", "BYTES", (-1,)), WireTensor("scores", "FP32", (-1,))]
    wire = decode_request(header + b"".join(blobs), len(header), specs, outs)
    assert wire.raw["images"][0] == image[0] and np.array_equal(wire.inputs["aux"], pixels)
    answer = {"labels": np.array([b"cat", b"dog"], dtype=object), "scores": np.array([0.9, 0.5], np.float32)}
    for binary in (True, False):
        wire.binary_output = binary
        body, length = encode_response("m", 3, wire, answer, outs)
        doc, got = _decode_answer(body, length)
        assert doc["model_version"] == "3" and got["labels"].tolist() == [b"cat", b"dog"]
        assert np.allclose(got["scores"], [0.9, 0.5])
