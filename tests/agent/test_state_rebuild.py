"""``state.json`` and its backup both unreadable: a real agent rebuilds the state from the verified
slots on disk (newest verified version per model; a slot changed at rest is left out) and serves,
instead of exiting at every start."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import tritonclient.http as triton

from device_agents.config import load_config
from device_agents.lifecycle import Lifecycle
from device_agents.store import Store
from tests.agent.conftest import AgentFactory, Bundles, RunningAgent, agent_cli, write_config


def _infer(agent: RunningAgent, name: str, x: np.ndarray, input_name: str = "input") -> tuple[str, np.ndarray]:
    client = triton.InferenceServerClient(agent.address)
    inp = triton.InferInput(input_name, list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    result = client.infer(name, [inp])
    response = result.get_response()
    return str(response["model_version"]), result.as_numpy(response["outputs"][0]["name"])


def test_agent_rebuilds_unreadable_state_from_the_verified_slots(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    config = write_config(tmp_path / "agent", keypair[1])
    seed = Lifecycle(load_config(config))
    seed.start()
    try:
        for b in (bundles.v1, bundles.v2, bundles.v4, bundles.reshape):
            seed.install(b)
    finally:
        seed.stop()
    store = Store(config.parent / "store")
    before = store.load_state().models
    v4, v2 = before["tiny"].active, before["tiny"].previous
    assert v4 is not None and v2 is not None and (v4.version, v2.version) == (4, 2)
    model = store.model_dir(v4) / "model.onnx"  # v4 changed at rest: it must not come back
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x10
    model.write_bytes(bytes(data))
    store.state_path.write_bytes(b'{"schema_version": 2, "models": {"tiny": ')  # torn write
    store.backup_path.write_bytes(b"\0" * 512)  # zeroed by a lying disk

    agent = agent_factory(config)  # before: "both unreadable", exit 1 at every start
    x = np.ones((1, 3, 16, 16), np.float32)
    version, probs = _infer(agent, "tiny", x)
    assert version == "2" and probs.shape == (1, 10)  # the newest version that verifies
    assert _infer(agent, "reshape", np.ones((1, 4), np.float32), "x")[0] == "1"
    log = agent.log.read_text()
    assert f"state rebuilt: {v4.path}: left out, it does not verify" in log and "sha256 does not match" in log
    assert "state rebuilt: tiny: state rebuilt from the verified slots on disk: v2 active, v1 previous; the " in log
    assert "anti-rollback counter restarts at v4, the highest version signed for it on disk" in log
    assert "state rebuilt from the verified slots on disk: 2 model(s) (reshape v1, tiny v2)" in log
    rebuilt = store.load_state().models  # written down: the next start reads it
    tiny = rebuilt["tiny"]
    assert tiny.active is not None and tiny.previous is not None
    assert (tiny.active.path, tiny.active.sha256) == (v2.path, v2.sha256)  # the full hash, from the kept bundle
    # v4's files changed, its signed manifest did not: the counter does not fall back below it
    assert (tiny.previous.version, tiny.max_version, tiny.status) == (1, 4, "rebuilt")
    assert rebuilt["reshape"].active is not None and rebuilt["reshape"].active.version == 1
    kept = json.loads((store.root / "state.json.unreadable").read_bytes() + b'"x"}}')  # set aside, as it was
    assert kept["models"]["tiny"] == "x"
    assert (store.root / "state.json.bak.unreadable").read_bytes() == b"\0" * 512

    done = agent_cli("install", str(bundles.v4), "--config", str(config))  # a good copy of the counter's version
    assert done.returncode == 0 and "installed tiny v4 (was v2)" in done.stdout, done.stderr
    assert _infer(agent, "tiny", x)[0] == "4"
    assert agent.stop() == 0
