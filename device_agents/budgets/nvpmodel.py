"""The Jetson power mode (``nvpmodel``): the modes ``/etc/nvpmodel.conf`` defines, the one in
force (``/var/lib/nvpmodel/status``, else what ``nvpmodel -q`` reports), and setting one.

Read-only unless the operator configured a mode (``[budgets] nvpmodel_mode``): the mode changes
the clocks and the power of the whole board, so the agent changes it only when told to.
The configuration file holds lines such as::

    < POWER_MODEL ID=0 NAME=MAXN >
    < PM_CONFIG DEFAULT=2 >
"""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from device_agents.budgets.sysfs import read_text, under
from edgekit.bundle.errors import EdgekitError

log = logging.getLogger("edgekit.agent")

_MODEL = re.compile(r"<\s*POWER_MODEL\s+ID=(\d+)\s+NAME=([^\s>]+)")
_DEFAULT = re.compile(r"<\s*PM_CONFIG\s+DEFAULT=(\d+)")
_STATUS = re.compile(r"pmode:(\d+)")
_QUERY = re.compile(r"NV Power Mode:\s*(\S+)\s*\n\s*(\d+)")
_TOOL_TIMEOUT_S = 10.0


class PowerModeError(EdgekitError):
    """The configured power mode does not exist on this board, or nvpmodel could not set it."""


@dataclass(frozen=True)
class PowerMode:
    modes: dict[int, str]  # id -> name, from /etc/nvpmodel.conf
    default_id: int | None
    current_id: int | None
    source: str  # where current_id came from: "status file", "nvpmodel -q", ""

    @property
    def current_name(self) -> str | None:
        return None if self.current_id is None else self.modes.get(self.current_id, f"mode {self.current_id}")


class NvpModel:
    name = "nvpmodel"

    def __init__(self, root: Path, conf: Path, tool: Path | None) -> None:
        self.root, self.conf, self.tool = root, conf, tool

    @classmethod
    def probe(cls, root: Path | str = "/") -> NvpModel | None:
        root = Path(root)
        conf = under(root, "/etc/nvpmodel.conf")
        if not conf.is_file():
            return None
        tool: Path | None = under(root, "/usr/sbin/nvpmodel")
        if tool is not None and not tool.is_file():
            found = shutil.which("nvpmodel") if root == Path("/") else None
            tool = Path(found) if found else None
        return cls(root, conf, tool)

    def read(self) -> PowerMode:
        text = read_text(self.conf) or ""
        modes = {int(i): name for i, name in _MODEL.findall(text)}
        default = _DEFAULT.search(text)
        default_id = int(default.group(1)) if default else None
        status = read_text(under(self.root, "/var/lib/nvpmodel/status"))
        m = _STATUS.search(status or "")
        if m is not None:
            return PowerMode(modes, default_id, int(m.group(1)), "status file")
        query = self._run("-q")
        q = _QUERY.search(query or "")
        if q is not None:
            return PowerMode(modes, default_id, int(q.group(2)), "nvpmodel -q")
        return PowerMode(modes, default_id, None, "")

    def set_mode(self, mode_id: int) -> PowerMode:
        """Switch to ``mode_id`` (``nvpmodel -m``) unless it is in force already; the mode after."""
        before = self.read()
        if mode_id not in before.modes:
            known = ", ".join(f"{i} ({n})" for i, n in sorted(before.modes.items())) or "none"
            raise PowerModeError(
                f"budgets.nvpmodel_mode = {mode_id}: {self.conf} defines no such mode (modes: {known}); "
                "pick one of them"
            )
        if before.current_id == mode_id:
            return before
        if self.tool is None:
            raise PowerModeError(
                f"budgets.nvpmodel_mode = {mode_id}: the nvpmodel tool is not installed; install it (JetPack) "
                "or remove nvpmodel_mode"
            )
        if self._run("-m", str(mode_id)) is None:
            raise PowerModeError(f"nvpmodel -m {mode_id} failed (see the log); the mode stays {before.current_name}")
        after = self.read()
        log.info("nvpmodel: power mode %s -> %s", before.current_name, after.current_name)
        return after

    def _run(self, *args: str) -> str | None:
        if self.tool is None:
            return None
        try:
            done = subprocess.run(
                [str(self.tool), *args], capture_output=True, text=True, timeout=_TOOL_TIMEOUT_S, check=False
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("nvpmodel %s: %s", " ".join(args), exc)
            return None
        if done.returncode != 0:
            log.warning("nvpmodel %s exited %d: %s", " ".join(args), done.returncode, done.stderr.strip()[-300:])
            return None
        return done.stdout
