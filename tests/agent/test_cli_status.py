"""`edgekit-agent status` says whether the daemon runs, and since when it is stopped."""

from __future__ import annotations

import re
import signal
from pathlib import Path

from tests.agent.conftest import AgentFactory, Bundles, agent_cli


def test_status_of_a_stopped_agent_says_since_when_and_nothing_serves(
    config_path: Path, bundles: Bundles, agent_factory: AgentFactory
) -> None:
    assert agent_cli("install", str(bundles.v1), "--config", str(config_path)).returncode == 0
    store = config_path.parent / "store"
    agent = agent_factory(config_path)
    lines = agent_cli("status", "--config", str(config_path)).stdout.splitlines()
    assert lines[0] == f"agent: running (pid {agent.proc.pid}, {agent.url}); store {store}"
    assert lines[2].split()[4] == "serving"
    assert agent.stop() == 0
    lines = agent_cli("status", "--config", str(config_path)).stdout.splitlines()
    assert re.fullmatch(
        rf"agent: stopped since \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC \(pid {agent.proc.pid}\); store {store}", lines[0]
    ), lines[0]
    assert lines[2].split()[4] == "installed"  # not "serving": nothing serves it now


def test_status_of_a_killed_agent_says_it_did_not_stop_cleanly(
    config_path: Path, bundles: Bundles, agent_factory: AgentFactory
) -> None:
    agent = agent_factory(config_path)
    agent.proc.send_signal(signal.SIGKILL)
    agent.proc.wait(timeout=30)
    line = agent_cli("status", "--config", str(config_path)).stdout.splitlines()[0]
    assert re.fullmatch(
        rf"agent: stopped \(pid {agent.proc.pid}, started \S+ \S+ UTC, exited without stopping cleanly\); "
        rf"store {config_path.parent / 'store'}",
        line,
    ), line
