"""No process a self-test child starts outlives it, against a real agent: a helper that
double-forks a sleeper into a session of its own (out of the child's process group and parent
chain) is killed with the child, in a cgroup of its own and with the subreaper fallback."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from device_agents.containment import CGROUP_PREFIX, Cgroup
from tests.agent.conftest import AgentFactory, Bundles, agent_cli, write_config


def _alive(pid: int) -> bool:
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def _cgroups_here() -> bool:
    cgroup, _ = Cgroup.create()
    if cgroup is None:
        return False
    cgroup.remove()
    return True


@pytest.mark.parametrize("containment", ["cgroup", "subreaper"])
def test_selftest_child_leaves_no_double_forked_helper_behind(
    containment: str, tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    if containment == "cgroup" and not _cgroups_here():
        pytest.skip("no writable cgroup v2 hierarchy here (needs root or a delegated subtree)")
    config = write_config(tmp_path / "agent", keypair[1], f'[selftest]\ncontainment = "{containment}"\n')
    helpers = tmp_path / "helpers.txt"
    env = {"EDGEKIT_FAULT": "selftest_double_fork", "EDGEKIT_FAULT_PID_FILE": str(helpers)}
    agent = agent_factory(config, env=env)
    pids: list[int] = []
    try:
        done = agent_cli("install", str(bundles.v1), "--config", str(config))  # the daemon's self-test child
        assert done.returncode == 0, done.stderr
        pids = [int(p) for p in helpers.read_text().split()]
        assert len(pids) == 1  # the helper was started (and the self-test passed with it)
        assert not _alive(pids[0]), f"the double-forked helper {pids[0]} outlived the self-test"
        log = agent.log.read_text()
        if containment == "cgroup":
            assert "self-test containment: each child runs in a cgroup of its own" in log, log
            cgroup, _ = Cgroup.create()  # beside the agent's: what the agent's children left there
            assert cgroup is not None
            cgroup.remove()
            assert not list(cgroup.path.parent.glob(f"{CGROUP_PREFIX}{agent.proc.pid}-*"))  # removed after it
        else:
            assert "self-test containment: the child is a subreaper of its helpers" in log, log
        assert agent.stop() == 0
    finally:
        for pid in pids:  # an escaped helper must not outlive the test either
            if _alive(pid):
                psutil.Process(pid).kill()


def test_cgroup_create_removes_only_the_empty_cgroups_of_agents_gone() -> None:
    import subprocess
    import sys

    if not _cgroups_here():
        pytest.skip("no writable cgroup v2 hierarchy here (needs root or a delegated subtree)")
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # an agent killed before it removed its cgroup
    mine, _ = Cgroup.create()
    assert mine is not None
    base = mine.path.parent
    stale = base / f"{CGROUP_PREFIX}{gone.pid}-deadbeef"
    stale.mkdir()
    live = base / f"{CGROUP_PREFIX}{mine.path.name.split('-')[2]}-0000feed"  # this process's: just made
    live.mkdir()
    try:
        again, _ = Cgroup.create()
        assert again is not None
        again.remove()
        assert not stale.exists() and live.exists() and mine.path.exists()
    finally:
        for path in (stale, live):
            if path.exists():
                path.rmdir()
        mine.remove()


def test_auto_containment_falls_back_to_a_subreaper_where_no_cgroup_can_be_made(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    import os
    import shutil

    from device_agents.containment import cgroup2_mount
    from tests.agent.conftest import start_agent

    mount = cgroup2_mount()
    if os.geteuid() != 0 or shutil.which("unshare") is None or mount is None or not _cgroups_here():
        pytest.skip("needs root, unshare(1) and a writable cgroup v2 hierarchy to take away")
    # the agent in a mount namespace of its own where cgroupfs is read-only (as under the systemd unit)
    readonly = ("unshare", "--mount", "--propagation", "private", "sh", "-c",
                f'mount -o remount,bind,ro {mount} && exec "$@"', "sh")  # fmt: skip
    config = write_config(tmp_path / "agent", keypair[1])  # containment = "auto", the default
    helpers = tmp_path / "helpers.txt"
    env = {"EDGEKIT_FAULT": "selftest_double_fork", "EDGEKIT_FAULT_PID_FILE": str(helpers)}
    agent = start_agent(config, env, prefix=readonly)
    pids: list[int] = []
    try:
        done = agent_cli("install", str(bundles.v1), "--config", str(config))
        assert done.returncode == 0, done.stderr
        pids = [int(p) for p in helpers.read_text().split()]
        assert len(pids) == 1 and not _alive(pids[0]), f"the double-forked helper {pids} outlived the self-test"
        log = agent.log.read_text()
        assert "self-test containment: no cgroup of its own (cannot make a cgroup under" in log, log
        assert "(Read-only file system)): the child is a subreaper of its helpers" in log, log
        assert agent.stop() == 0
    finally:
        if agent.proc.poll() is None:
            agent.proc.kill()
            agent.proc.wait()
        for pid in pids:
            if _alive(pid):
                psutil.Process(pid).kill()
