"""A bundle key revoked over MQTT (a keys document signed by root), against a real agent, broker
and CLI: the models it signed stop serving as the document is accepted (their requests refused,
saying why), and roll back to a previous version signed by a key still trusted where there is one;
not at the next verification at rest."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np

from device_agents.config import config_from_data
from device_agents.lifecycle import Lifecycle
from edgekit.bundle import key_id, load_public_key
from tests.updates.bundles import bundle
from tests.updates.conftest import FLEET, AgentFactory, Keys, edgekit
from tests.updates.services import Agent, AgentSpec, Mosquitto, Watcher, wait_for

_ACCEPTED = "keys document v1 accepted"


def _post_infer(agent: Agent, name: str) -> tuple[int, dict[str, object]]:
    """(HTTP status, JSON body) of a v2 JSON request on ``name``."""
    x = np.ones((1, 3, 16, 16), np.float32)
    body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
    headers = {"Content-Type": "application/json"}
    req = urllib.request.Request(f"{agent.url}/v2/models/{name}/infer", data=json.dumps(body).encode(), headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _revoke(broker: Mosquitto, keys: Keys, public: Path) -> str:
    kid = key_id(load_public_key(public))
    edgekit("fleet", "keys", "--broker", broker.url(), "--fleet", FLEET, "--root-key", str(keys.root_private),
            "--revoke", kid)  # fmt: skip
    return kid


def test_a_revoked_bundle_key_stops_its_models_serving_when_accepted(
    broker: Mosquitto, agents: AgentFactory, keys: Keys
) -> None:
    agent = agents(broker.url(), "dev-1", seed=2, extra_updates={"root_keys": [str(keys.root_public)]}).start()
    wait_for(lambda: "updates: connected to" in agent.log(), 30, "the agent to connect")
    assert _post_infer(agent, "tiny")[0] == 200  # v2 serves (v1 is kept: both signed by the same key)
    watcher = Watcher(broker.port, [f"edgekit/{FLEET}/dev-1/reported"])
    kid = _revoke(broker, keys, keys.public)
    wait_for(lambda: _ACCEPTED in agent.log(), 30, "the keys document")
    status, body = _post_infer(agent, "tiny")  # at once: no integrity pass has run (verify_interval_s is 1 h)
    assert status == 404, body
    error = str(body["error"])
    assert "model 'tiny' is not served: v2 is signed by a key no longer trusted" in error, error
    assert f"{kid} is revoked" in error or "revoked key" in error, error
    assert error.endswith("install a version signed by a trusted key"), error
    store_state = json.loads((agent.spec.store / "state.json").read_text())
    wait_for(
        lambda: json.loads((agent.spec.store / "state.json").read_text())["models"]["tiny"]["status"] == "failed",
        30,
        "the refusal to be recorded",
    )
    assert store_state["models"]["tiny"]["active"]["version"] == 2  # still installed: a good version replaces it
    assert _post_infer(agent, "tiny")[0] == 404
    try:  # the fleet is told: tiny's bundle is refused now, and it no longer serves
        report = watcher.wait(lambda r: r["state"] == "rejected" and r["name"] == "tiny", 30, "the report")
    finally:
        watcher.close()
    assert report["error"].startswith("keys document v1: v2 is signed by a key no longer trusted"), report
    assert "tiny" not in report["models"], report
    assert agent.running


def test_a_revoked_bundle_key_rolls_back_to_a_version_a_trusted_key_signed(
    tmp_path: Path, broker: Mosquitto, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    store = tmp_path / "store"
    trusted = (keys.public, keys.other_public)
    seed = Lifecycle(config_from_data({"store": str(store), "trusted_keys": [str(k) for k in trusted]}, base=store))
    try:
        seed.install(bundle(tmp_path / "tiny-v1-other.ekb", keys.other_private, 1))  # the other key signs v1
        seed.install(tiny_bundles[2])
    finally:
        seed.stop()
    roots = {"root_keys": [str(keys.root_public)]}
    spec = AgentSpec(store=store, trusted_keys=trusted, broker=broker.url(), fleet=FLEET, device_id="dev-1",
                     notice_keys=(keys.notice_public,), extra_updates=roots)  # fmt: skip
    agent = Agent(spec, tmp_path / "agent")
    try:
        agent.start()
        wait_for(lambda: "updates: connected to" in agent.log(), 30, "the agent to connect")
        assert agent.served_version("tiny") == 2
        _revoke(broker, keys, keys.public)
        wait_for(lambda: _ACCEPTED in agent.log(), 30, "the keys document")
        status, body = _post_infer(agent, "tiny")  # refused, or already answered by v1: never by v2
        assert (status == 404 and "signed by a key no longer trusted" in str(body["error"])) or (
            status == 200 and body["model_version"] == "1"
        ), body
        agent.wait_version("tiny", 1, timeout_s=30)
        assert _post_infer(agent, "tiny")[1]["model_version"] == "1"
        state = json.loads((store / "state.json").read_text())["models"]["tiny"]
        assert state["status"] == "rolled_back" and state["active"]["version"] == 1
        assert "v2 is signed by a key no longer trusted" in state["error"] and "rolled back to v1" in state["error"]
    finally:
        agent.kill()
