"""edgekit's labgrid resources, drivers and strategy (a board file lists this module in ``imports``).

Resources
    ``EdgekitAgent``   how the host reaches the agent on the board: ``url`` of its v2 API where the
                       network reaches it ("" where only the console does), the board's ``store``
                       (for commands over SSH), limits the scenarios hold it to, and the commands
                       that pull and plug back its network cable where a switch can.
    ``VirtualBoard``   the virtual board (``hil.virtual_board``): work dir, console link, CPU quota,
                       store size.
Drivers
    ``VirtualBoardDriver``   power (``PowerProtocol``: on = start the agent, off = SIGKILL) and
                             commands for the virtual board.
    ``EdgekitConsoleDriver`` the agent's serial console (``edgekit.board.BoardClient``) over
                             labgrid's ``SerialDriver`` (a ``RawSerialPort``, or a network serial port).
    ``EdgekitAgentDriver``   the agent: ready, infer over the network, install over the network
                             (SSH: copy + ``edgekit-agent install``) or the console, RSS.
Strategy
    ``EdgekitStrategy``      ``off`` -> ``ready``: power on, then wait until the console answers and
                             the agent reports ready; records the boot-to-ready time.
"""

from __future__ import annotations

import enum
import json
import shlex
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attr
import numpy as np
from labgrid.driver.common import Driver
from labgrid.driver.powerdriver import PowerResetMixin
from labgrid.factory import target_factory
from labgrid.protocol import PowerProtocol
from labgrid.resource.common import Resource
from labgrid.step import step
from labgrid.strategy.common import Strategy, StrategyError

from edgekit.board import BoardClient, BoardTimeoutError, decode_v2_response, encode_v2_request
from edgekit.errors import EdgekitError
from hil.virtual_board import VirtualBoard as Board

_opt_str = attr.validators.optional(attr.validators.instance_of(str))
_opt_num = attr.validators.optional(attr.validators.instance_of((int, float)))


class BoardCommandError(EdgekitError):
    """A command on the board failed; the message quotes its output."""


@target_factory.reg_resource
@attr.s(eq=False)
class EdgekitAgent(Resource):  # type: ignore[misc]  # labgrid is untyped
    url: str = attr.ib(default="", validator=attr.validators.instance_of(str))  # "" = no network path to it
    store: str = attr.ib(default="/var/lib/edgekit", validator=attr.validators.instance_of(str))
    config: str = attr.ib(default="/etc/edgekit/agent.toml", validator=attr.validators.instance_of(str))
    boot_timeout_s: float = attr.ib(default=120.0, validator=attr.validators.instance_of((int, float)))
    max_p99_ms: float | None = attr.ib(default=None, validator=_opt_num)  # the latency scenario fails above it
    max_rss_mb: float | None = attr.ib(default=None, validator=_opt_num)  # the RSS scenario fails above it
    network_off_cmd: str | None = attr.ib(default=None, validator=_opt_str)  # run on the host: pulls the board's cable
    network_on_cmd: str | None = attr.ib(default=None, validator=_opt_str)
    # the agent's [server] auth_token_file, as the host reads it: an agent listening beyond loopback wants it
    token_file: str | None = attr.ib(default=None, validator=_opt_str)


@target_factory.reg_resource
@attr.s(eq=False)
class VirtualBoard(Resource):  # type: ignore[misc]  # labgrid is untyped
    workdir: str = attr.ib(default="/tmp/edgekit-hil/virtual", validator=attr.validators.instance_of(str))
    console_link: str = attr.ib(default="/tmp/edgekit-hil/virtual/console", validator=attr.validators.instance_of(str))
    cpu_quota: float = attr.ib(default=0.5, validator=attr.validators.instance_of((int, float)))
    store_mb: int = attr.ib(default=96, validator=attr.validators.instance_of(int))
    http_port: int = attr.ib(default=8500, validator=attr.validators.instance_of(int))


