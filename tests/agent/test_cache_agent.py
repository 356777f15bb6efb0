"""The result cache as a user meets it: a real ``edgekit-agent run`` with
``[models.tiny.cache] mode = "exact"``, driven by tritonclient unchanged and by plain JSON.
A repeated request is a hit (the v2 response parameter ``cache`` and the ``X-Edgekit-Cache``
header say so), a JSON request of the same tensor shares the entry, bypass skips it, /metrics
counts it, and the hit is still a hit after the agent restarts."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.http as triton

from tests.agent.conftest import AgentFactory, Bundles, agent_cli, write_config
from tests.factories import sample_inputs

CACHED = '[models.tiny.cache]\nmode = "exact"\n'


def _infer(client: triton.InferenceServerClient, x: np.ndarray, **kw: Any) -> tuple[str, np.ndarray]:
    inp = triton.InferInput("input", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer("tiny", [inp], **kw)
    return str(result.get_response()["parameters"]["cache"]), np.asarray(result.as_numpy("probs"))


def _infer_json(url: str, x: np.ndarray) -> tuple[str | None, dict[str, Any]]:
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    request = urllib.request.Request(
        f"{url}/v2/models/tiny/infer", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=30) as resp:
        return resp.headers.get("X-Edgekit-Cache"), json.loads(resp.read())


def _metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
        return str(resp.read().decode())


def test_cache_agent_repeated_request_is_a_hit_shared_with_json_and_survives_a_restart(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    config = write_config(tmp_path / "agent", keypair[1], CACHED)
    done = agent_cli("install", str(bundles.v1), "--config", str(config))
    assert done.returncode == 0, done.stderr
    agent = agent_factory(config)
    x = sample_inputs(1, seed=60)
    client = triton.InferenceServerClient(agent.address)
    try:
        state, first = _infer(client, x)
        assert state == "miss"
        state, again = _infer(client, x)
        assert state == "hit"
        np.testing.assert_array_equal(again, first)
        header, doc = _infer_json(agent.url, x)  # the same tensor as JSON: the same entry
        assert header == "hit" and doc["parameters"]["cache"] == "hit"
        np.testing.assert_allclose(np.array(doc["outputs"][0]["data"], np.float32).reshape(first.shape), first)
        state, _ = _infer(client, x, parameters={"cache": "bypass"})
        assert state == "bypass"
        state, _ = _infer(client, sample_inputs(1, seed=61))
        assert state == "miss"
        text = _metrics(agent.url)
        assert 'edgekit_cache_lookups_total{model="tiny",result="hit"} 2.0' in text
        assert 'edgekit_cache_lookups_total{model="tiny",result="miss"} 2.0' in text
        assert 'edgekit_cache_lookups_total{model="tiny",result="bypass"} 1.0' in text
    finally:
        client.close()
    assert agent.stop() == 0
    restarted = agent_factory(config)
    client = triton.InferenceServerClient(restarted.address)
    try:
        state, after = _infer(client, x)
        assert state == "hit"  # from the disk tier: it had repeated before the restart
        np.testing.assert_array_equal(after, first)
        header, _ = _infer_json(restarted.url, sample_inputs(1, seed=61))  # asked once before: not kept on disk
        assert header == "miss"
    finally:
        client.close()
