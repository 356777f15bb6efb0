"""SIGKILL the broker (persistence on): the agent reconnects, keeps its session, and applies each
update exactly once although the retained notice is delivered again."""

from __future__ import annotations

import re
import time
from pathlib import Path

from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.fleet.session import FleetSession
from tests.updates.conftest import FLEET, AgentFactory, Keys, publish
from tests.updates.services import FileServer, Mosquitto, wait_for


def test_agent_reconnects_after_broker_sigkill_and_applies_each_update_once(
    broker: Mosquitto, files: FileServer, agents: AgentFactory, keys: Keys, tiny_bundles: dict[int, Path]
) -> None:
    desired = f"edgekit/{FLEET}/dev-1/desired"
    agent = agents(broker.url(), "dev-1").start()
    first = publish(tiny_bundles[2], broker.url(), files, keys.public, "--device", "dev-1")
    agent.wait_version("tiny", 2)

    # The test broker autosaves every second: wait for a save made after the notice and the session
    # existed (a fixed sleep is too short on a busy machine).
    saved_after = time.time_ns()
    database = broker.dir / "mosquitto.db"
    wait_for(lambda: database.exists() and database.stat().st_mtime_ns > saved_after, 30, "the broker to autosave")
    broker.kill()
    assert agent.served_version("tiny") == 2  # offline, the agent keeps serving
    broker.start()  # same port, same persistence file

    with FleetSession(BrokerAddress(False, "127.0.0.1", broker.port)) as session:
        retained = session.collect_retained(desired, 0.3)
    assert first in retained[desired].decode()  # the retained notice survived the SIGKILL

    connects = wait_for(
        lambda: [ln for ln in agent.log().splitlines() if "updates: connected to" in ln][1:], 30, "a reconnect"
    )
    assert "session present: True" in connects[0]  # the persistent session survived too
    # the retained state comes again on the new connection: it is the one held, so nothing happens
    wait_for(lambda: len(re.findall(rf"desired state on {desired} issued", agent.log())) >= 2, 20, "the replay")

    publish(tiny_bundles[3], broker.url(), files, keys.public, "--device", "dev-1")
    agent.wait_version("tiny", 3)
    assert agent.metric("edgekit_installs_total", model="tiny", result="installed") == 2
    assert agent.metric("edgekit_installs_total", model="tiny", result="unchanged") == 0
    downloads = [r for r in files.requests() if r.startswith(f"GET /{tiny_bundles[2].name} ")]
    assert len(downloads) == 1, files.requests()
