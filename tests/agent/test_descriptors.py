"""An agent out of file descriptors, on loopback: with its open-file limit a few descriptors above
what it holds and many clients connecting, ``accept()`` fails with EMFILE while connections wait
in the listen queue (the listening socket stays readable). The accept loop must wait between
tries instead of spinning on a core, and serve again once the clients leave."""

from __future__ import annotations

import os
import resource
import socket
import time
import urllib.request
from pathlib import Path

from tests.agent.conftest import AgentFactory, Bundles, agent_cli, write_config

_TICKS_S = os.sysconf("SC_CLK_TCK")
_FLOOD = 150  # connections, far more than the descriptors left to the agent


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process ``pid`` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS_S


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v2/health/ready", timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def test_accept_waits_instead_of_spinning_when_descriptors_run_out_and_serves_again_after(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, agent_factory: AgentFactory
) -> None:
    # connections that are accepted stay open (a byte-less client) for the whole measurement
    config = write_config(tmp_path / "a", keypair[1], "[server]\nidle_timeout_s = 60.0\nheader_timeout_s = 60.0\n")
    done = agent_cli("install", str(bundles.v1), "--config", str(config))
    assert done.returncode == 0, done.stdout + done.stderr
    agent = agent_factory(config)
    pid = agent.proc.pid
    held = len(os.listdir(f"/proc/{pid}/fd"))
    limit = held + 16  # far below max_connections (512): what a small LimitNOFILE leaves
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (limit, limit))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # this process holds the flood's sockets
    if soft < _FLOOD + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, _FLOOD + 1024), hard))

    host, port = agent.address.split(":")
    flood = []
    try:
        for _ in range(_FLOOD):
            flood.append(socket.create_connection((host, int(port)), timeout=10))
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{pid}/fd")) < limit and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(os.listdir(f"/proc/{pid}/fd")) == limit
        # out of descriptors with connections queued: CPU time over 3 s of waiting (a spinning
        # accept loop takes close to a core: ~3 CPU seconds, or its share of a busy machine)
        before = _cpu_s(pid)
        time.sleep(3.0)
        used_s = _cpu_s(pid) - before
        print(f"agent CPU while out of descriptors: {used_s:.2f} s in 3 s")
        assert used_s < 0.5, f"the agent used {used_s:.2f} CPU s in 3 s while out of descriptors"
        assert "cannot accept connections: Too many open files" in agent.log.read_text(), agent.log.read_text()
    finally:
        for sock in flood:
            sock.close()
    deadline = time.monotonic() + 30
    while not _ready(agent.url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _ready(agent.url)
    with urllib.request.urlopen(agent.url + "/metrics", timeout=10) as resp:
        metrics = resp.read().decode()
    assert any(
        line.startswith('edgekit_rejects_total{model="",reason="descriptors"}') and float(line.split()[-1]) >= 1
        for line in metrics.splitlines()
    ), metrics
    assert agent.stop() == 0


def test_run_warns_when_the_open_file_limit_is_below_max_connections() -> None:
    import subprocess
    import sys

    code = (
        "import resource\n"
        "from device_agents.cli import raise_nofile_limit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
        "raise_nofile_limit(512)\n"
        "raise_nofile_limit(128)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stderr.count("the open-file limit (256) is below server.max_connections") == 1, done.stderr
    assert "(512) + 64" in done.stderr and "raise LimitNOFILE / ulimit -n" in done.stderr