@target_factory.reg_driver
@attr.s(eq=False)
class VirtualBoardDriver(Driver, PowerResetMixin, PowerProtocol):  # type: ignore[misc]  # labgrid is untyped
    """Builds the virtual board on activation and tears it down on deactivation."""

    bindings = {"resource": "VirtualBoard"}  # noqa: RUF012  # labgrid reads this class attribute

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.board: Board | None = None
        self.next_env: dict[str, str] = {}  # environment of the next power on (a fault point), then cleared

    def on_activate(self) -> None:
        r = self.resource
        self.board = Board(
            Path(r.workdir),
            console_link=Path(r.console_link),
            cpu_quota=float(r.cpu_quota),
            store_mb=r.store_mb,
            http_port=r.http_port,
        )
        self.board.create()

    def on_deactivate(self) -> None:
        if self.board is not None:
            self.board.destroy()
            self.board = None

    def _board(self) -> Board:
        if self.board is None:
            raise StrategyError("the virtual board is not built: activate VirtualBoardDriver first")
        return self.board

    @Driver.check_active  # type: ignore[untyped-decorator]  # labgrid is untyped
    @step()  # type: ignore[untyped-decorator]
    def on(self) -> None:
        env, self.next_env = self.next_env, {}
        self._board().power_on(env)

    @Driver.check_active  # type: ignore[untyped-decorator]
    @step()  # type: ignore[untyped-decorator]
    def off(self) -> None:
        self._board().power_off()

    @Driver.check_active  # type: ignore[untyped-decorator]
    @step()  # type: ignore[untyped-decorator]
    def cycle(self) -> None:
        self.off()
        self.on()

    def run_check(self, cmd: str) -> str:
        done = self._board().run("sh", "-c", cmd)
        if done.returncode != 0:
            raise BoardCommandError(f"`{cmd}` on the virtual board exited {done.returncode}: {done.stderr.strip()}")
        return done.stdout

    def put(self, src: str, dst: str) -> None:
        Path(dst).parent.mkdir(parents=True, exist_ok=True)
        Path(dst).write_bytes(Path(src).read_bytes())  # the board's file system is this one


@target_factory.reg_driver
@attr.s(eq=False)
class EdgekitConsoleDriver(Driver):  # type: ignore[misc]  # labgrid is untyped
    """The agent's serial console over labgrid's ``SerialDriver`` (which owns the port)."""

    bindings = {"serial": "SerialDriver"}  # noqa: RUF012  # labgrid reads this class attribute

    def client(self, timeout_s: float = 30.0) -> BoardClient:
        port = self.serial.serial
        port.timeout = 0.05  # BoardClient polls; SerialDriver sets its own timeout per read otherwise
        board = BoardClient(port, timeout_s=timeout_s)
        board.open()
        return board


