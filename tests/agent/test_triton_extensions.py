"""The Triton / KServe extensions that tools built on tritonclient call (perf_analyzer and the like):
model configuration, statistics, the repository index, load and unload; against a real agent."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from tests.agent.conftest import AgentFactory, Bundles, agent_cli
from tests.agent.test_cli import _infer_ok

JSON = {"Content-Type": "application/json"}


@pytest.fixture()
def client(config_path: Path, bundles: Bundles, agent_factory: AgentFactory):
    assert agent_cli("install", str(bundles.v1), "--config", str(config_path)).returncode == 0
    agent = agent_factory(config_path)
    c = triton.InferenceServerClient(agent.address)
    c.agent = agent  # type: ignore[attr-defined]  # the test's handle on the process
    yield c
    c.close()


def test_model_config_names_the_served_tensors(client) -> None:
    config = client.get_model_config("tiny")
    assert config["name"] == "tiny" and config["platform"] == "onnxruntime" and config["max_batch_size"] == 0
    assert config["input"] == [{"name": "input", "data_type": "TYPE_FP32", "dims": [-1, 3, 16, 16]}]
    assert config["output"] == [{"name": "probs", "data_type": "TYPE_FP32", "dims": [-1, 10]}]
    assert config["version_policy"] == {"specific": {"versions": ["1"]}}
    with pytest.raises(InferenceServerException, match="no model named 'nope'"):
        client.get_model_config("nope")


def test_inference_statistics_count_the_requests_served(client) -> None:
    for _ in range(3):
        _infer_ok(client.agent)
    (stats,) = client.get_inference_statistics("tiny")["model_stats"]
    assert (stats["name"], stats["version"]) == ("tiny", "1")
    assert stats["inference_stats"]["success"]["count"] == 3 and stats["inference_stats"]["success"]["ns"] > 0
    assert stats["inference_stats"]["compute_infer"]["count"] == 3 and stats["inference_stats"]["fail"]["count"] == 0
    assert [s["name"] for s in client.get_inference_statistics()["model_stats"]] == ["tiny"]
    with pytest.raises(InferenceServerException, match="no model named 'nope' is installed here"):
        client.get_inference_statistics("nope")


def test_repository_index_load_and_unload(client) -> None:
    assert client.get_model_repository_index() == [{"name": "tiny", "version": "1", "state": "READY", "reason": ""}]
    with pytest.raises(InferenceServerException, match="takes Content-Type: application/json"):
        client.unload_model("tiny")  # the install route's rules: a web page's simple POST cannot unload
    assert _infer_ok(client.agent)["model_version"] == "1"
    client.unload_model("tiny", headers=JSON)
    assert not client.is_model_ready("tiny")
    assert client.get_model_repository_index() == [
        {"name": "tiny", "version": "1", "state": "UNAVAILABLE", "reason": "unloaded"}
    ]
    ready_only = urllib.request.Request(f"{client.agent.url}/v2/repository/index", data=b'{"ready": true}')
    with urllib.request.urlopen(ready_only, timeout=10) as answer:
        assert json.loads(answer.read()) == []
    with pytest.raises(InferenceServerException, match="no model named 'tiny' is served here"):
        _infer_ok(client.agent)  # not loaded again on demand
    client.load_model("tiny", headers=JSON)
    assert client.is_model_ready("tiny") and _infer_ok(client.agent)["model_version"] == "1"
    with pytest.raises(InferenceServerException, match="no model named 'nope' is installed"):
        client.load_model("nope", headers=JSON)
