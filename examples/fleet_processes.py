"""A real Mosquitto broker and the bundle file server in child processes, on free loopback ports.

Used by the update tests and the OTA benchmark (the agent itself is ``examples.agent_process``).
``Mosquitto.plain`` runs an anonymous broker with persistence on and a one-second autosave, so
that a SIGKILL loses at most a second of state; ``Mosquitto(dir, config_text, port)`` runs any
config. ``FileServer`` is ``python -m edgekit.fleet.fileserver`` (HTTP with Range support).
``toml_table`` writes an agent config table, e.g. ``[updates]`` for ``RunningAgent(extra_config=...)``.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from edgekit.errors import EdgekitError

# Debian installs the broker in /usr/sbin, which is not on every user's PATH.
MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"
ROOT = Path(__file__).resolve().parents[1]


def toml_table(name: str, fields: dict[str, Any]) -> str:
    """``[name]`` with ``fields`` (strings, paths, numbers, booleans, lists): JSON values are valid TOML."""
    lines = [f"[{name}]"]
    lines += [f"{k} = {json.dumps(str(v) if isinstance(v, Path) else v)}" for k, v in fields.items() if v is not None]
    return "\n".join(lines) + "\n"


class ServiceError(EdgekitError):
    """A service process did not start; the message quotes its log."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 0.05) -> Any:
    """Poll ``predicate`` until it returns something truthy (returned) or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(interval_s)


class Process:
    """A child process with its output in ``log_path``; ``kill`` = SIGKILL, ``stop`` = SIGTERM."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd, self.log_path, self.env = cmd, log_path, env
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
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()

    def wait_port(self, port: int, timeout_s: float = 10.0) -> None:
        def listening() -> bool:
            if not self.running:
                raise ServiceError(f"{self.cmd[0]} exited early:\n{self.log()[-2000:]}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", port)) == 0

        wait_for(listening, timeout_s, f"{Path(self.cmd[0]).name} to listen on port {port}")


class Mosquitto(Process):
    """A real broker from a config text; ``start`` again after ``kill`` reuses port and database."""

    def __init__(self, directory: Path, config: str, port: int) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.port = directory, port
        # Started as root, mosquitto switches to user "mosquitto", which cannot read private
        # temporary directories; as any other user this line has no effect.
        (directory / "mosquitto.conf").write_text(config + "user root\n")
        super().__init__([MOSQUITTO, "-c", str(directory / "mosquitto.conf")], directory / "mosquitto.log")

    @classmethod
    def plain(cls, directory: Path, *, max_connections: int = -1) -> Mosquitto:
        port = free_port()
        config = (
            f"persistence true\npersistence_location {directory}/\nautosave_interval 1\n"
            f"listener {port} 127.0.0.1\nallow_anonymous true\nmax_connections {max_connections}\n"
        )
        return cls(directory, config, port)

    def start(self) -> Mosquitto:
        self.spawn()
        self.wait_port(self.port)
        return self

    def url(self, tls: bool = False) -> str:
        return f"{'mqtts' if tls else 'mqtt'}://127.0.0.1:{self.port}"


class FileServer(Process):
    """``python -m edgekit.fleet.fileserver DIR --port P``; each request is a line of its log."""

    def __init__(self, directory: Path, log_path: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.dir, self.port = directory, free_port()
        cmd = [sys.executable, "-m", "edgekit.fleet.fileserver", str(directory), "--port", str(self.port)]
        super().__init__(cmd, log_path)

    def start(self) -> FileServer:
        self.spawn()
        self.wait_port(self.port)
        return self

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def requests(self) -> list[str]:
        return [line for line in self.log().splitlines() if line.startswith(("GET ", "HEAD "))]