@target_factory.reg_driver
@attr.s(eq=False)
class EdgekitAgentDriver(Driver):  # type: ignore[misc]  # labgrid is untyped
    bindings = {  # noqa: RUF012  # labgrid reads this class attribute
        "agent": "EdgekitAgent",
        "console": "EdgekitConsoleDriver",
        "command": {"SSHDriver", "VirtualBoardDriver", None},
    }

    @property
    def url(self) -> str:
        url = str(self.agent.url)
        if not url and isinstance(self.command, VirtualBoardDriver) and self.command.board is not None:
            return self.command.board.http_url
        return url

    @property
    def headers(self) -> dict[str, str]:
        """The Authorization header the agent asks of network clients, where it has a token."""
        path = self.agent.token_file
        if path is None and isinstance(self.command, VirtualBoardDriver) and self.command.board is not None:
            path = str(self.command.board.token_file)
        if path is None:
            return {}
        return {"Authorization": f"Bearer {Path(path).read_text().splitlines()[0].strip()}"}

    def wait_ready(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Until the console answers and the agent says ready; returns its status."""
        limit = float(self.agent.boot_timeout_s if timeout_s is None else timeout_s)
        deadline = time.monotonic() + limit
        last: Exception | None = None
        while time.monotonic() < deadline:
            board = self.command.board if isinstance(self.command, VirtualBoardDriver) else None
            if board is not None and board.exited() is not None:
                raise StrategyError(f"the agent exited {board.exited()} while booting; its log:\n{board.log_tail()}")
            try:
                with self.console.client(timeout_s=max(1.0, min(10.0, deadline - time.monotonic()))) as board:
                    status = board.status()
                if status["ready"]:
                    return dict(status)
            except (BoardTimeoutError, EdgekitError) as exc:
                last = exc
            time.sleep(0.1)
        raise StrategyError(f"the agent was not ready within {limit:g} s (last: {last})")

    def infer_http(
        self, model: str, inputs: Mapping[str, np.ndarray], timeout_s: float = 30.0
    ) -> dict[str, np.ndarray]:
        """One v2 request over the network (binary tensors)."""
        body, header_length = encode_v2_request(inputs)
        request = urllib.request.Request(
            f"{self.url}/v2/models/{model}/infer",
            data=body,
            headers={
                "Inference-Header-Content-Length": str(header_length),
                "Content-Type": "application/octet-stream",
                **self.headers,
            },
        )
        with urllib.request.urlopen(request, timeout=timeout_s) as resp:
            length = resp.headers.get("Inference-Header-Content-Length")
            return decode_v2_response(resp.read(), None if length is None else int(length))

    def install_network(self, bundle: Path) -> str:
        """Copy the bundle onto the board and hand it to the running agent (``edgekit-agent install``)."""
        if self.command is None:
            raise StrategyError("this board file has no SSHDriver: install over the network needs one")
        remote = f"/tmp/edgekit-hil-{bundle.name}"
        config = self.agent.config
        if isinstance(self.command, VirtualBoardDriver) and self.command.board is not None:
            remote = str(self.command.board.workdir / f"incoming-{bundle.name}")
            config = str(self.command.board.config_path)
        self.command.put(str(bundle), remote)
        python = "python3" if not isinstance(self.command, VirtualBoardDriver) else _venv_python()
        agent = "edgekit-agent" if python == "python3" else f"{shlex.quote(python)} -m device_agents.cli"
        return _text(self.command.run_check(f"{agent} install {shlex.quote(remote)} --config {shlex.quote(config)}"))

    def rss_bytes(self) -> int | None:
        """The agent's resident memory (the daemon's pid from ``daemon.json``)."""
        if isinstance(self.command, VirtualBoardDriver) and self.command.board is not None:
            return self.command.board.rss_bytes()
        if self.command is None:
            return None
        out = self.command.run_check(
            f'grep VmRSS /proc/$(python3 -c \'import json;print(json.load(open("{self.agent.store}/daemon.json"))'
            '["pid"])\')/status'
        )
        return int(_text(out).split()[1]) * 1024  # VmRSS:  123456 kB


def _text(out: Any) -> str:
    """A command's output: labgrid's SSHDriver returns a list of lines, the virtual board a string."""
    return "\n".join(out) if isinstance(out, list) else str(out)


def _venv_python() -> str:
    import sys

    return sys.executable


class Status(enum.Enum):
    unknown = 0
    off = 1
    ready = 2


@target_factory.reg_driver
@attr.s(eq=False)
class EdgekitStrategy(Strategy):  # type: ignore[misc]  # labgrid is untyped
    bindings = {"power": "PowerProtocol", "agent": "EdgekitAgentDriver"}  # noqa: RUF012  # labgrid reads it

    status: Status = attr.ib(default=Status.unknown)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.boot_s: list[float] = []  # power on -> ready, each boot

    @step(args=["status"])  # type: ignore[untyped-decorator]
    def transition(self, status: Status | str, *, step: Any) -> None:  # labgrid passes step
        wanted = status if isinstance(status, Status) else Status[status]
        if wanted is Status.unknown:
            raise StrategyError(f"can not transition to {wanted}")
        self.target.activate(self.power)
        if wanted is Status.off:
            self.power.off()
        elif wanted is Status.ready:
            if self.status is Status.ready:
                return
            self.power.off()
            started = time.monotonic()
            self.power.on()
            self.target.activate(self.agent)
            self.agent.wait_ready()
            self.boot_s.append(time.monotonic() - started)
        self.status = wanted

    def power_cut(self, *, env: Mapping[str, str] | None = None) -> float:
        """Power off and on again (``env``: the virtual board's environment for that boot, e.g. a fault
        point); returns the boot-to-ready time."""
        if env and isinstance(self.power, VirtualBoardDriver):
            self.power.next_env = dict(env)
        self.status = Status.unknown
        self.transition(Status.ready)
        return self.boot_s[-1]


def describe(status: dict[str, Any]) -> str:
    return json.dumps(status, sort_keys=True)
