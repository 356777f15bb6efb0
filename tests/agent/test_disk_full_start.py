"""A full disk at start: the agent serves the active version (a version still in its health
window, whose start the agent must count) instead of exiting on its first bookkeeping write."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from tests.agent.conftest import Bundles, agent_cli, write_config
from tests.updates.tmpfs import fill, small_tmpfs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _served(url: str) -> list[str] | None:
    try:
        with urllib.request.urlopen(f"{url}/v2/models/tiny", timeout=2) as r:
            return list(json.loads(r.read())["versions"])
    except (OSError, ValueError, KeyError):
        return None


def test_a_full_disk_at_start_serves_the_active_version(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles
) -> None:
    with small_tmpfs(tmp_path / "disk", "8m") as disk:
        port = _free_port()
        config = write_config(disk / "agent", keypair[1], listen=f"127.0.0.1:{port}")
        for b in (bundles.v1, bundles.v2):
            done = agent_cli("install", str(b), "--config", str(config))
            assert done.returncode == 0, done.stderr
        fill(disk)
        log = tmp_path / "agent.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "device_agents.cli", "run", "--config", str(config)],
                stdout=out,
                stderr=out,
                env=dict(os.environ),
            )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 60
            while _served(url) is None and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            assert proc.poll() is None, log.read_text()
            assert _served(url) == ["2"], log.read_text()
            text = log.read_text()
            assert "could not record the state" in text and "no space left" in text
        finally:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(timeout=30)
        assert code == 0, log.read_text()
