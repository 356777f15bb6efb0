"""Publish -> the agent downloads, verifies, self-tests, switches and reports (real processes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.factories import sample_inputs
from tests.updates.bundles import reference_outputs
from tests.updates.conftest import FLEET, AgentFactory, Keys, edgekit
from tests.updates.services import FileServer, Mosquitto, Watcher


def test_publish_updates_a_running_agent_and_fleet_status_shows_it(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    agent = agents(broker.url(), "dev-1").start()
    assert agent.served_version("tiny") == 1
    watcher = Watcher(broker.port, [f"edgekit/{FLEET}/dev-1/reported"])
    try:
        # the real console script, as a user runs it
        out = subprocess.run(
            [
                sys.executable, "-c", "from edgekit.cli import main; raise SystemExit(main())",
                "publish", str(tiny_bundles[2]), "--broker", broker.url(), "--fleet", FLEET, "--device", "dev-1",
                "--base-url", files.base_url, "--copy-to", str(files.dir), "--trusted-key", str(keys.public),
                "--notice-key", str(keys.notice_private),
            ],
            capture_output=True, text=True, check=True, timeout=60,
        ).stdout  # fmt: skip
        assert f"on edgekit/{FLEET}/dev-1/desired" in out
        assert (files.dir / tiny_bundles[2].name).read_bytes() == tiny_bundles[2].read_bytes()

        agent.wait_version("tiny", 2)
        x = sample_inputs(2, seed=7)
        version, y = agent.infer("tiny", x)
        assert version == 2
        np.testing.assert_allclose(y, reference_outputs(tiny_bundles[2].with_suffix(".onnx"), x), rtol=1e-4, atol=1e-5)

        serving = watcher.wait(lambda r: r["state"] == "serving" and r["version"] == 2, 30, "a serving report")
        assert serving["models"] == {"tiny": 2}
        assert serving["desired_version"] == 2 and serving["error"] == ""
        states = [r["state"] for r in watcher.payloads()]
        assert (
            states.index("downloading")
            < states.index("installing")
            < states.index("checking")
            < states.index("serving")
        )
    finally:
        watcher.close()

    table = edgekit("fleet", "status", "--broker", broker.url(), "--fleet", FLEET, "--wait-s", "0.5")
    header, row = table.strip().splitlines()
    assert header.split() == ["DEVICE", "MODEL", "VERSION", "DESIRED", "STATE", "UPDATED", "REASON"]
    assert row.split()[:5] == ["dev-1", "tiny", "2", "2", "serving"]


def test_fleet_status_says_so_when_no_device_reported(broker: Mosquitto) -> None:
    out = edgekit("fleet", "status", "--broker", broker.url(), "--fleet", "empty-fleet", "--wait-s", "0.2")
    assert out.strip() == "no device of fleet empty-fleet has reported yet"
