"""Real processes for the update tests: Mosquitto, the Range-capable file server, the agent.

Each binds 127.0.0.1 on a free port, logs to a file in the test's directory and is killed at
the end of the test whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tests.updates.pki import Identity, TestCA

ROOT = Path(__file__).resolve().parents[2]
MOSQUITTO = "/usr/sbin/mosquitto"
TEMPLATE = ROOT / "packaging" / "mosquitto" / "edgekit.conf"
ACL = ROOT / "packaging" / "mosquitto" / "edgekit.acl"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


class Process:
    """A child process with its output in ``log``; ``kill`` = SIGKILL, ``stop`` = SIGTERM."""

    def __init__(self, cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log_path, self.env = cmd, log, env
        self.proc: subprocess.Popen[bytes] | None = None

    def spawn(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=self.env, cwd=ROOT
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


def _wait_port(port: int, proc: Process, timeout_s: float = 10.0) -> None:
    def listening() -> bool:
        if not proc.running:
            raise RuntimeError(f"{proc.cmd[0]} exited early:\n{proc.log()[-2000:]}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_for(listening, timeout_s, f"port {port}")


class Mosquitto(Process):
    """A real broker with persistence on. ``fleet`` runs packaging/mosquitto/edgekit.conf."""

    def __init__(self, directory: Path, config: str, port: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.port = directory, port
        # Started as root, mosquitto switches to user "mosquitto", which cannot read pytest's
        # private temporary directories; as any other user this line has no effect.
        (directory / "mosquitto.conf").write_text(config + "user root\n")
        super().__init__([MOSQUITTO, "-c", str(directory / "mosquitto.conf")], directory / "mosquitto.log")

    @classmethod
    def plain(cls, directory: Path) -> Mosquitto:
        port = free_port()
        config = (
            f"persistence true\npersistence_location {directory}/\nautosave_interval 1\n"
            f"listener {port} 127.0.0.1\nallow_anonymous true\n"
        )
        return cls(directory, config, port)

    @classmethod
    def fleet(cls, directory: Path, ca: TestCA, server: Identity) -> Mosquitto:
        """The production config and ACL, with test paths, a loopback port and 1 s autosave."""
        port = free_port()
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "edgekit.acl").write_text(ACL.read_text())
        replacements = {
            r"^persistence_location .*$": f"persistence_location {directory}/",
            r"^autosave_interval .*$": "autosave_interval 1",
            r"^listener 8883$": f"listener {port} 127.0.0.1",
            r"^cafile .*$": f"cafile {ca.cert_path}",
            r"^certfile .*$": f"certfile {server.cert}",
            r"^keyfile .*$": f"keyfile {server.key}",
            r"^crlfile .*$": f"crlfile {ca.dir / 'ca.crl'}",
            r"^acl_file .*$": f"acl_file {directory / 'edgekit.acl'}",
        }
        config = TEMPLATE.read_text()
        for pattern, value in replacements.items():
            config, n = re.subn(pattern, value, config, flags=re.MULTILINE)
            if n != 1:
                raise AssertionError(f"{TEMPLATE} has {n} lines matching {pattern!r}; update the tests")
        return cls(directory, config, port)

    def start(self) -> Mosquitto:
        self.spawn()
        _wait_port(self.port, self)
        return self

    def url(self, tls: bool = False) -> str:
        return f"{'mqtts' if tls else 'mqtt'}://127.0.0.1:{self.port}"


class FileServer(Process):
    """``python -m edgekit.fleet.fileserver DIR --port P``; requests are logged to its log."""

    def __init__(self, directory: Path, log: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.port = directory, free_port()
        cmd = [sys.executable, "-m", "edgekit.fleet.fileserver", str(directory), "--port", str(self.port)]
        super().__init__(cmd, log)

    def start(self) -> FileServer:
        self.spawn()
        _wait_port(self.port, self)
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[str]:
        return [line for line in self.log().splitlines() if line.startswith(("GET ", "HEAD "))]


@dataclass
class AgentSpec:
    store: Path
    trusted_keys: tuple[Path, ...]
    broker: str
    fleet: str
    device_id: str
    groups: tuple[str, ...] = ()
    tls: Identity | None = None
    ca: Path | None = None
    extra_updates: dict[str, Any] = field(default_factory=dict)

    def toml(self) -> str:
        def q(value: Any) -> str:
            return json.dumps(str(value)) if isinstance(value, (str, Path)) else json.dumps(value)

        updates = {
            "broker": self.broker,
            "fleet": self.fleet,
            "device_id": self.device_id,
            "groups": list(self.groups),
            "keepalive_s": 5,
            "reconnect_max_s": 2.0,
            "health_window_s": 2.0,
            "crash_loop_boots": 2,
            **self.extra_updates,
        }
        if self.ca is not None:
            updates["ca"] = str(self.ca)
        if self.tls is not None:
            updates["cert"], updates["key"] = str(self.tls.cert), str(self.tls.key)
        lines = [
            f"store = {q(self.store)}",
            'listen = "127.0.0.1:0"',
            f"trusted_keys = [{', '.join(q(k) for k in self.trusted_keys)}]",
            "[selftest]",
            "timeout_s = 60",
            "[updates]",
            *(f"{k} = {q(v) if not isinstance(v, list) else json.dumps(v)}" for k, v in updates.items()),
        ]
        return "\n".join(lines) + "\n"


class Agent(Process):
    """``edgekit-agent run --config agent.toml`` as a real daemon."""

    def __init__(self, spec: AgentSpec, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.spec = spec
        self.config = directory / "agent.toml"
        self.config.write_text(spec.toml())
        super().__init__(
            [
                sys.executable,
                "-c",
                "from device_agents.cli import main; raise SystemExit(main())",
                "run",
                "--config",
                str(self.config),
            ],
            directory / "agent.log",
        )
        self.url = ""

    def start(self, fault: str | None = None, *, wait_ready: bool = True) -> Agent:
        env = {k: v for k, v in os.environ.items() if k != "EDGEKIT_FAULT"}
        if fault is not None:
            env["EDGEKIT_FAULT"] = fault
        self.env = env
        (self.spec.store / "daemon.json").unlink(missing_ok=True)
        self.spawn()
        if wait_ready:
            self.wait_ready()
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        info = self.spec.store / "daemon.json"

        def ready() -> bool:
            if not self.running:
                raise RuntimeError(f"the agent exited early:\n{self.log()[-3000:]}")
            if not info.exists():
                return False
            try:
                self.url = json.loads(info.read_text())["url"]
                with urllib.request.urlopen(f"{self.url}/v2/health/live", timeout=2):
                    return True
            except (OSError, ValueError, KeyError):
                return False

        wait_for(ready, timeout_s, "the agent to listen")

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout_s)

    def served_version(self, name: str) -> int | None:
        try:
            with urllib.request.urlopen(f"{self.url}/v2/models/{name}", timeout=5) as r:
                return int(json.loads(r.read())["versions"][0])
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def wait_version(self, name: str, version: int, timeout_s: float = 60.0) -> None:
        def check() -> bool:
            if not self.running:
                raise RuntimeError(f"the agent exited:\n{self.log()[-3000:]}")
            return self.served_version(name) == version

        wait_for(check, timeout_s, f"{name} v{version} to be served", interval_s=0.1)

    def infer(self, name: str, x: np.ndarray) -> tuple[int, np.ndarray]:
        """POST a v2 JSON request; return (model_version, first output)."""
        body = {"inputs": [{"name": "input", "shape": list(x.shape), "datatype": "FP32", "data": x.ravel().tolist()}]}
        req = urllib.request.Request(
            f"{self.url}/v2/models/{name}/infer",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            doc = json.loads(r.read())
        out = doc["outputs"][0]
        return int(doc["model_version"]), np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])

    def metric(self, name: str, **labels: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5) as r:
            text = r.read().decode()
        total = 0.0
        for line in text.splitlines():
            if not line.startswith(name + "{") and line.split(" ")[0] != name:
                continue
            if all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total


class Watcher:
    """Collects every message on some topics (QoS 1) with its arrival time, in a paho thread."""

    def __init__(self, broker_port: int, topics: list[str], *, tls: tuple[Path, Identity] | None = None) -> None:
        from device_agents.updates.connection import BrokerAddress, new_client

        ca, ident = tls if tls is not None else (None, None)
        address = BrokerAddress(
            tls is not None, "127.0.0.1", broker_port, ca, ident.cert if ident else None, ident.key if ident else None
        )
        self.messages: list[tuple[float, str, bytes]] = []
        self._lock = threading.Lock()
        self._subscribed = threading.Event()
        self.client = new_client(address, f"watcher-{os.getpid()}-{id(self)}")
        self.client.on_connect = lambda c, u, f, rc, p: c.subscribe([(t, 1) for t in topics])
        self.client.on_subscribe = lambda *a: self._subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", broker_port, 30)
        self.client.loop_start()
        if not self._subscribed.wait(10):
            raise TimeoutError("watcher did not subscribe")

    def _on_message(self, client: Any, userdata: Any, message: Any) -> None:
        with self._lock:
            self.messages.append((time.monotonic(), message.topic, bytes(message.payload)))

    def payloads(self, topic: str | None = None) -> list[dict[str, Any]]:
        with self._lock:
            return [json.loads(p) for _, t, p in self.messages if p and (topic is None or t == topic)]

    def wait(self, predicate: Callable[[dict[str, Any]], bool], timeout_s: float, what: str) -> dict[str, Any]:
        return wait_for(lambda: next((p for p in self.payloads() if predicate(p)), None), timeout_s, what)  # type: ignore[no-any-return]

    def close(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()
