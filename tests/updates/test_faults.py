"""SIGKILL the agent at each step of an update: after a restart it serves the old or the new
model, never a partial one, and then completes the update."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from device_agents.store import Store
from edgekit.bundle import TrustStore
from edgekit.bundle.manifest import sha256_file
from tests.factories import sample_inputs
from tests.updates.bundles import reference_outputs
from tests.updates.conftest import FLEET, AgentFactory, Keys, publish
from tests.updates.services import FileServer, Mosquitto, Watcher

# Steps before the new version is promoted leave v1 active; from "commit" on, v2 is.
STEPS = {"download": 1, "verify": 1, "stage": 1, "selftest": 1, "switch": 1, "commit": 2, "cleanup": 2}


def _active_is_complete(store_dir: Path, trusted_pub: Path) -> int:
    """The active version of ``tiny``, after checking each of its files against the manifest,
    and every slot the state names (active, previous, candidate) whole and signed: nothing
    partial is named."""
    store = Store(store_dir)
    ms = store.model_state("tiny")
    assert ms.active is not None
    manifest = store.manifest_of(ms.active)
    for entry in manifest.files:
        path = store.model_dir(ms.active) / entry.path
        assert path.stat().st_size == entry.size_bytes and sha256_file(path) == entry.sha256, entry.path
    trust = TrustStore.from_files([trusted_pub])
    for slot in (ms.active, ms.previous, ms.candidate):
        if slot is not None:
            store.verify_slot(slot, trust)  # raises on a missing, partial or altered file
    return ms.active.version


@pytest.mark.parametrize("step", list(STEPS))
def test_agent_killed_at_update_step_serves_old_or_new_then_completes(
    step: str, broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, padded_v2: Path
) -> None:
    agent = agents(broker.url(), "dev-1").start(fault=step)
    publish(padded_v2, broker.url(), files, keys.public, "--device", "dev-1")
    assert agent.wait_exit(60) == -9, agent.log()[-2000:]

    assert _active_is_complete(agent.spec.store, keys.public) == STEPS[step]

    watcher = Watcher(broker.port, [f"edgekit/{FLEET}/dev-1/reported"])
    try:
        agent.start()
        x = sample_inputs(2, seed=3)
        version, y = agent.infer("tiny", x)  # whichever version serves, it serves whole
        model = padded_v2.with_suffix(".onnx") if version == 2 else None
        if model is not None:
            np.testing.assert_allclose(y, reference_outputs(model, x), rtol=1e-4, atol=1e-5)
        agent.wait_version("tiny", 2)
        watcher.wait(lambda r: r["state"] == "serving" and r["version"] == 2, 30, "the update to complete")
    finally:
        watcher.close()
    assert _active_is_complete(agent.spec.store, keys.public) == 2
    if step == "download":  # the second attempt resumed the partial file instead of starting over
        resumed = [r for r in files.requests() if re.search(r"range=bytes=[1-9]\d*- -> 206", r)]
        assert resumed, files.requests()
    assert not list((agent.spec.store / "downloads").glob("*.part"))


def test_selftest_child_that_crashes_is_rejected_and_the_agent_keeps_serving(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1").start(fault="selftest_child")
    watcher = Watcher(broker.port, [f"edgekit/{FLEET}/dev-1/reported"])
    try:
        notice = publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
        report = watcher.wait(lambda r: r["notice_id"] == notice and r["state"] == "rejected", 30, "a rejection")
    finally:
        watcher.close()
    assert "killed by signal 9" in report["error"]
    assert agent.running and agent.served_version("tiny") == 1
