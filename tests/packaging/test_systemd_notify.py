"""sd_notify over a real datagram socket: READY=1 once serving, WATCHDOG=1 only while the API answers."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from pathlib import Path

from device_agents.platforms.systemd import SystemdNotifier, http_alive
from tests.agent.conftest import Bundles, agent_cli, write_config
from tests.packaging.notify import NotifyListener


def test_notifier_ready_sends_ready_status_and_pid(notify_listener: NotifyListener) -> None:
    SystemdNotifier(str(notify_listener.path)).ready("serving tiny v1")
    msg = notify_listener.wait_for("READY", "1", timeout_s=5)
    assert msg == {"READY": "1", "STATUS": "serving tiny v1", "MAINPID": str(os.getpid())}


def test_notifier_reaches_an_abstract_socket() -> None:
    name = f"edgekit-test-{uuid.uuid4().hex}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        assert SystemdNotifier("@" + name).notify("STOPPING=1")
        assert sock.recv(100) == b"STOPPING=1"


def test_notifier_without_socket_does_nothing_and_a_dead_socket_is_not_fatal(tmp_path: Path) -> None:
    assert not SystemdNotifier(None).notify("READY=1")
    assert not SystemdNotifier(str(tmp_path / "nobody-listens.sock")).notify("READY=1")


def test_from_env_removes_the_variables_and_ignores_another_pids_watchdog() -> None:
    env = {"NOTIFY_SOCKET": "/run/x.sock", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid()), "A": "b"}
    n = SystemdNotifier.from_env(env)
    assert (n.socket_path, n.watchdog_interval_s, env) == ("/run/x.sock", 15.0, {"A": "b"})
    other = SystemdNotifier.from_env({"NOTIFY_SOCKET": "/s", "WATCHDOG_USEC": "1000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval_s is None


def test_watchdog_pings_only_while_alive(notify_listener: NotifyListener) -> None:
    healthy = threading.Event()
    healthy.set()
    calls = {True: 0, False: 0}
    three_refusals = threading.Event()

    def alive() -> bool:
        ok = healthy.is_set()
        calls[ok] += 1
        if calls[True] >= 3:
            healthy.clear()
        if calls[False] >= 3:
            three_refusals.set()
        return ok

    n = SystemdNotifier(str(notify_listener.path), watchdog_usec=20_000)  # a ping every 10 ms
    n.start_watchdog(alive)
    assert three_refusals.wait(30)
    n.stopping()
    notify_listener.wait_for("STOPPING", "1", timeout_s=5)
    pings = [m for m in notify_listener.messages if m == {"WATCHDOG": "1"}]
    assert len(pings) == calls[True] == 3


def test_http_alive_is_false_when_nothing_listens() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert not http_alive(f"http://127.0.0.1:{port}", timeout_s=2)()


def test_agent_run_notifies_ready_once_serving_then_watchdog_then_stopping(
    tmp_path: Path, keypair: tuple[Path, Path], bundles: Bundles, notify_listener: NotifyListener
) -> None:
    config = write_config(tmp_path / "agent", keypair[1])
    done = agent_cli("install", str(bundles.v1), "--config", str(config))
    assert done.returncode == 0, done.stderr
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_listener.path), "WATCHDOG_USEC": "400000"}
    env.pop("WATCHDOG_PID", None)
    log = (tmp_path / "agent.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "device_agents.cli", "run", "--config", str(config)], env=env, stderr=log, stdout=log
    )
    try:
        ready = notify_listener.wait_for("READY", "1")
        url = json.loads((config.parent / "store" / "daemon.json").read_text())["url"]
        assert ready["STATUS"] == f"serving tiny v1 on {url}"
        assert ready["MAINPID"] == str(proc.pid)
        # READY=1 means serving: the API answers and the installed model is loaded, with no retry
        for route in ("/v2/health/ready", "/v2/models/tiny/ready"):
            with urllib.request.urlopen(url + route, timeout=5) as resp:
                assert resp.status == 200
        notify_listener.wait_for("WATCHDOG", "1")
        proc.send_signal(signal.SIGTERM)
        notify_listener.wait_for("STOPPING", "1")
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def test_agent_run_with_no_model_installed_notifies_ready_at_once(
    tmp_path: Path, keypair: tuple[Path, Path], notify_listener: NotifyListener
) -> None:
    config = write_config(tmp_path / "agent", keypair[1])
    env = {**os.environ, "NOTIFY_SOCKET": str(notify_listener.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "device_agents.cli", "run", "--config", str(config)],
        env=env,
        stderr=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
    )
    try:
        ready = notify_listener.wait_for("READY", "1")
        url = json.loads((config.parent / "store" / "daemon.json").read_text())["url"]
        assert ready["STATUS"] == f"serving no models on {url}"
        with urllib.request.urlopen(url + "/v2/health/ready", timeout=5) as resp:
            assert resp.status == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not [m for m in notify_listener.messages if "WATCHDOG" in m]  # no WATCHDOG_USEC: no pings
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
