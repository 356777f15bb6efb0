"""A real ``edgekit-agent`` daemon in a child process, on a free loopback port.

Used by the demo, the benchmarks and the acceptance tests: it writes an ``agent.toml`` (store,
``listen = "127.0.0.1:0"``, trusted keys), runs ``edgekit-agent run --config agent.toml`` with this
interpreter (``python -m device_agents.cli``, so the agent is the code of this checkout), reads the
address the daemon publishes in ``<store>/daemon.json``, and installs bundles with
``edgekit-agent install BUNDLE --config agent.toml``, which hands them to the running daemon.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Collection, Iterator, Sequence
from pathlib import Path
from types import TracebackType

from edgekit.errors import EdgekitError

AGENT_COMMAND = (sys.executable, "-m", "device_agents.cli")


class AgentProcessError(EdgekitError):
    """The agent did not start, refused a bundle or did not get ready; the message quotes its log."""


@contextlib.contextmanager
def pinned(cpus: Collection[int] | None) -> Iterator[None]:
    """Run the calling thread on ``cpus`` (None: as it is) and restore its CPUs after.

    Threads and processes it starts meanwhile keep the CPUs they start with (Linux: a new thread or
    process inherits its creator's affinity), so ``with pinned({0}): start_clients()`` keeps a load
    generator off the cores an agent runs on. Other threads of this process are not touched."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, set(cpus))
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _toml_str(value: object) -> str:
    return json.dumps(str(value))  # a JSON string is a valid TOML basic string


class RunningAgent:
    """``with RunningAgent(workdir, [pub]) as agent: agent.install(bundle); agent.url``."""

    def __init__(
        self,
        workdir: Path,
        trusted_keys: Sequence[Path],
        *,
        threads: int = 0,
        extra_config: str = "",
        start_timeout_s: float = 60.0,
        cpus: Collection[int] | None = None,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.store = self.workdir / "store"
        self.config = self.workdir / "agent.toml"
        self.log_path = self.workdir / "agent.log"
        self.trusted_keys = tuple(Path(k).resolve() for k in trusted_keys)
        self.threads = threads
        self.extra_config = extra_config  # more TOML tables, e.g. an [updates] table
        self.start_timeout_s = start_timeout_s
        # the CPUs the daemon runs on (Linux; None: this process's): its threads and self-test children
        # inherit them, and it sizes its runtimes' default thread pools to them (device_agents.cpus)
        self.cpus = None if cpus is None else frozenset(cpus)
        self.url = ""  # http://127.0.0.1:PORT once started
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        """The daemon's process id while it runs (for RSS readings in benchmarks)."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    # -- lifecycle ----------------------------------------------------------------------
    def __enter__(self) -> RunningAgent:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def host_port(self) -> str:
        """``127.0.0.1:PORT``, the form ``tritonclient.http.InferenceServerClient(url=...)`` takes."""
        return self.url.removeprefix("http://")

    def write_config(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        keys = ", ".join(_toml_str(k) for k in self.trusted_keys)
        lines = [
            "config_version = 2",
            f"store = {_toml_str(self.store)}",
            'listen = "127.0.0.1:0"',
            f"trusted_keys = [{keys}]",
        ]
        if self.threads:
            lines += ["", "[runtimes.onnxruntime]", f"threads = {self.threads}"]
        if self.extra_config:
            lines += ["", self.extra_config.strip()]
        self.config.write_text("\n".join(lines) + "\n")
        return self.config

    def start(self) -> None:
        self.write_config()
        (self.store / "daemon.json").unlink(missing_ok=True)
        with open(self.log_path, "ab") as log, pinned(self.cpus):
            self._proc = subprocess.Popen(
                [*AGENT_COMMAND, "run", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
            )
        try:
            self.url = self._wait_for_address()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout_s``; returns the exit code (None if never started)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return proc.returncode

    def log_tail(self, chars: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    # -- operations ---------------------------------------------------------------------
    def install(self, bundle: Path, timeout_s: float = 300.0) -> str:
        """``edgekit-agent install BUNDLE`` against the running daemon; returns what it printed."""
        done = subprocess.run(
            [*AGENT_COMMAND, "install", str(Path(bundle).resolve()), "--config", str(self.config)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
        if done.returncode != 0:
            raise AgentProcessError(
                f"edgekit-agent install {Path(bundle).name} exited {done.returncode}: "
                f"{(done.stderr or done.stdout).strip()}\nagent log:\n{self.log_tail()}"
            )
        return done.stdout.strip()

    def wait_model_ready(self, name: str, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._get_ok(f"/v2/models/{name}/ready"):
            self._check_alive()
            if time.monotonic() > deadline:
                raise AgentProcessError(
                    f"model {name} is not ready after {timeout_s:.0f} s; agent log:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    # -- internals ----------------------------------------------------------------------
    def _wait_for_address(self) -> str:
        info = self.store / "daemon.json"
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            self._check_alive()
            with contextlib.suppress(OSError, ValueError, KeyError):
                url = str(json.loads(info.read_text())["url"])
                if self._get_ok("/v2/health/live", url):
                    return url
            if time.monotonic() > deadline:
                raise AgentProcessError(
                    f"edgekit-agent did not answer within {self.start_timeout_s:.0f} s; log:\n{self.log_tail()}"
                )
            time.sleep(0.1)

    def _check_alive(self) -> None:
        if self._proc is None or self._proc.poll() is not None:
            code = None if self._proc is None else self._proc.returncode
            raise AgentProcessError(f"edgekit-agent exited (code {code}); log:\n{self.log_tail()}")

    def _get_ok(self, path: str, base: str | None = None) -> bool:
        try:
            with urllib.request.urlopen(f"{base or self.url}{path}", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False
