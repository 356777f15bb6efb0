"""Real processes for the update tests: Mosquitto, the Range-capable file server, the agent.

Each binds 127.0.0.1 on a free port, logs to a file in the test's directory and is killed at
the end of the test whatever happens.
"""

from __future__ import annotations

import json
import os
import re
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

from examples.fleet_processes import FileServer, Mosquitto, Process, free_port, toml_table, wait_for
from tests.updates.pki import Identity, TestCA

__all__ = [
    "Agent",
    "AgentSpec",
    "FileServer",
    "Mosquitto",
    "MotoServer",
    "Process",
    "Redirector",
    "SlowFileServer",
    "Watcher",
    "fleet_broker",
    "free_port",
    "wait_for",
]

ROOT = Path(__file__).resolve().parents[2]
TEMPLATE = ROOT / "packaging" / "mosquitto" / "edgekit.conf"


def fleet_broker(directory: Path, ca: TestCA, server: Identity, acl: str) -> Mosquitto:
    """packaging/mosquitto's config with ``acl`` (from ``edgekit fleet acl``), test paths, a loopback
    port and 1 s autosave."""
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "edgekit.acl").write_text(acl)
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
    return Mosquitto(directory, config, port)


class SlowFileServer(FileServer):
    """``edgekit fleet serve --throttle-bytes-per-s N``: a slow link to the bundles."""

    def __init__(self, directory: Path, log_path: Path, bytes_per_s: int) -> None:
        super().__init__(directory, log_path)
        self.cmd += ["--throttle-bytes-per-s", str(bytes_per_s)]


class Redirector(Process):
    """``python -m tests.updates.redirector``: answers every GET with 302 to ``location`` (TLS with a cert)."""

    def __init__(self, log_path: Path, location: str, tls: Identity | None = None) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "tests.updates.redirector", "--port", str(self.port), "--location", location]
        if tls is not None:
            cmd += ["--cert", str(tls.cert), "--key", str(tls.key)]
        self.scheme = "https" if tls is not None else "http"
        super().__init__(cmd, log_path)

    def start(self) -> Redirector:
        self.spawn()
        self.wait_port(self.port)
        return self

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/bundle.ekb"


class MotoServer(Process):
    """``python -m moto.server``: an S3-compatible server (PyPI ``moto[server]``) in memory.

    Each request is a line of its log (werkzeug's access log: ``"GET /bucket/key?... HTTP/1.1" 206 -``).
    """

    def __init__(self, log_path: Path) -> None:
        self.port = free_port()
        super().__init__([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)], log_path)

    def start(self) -> MotoServer:
        self.spawn()
        self.wait_port(self.port)
        return self

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self, path_prefix: str = "") -> list[str]:
        """``METHOD PATH STATUS`` of every request whose path starts with ``path_prefix``."""
        found = re.findall(r'"([A-Z]+) (\S+) HTTP/[\d.]+" (\d{3})', self.log())
        return [f"{m} {p} {status}" for m, p, status in found if p.startswith(path_prefix)]


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
    notice_keys: tuple[Path, ...] = ()

    def toml(self) -> str:
        updates = {
            "broker": self.broker,
            "fleet": self.fleet,
            "device_id": self.device_id,
            "groups": list(self.groups),
            "ca": self.ca,
            "cert": self.tls.cert if self.tls else None,
            "key": self.tls.key if self.tls else None,
            "keepalive_s": 5,
            "reconnect_max_s": 2.0,
            "health_window_s": 2.0,
            "crash_loop_boots": 2,
            "notice_keys": [str(k) for k in self.notice_keys],
            **self.extra_updates,
        }
        head = f'store = {json.dumps(str(self.store))}\nlisten = "127.0.0.1:0"\n'
        keys = ", ".join(json.dumps(str(k)) for k in self.trusted_keys)
        return (
            f"{head}trusted_keys = [{keys}]\n"
            + toml_table("selftest", {"timeout_s": 60})
            + toml_table("updates", updates)
        )


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
        from edgekit.bundle.fleet_connection import BrokerAddress, new_client

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
