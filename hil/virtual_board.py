"""A virtual board on this Linux machine: what a small device looks like to the agent, made of
kernel features (run as root).

- its own network namespace, joined to the host by a veth pair (addresses inside a /30 that
  only this board uses: ``10.213.K.1`` on the host side, ``10.213.K.2`` on the board);
- a serial console: a null-modem cable of two pty pairs (``examples.serial_link``): the agent
  opens one end as its ``[console] device``, the host (pyserial, labgrid's ``RawSerialPort``)
  the other, through a symlink at a fixed path;
- a CPU quota (cgroup v1 ``cpu.cfs_quota_us``, or cgroup v2 ``cpu.max``), as a small board's
  cores; the agent sizes its runtimes' thread pools to it (``device_agents.cpus``);
- its store on a size-limited tmpfs (a small eMMC: a full disk is a real ENOSPC);
- power: ``power_on`` starts the agent in all of that, ``power_off`` SIGKILLs it (a power cut:
  no ``finally``, no flushed buffers); the tmpfs store survives, as flash does.

``create`` fails with ``VirtualBoardError`` naming the step when a namespace, pty, cgroup or
mount cannot be made: as root on Linux a virtual board that cannot be built is an error, never a
skip. ``destroy`` undoes every step that was done, each in its own ``finally``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType

from edgekit.errors import EdgekitError
from examples.serial_link import NullModem

ROOT = Path(__file__).resolve().parents[1]
CGROUP_V1_CPU = Path("/sys/fs/cgroup/cpu")
CGROUP_V2 = Path("/sys/fs/cgroup")
CFS_PERIOD_US = 100_000


class VirtualBoardError(EdgekitError):
    """A part of the virtual board could not be made; the message names the step and the command."""


def unsupported_reason() -> str | None:
    """Why no virtual board can be built here (not Linux, not root), or None."""
    if not sys.platform.startswith("linux"):
        return f"the virtual board needs Linux network namespaces and cgroups (this is {sys.platform})"
    if os.geteuid() != 0:
        return "the virtual board needs root (network namespaces, a tmpfs mount, a cgroup); run the suite as root"
    return None


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise VirtualBoardError(f"`{' '.join(cmd)}` exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _toml_str(value: object) -> str:
    import json

    return json.dumps(str(value))


class VirtualBoard:
    def __init__(
        self,
        workdir: Path,
        *,
        trusted_keys: tuple[Path, ...] = (),
        console_link: Path | None = None,
        cpu_quota: float = 0.5,
        store_mb: int = 96,
        http_port: int = 8500,
        extra_config: str = "",
    ) -> None:
        self.workdir = Path(workdir).resolve()
        self.trusted_keys = tuple(Path(k).resolve() for k in trusted_keys)
        self.console_link = console_link or self.workdir / "console"
        self.cpu_quota = cpu_quota
        self.store_mb = store_mb
        self.http_port = http_port
        self.extra_config = extra_config
        tag = os.getpid() % 100_000
        self.netns = f"ekvb{tag}"
        self.veth_host, self.veth_board = f"ekvh{tag}", f"ekvd{tag}"
        subnet = 4 * (os.getpid() % 60)  # a /30 of 10.213.K.0/24 per process: parallel runs do not meet
        self.host_address = f"10.213.{os.getpid() % 250}.{subnet + 1}"
        self.board_address = f"10.213.{os.getpid() % 250}.{subnet + 2}"
        self.store = self.workdir / "store"
        self.config_path = self.workdir / "agent.toml"
        self.log_path = self.workdir / "agent.log"
        self.cgroup: Path | None = None
        self.link: NullModem | None = None
        self._mounted = False
        self._netns_made = False
        self._proc: subprocess.Popen[bytes] | None = None
        self.boots = 0

    # -- building ------------------------------------------------------------------------
    def __enter__(self) -> VirtualBoard:
        self.create()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.destroy()

    def create(self) -> None:
        reason = unsupported_reason()
        if reason is not None:
            raise VirtualBoardError(reason)
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self._make_netns()
            self._make_store()
            self._make_cgroup()
            self._make_console()
            self.write_config()
        except BaseException:
            self.destroy()
            raise

    def _make_netns(self) -> None:
        with contextlib.suppress(VirtualBoardError):
            _run("ip", "netns", "del", self.netns)  # left by a run that was SIGKILLed
        _run("ip", "netns", "add", self.netns)
        self._netns_made = True
        _run("ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_board)
        _run("ip", "link", "set", self.veth_board, "netns", self.netns)
        _run("ip", "addr", "add", f"{self.host_address}/30", "dev", self.veth_host)
        _run("ip", "link", "set", self.veth_host, "up")
        inside = ("ip", "netns", "exec", self.netns)
        _run(*inside, "ip", "addr", "add", f"{self.board_address}/30", "dev", self.veth_board)
        _run(*inside, "ip", "link", "set", self.veth_board, "up")
        _run(*inside, "ip", "link", "set", "lo", "up")

    def _make_store(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        _run("mount", "-t", "tmpfs", "-o", f"size={self.store_mb}m,mode=0700", "tmpfs", str(self.store))
        self._mounted = True

    def _make_cgroup(self) -> None:
        name = f"edgekit-{self.netns}"
        quota_us = max(1000, int(self.cpu_quota * CFS_PERIOD_US))
        if (CGROUP_V1_CPU / "cpu.cfs_quota_us").exists():
            path = CGROUP_V1_CPU / name
            path.mkdir(exist_ok=True)
            self.cgroup = path
            (path / "cpu.cfs_period_us").write_text(str(CFS_PERIOD_US))
            (path / "cpu.cfs_quota_us").write_text(str(quota_us))
        elif (CGROUP_V2 / "cgroup.controllers").exists():
            path = CGROUP_V2 / name
            path.mkdir(exist_ok=True)
            self.cgroup = path
            (path / "cpu.max").write_text(f"{quota_us} {CFS_PERIOD_US}")
        else:
            raise VirtualBoardError(
                f"no cgroup CPU controller at {CGROUP_V1_CPU} (v1) or {CGROUP_V2}/cgroup.controllers (v2)"
            )

    def _make_console(self) -> None:
        self.link = NullModem().__enter__()
        self.console_link.parent.mkdir(parents=True, exist_ok=True)
        self.console_link.unlink(missing_ok=True)
        self.console_link.symlink_to(self.link.host_port)

    @property
    def token_file(self) -> Path:
        """The bearer token the board's agent asks of clients off loopback (it listens on every address)."""
        return self.workdir / "agent-token"

    def write_config(self) -> None:
        if self.link is None:
            raise VirtualBoardError("the console is not made yet: call create() first")
        if not self.token_file.exists():
            import secrets

            self.token_file.write_text(secrets.token_urlsafe(24) + "\n")
            self.token_file.chmod(0o600)
        keys = ", ".join(_toml_str(k) for k in self.trusted_keys)
        lines = [
            "config_version = 2",
            f"store = {_toml_str(self.store)}",
            # every address of the board: the host reaches it on its veth address, and
            # `edgekit-agent install` on the board over loopback (the install route is loopback-only)
            f'listen = "0.0.0.0:{self.http_port}"',
            f"trusted_keys = [{keys}]",
            "",
            "[server]",
            f"auth_token_file = {_toml_str(self.token_file)}",
            "",
            "[console]",
            f"device = {_toml_str(self.link.device_port)}",
        ]
        if self.extra_config:
            lines += ["", self.extra_config.strip()]
        self.config_path.write_text("\n".join(lines) + "\n")

    # -- power -----------------------------------------------------------------------------
    @property
    def powered(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.powered and self._proc is not None else None

    @property
    def http_url(self) -> str:
        return f"http://{self.board_address}:{self.http_port}"

    def power_on(self, env: Mapping[str, str] | None = None) -> None:
        """Start the agent inside the namespace and the cgroup (``env``: e.g. a fault point)."""
        if self.powered:
            return
        self.write_config()
        (self.store / "daemon.json").unlink(missing_ok=True)
        procs = None if self.cgroup is None else self.cgroup / "cgroup.procs"

        def join_cgroup() -> None:  # in the child, before exec: the agent starts under the quota
            if procs is not None:
                procs.write_text(str(os.getpid()))

        command = [*self._inside(), sys.executable, "-m", "device_agents.cli"]
        with open(self.log_path, "ab") as log:
            log.write(f"--- power on {time.strftime('%H:%M:%S')} ---\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                [*command, "run", "--config", str(self.config_path)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                preexec_fn=join_cgroup,  # the cgroup is joined before exec; no threads run in the child
            )
        self.boots += 1

    def power_off(self) -> None:
        """SIGKILL: what a power cut does to the agent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)

    def exited(self) -> int | None:
        """The agent's exit code once it has stopped by itself (a console restart, a fault point)."""
        return None if self._proc is None else self._proc.poll()

    def wait_exit(self, timeout_s: float) -> int:
        if self._proc is None:
            raise VirtualBoardError("the board is off")
        code = self._proc.wait(timeout_s)
        self._proc = None
        return code

    def _inside(self) -> list[str]:
        """The command prefix that runs a program in the board's network namespace. Not
        ``ip netns exec``: it mounts a fresh /sys for the namespace, without /sys/fs/cgroup, and the
        agent would not see its CPU quota (it sizes its runtimes' thread pools to it)."""
        if shutil.which("nsenter"):
            return ["nsenter", f"--net=/var/run/netns/{self.netns}"]
        return ["ip", "netns", "exec", self.netns]

    # -- what a board offers ------------------------------------------------------------
    def run(self, *cmd: str, timeout_s: float = 600.0) -> subprocess.CompletedProcess[str]:
        """A command on the board (in its namespace), as SSH would run it on a real one."""
        return subprocess.run(
            [*self._inside(), *cmd],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
        )

    def set_network(self, up: bool) -> None:
        """Pull (or plug back) the board's network cable: the host end of its veth pair."""
        _run("ip", "link", "set", self.veth_host, "up" if up else "down")

    def rss_bytes(self) -> int | None:
        import psutil

        pid = self.pid
        if pid is None:
            return None
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None

    def log_tail(self, chars: int = 3000) -> str:
        with contextlib.suppress(OSError):
            return self.log_path.read_text(errors="replace")[-chars:]
        return ""

    # -- teardown -------------------------------------------------------------------------
    def destroy(self) -> None:
        try:
            self.power_off()
        finally:
            try:
                if self.link is not None:
                    self.link.close()
                    self.link = None
                self.console_link.unlink(missing_ok=True)
            finally:
                try:
                    if self._mounted:
                        _run("umount", "-l", str(self.store))
                        self._mounted = False
                finally:
                    try:
                        if self.cgroup is not None:
                            _rmdir_cgroup(self.cgroup)
                            self.cgroup = None
                    finally:
                        if self._netns_made:
                            _run("ip", "netns", "del", self.netns)  # takes its end of the veth pair, and ours
                            self._netns_made = False


def _rmdir_cgroup(path: Path) -> None:
    deadline = time.monotonic() + 10
    while True:
        try:
            path.rmdir()
            return
        except OSError:  # EBUSY while a killed process is still leaving it
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
