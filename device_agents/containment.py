"""Keeping a child process's descendants from outliving it (the self-test child's runtime helpers).

A process group does not hold them: a helper that double-forks and calls ``setsid`` leaves both
the group and the parent chain (it is re-parented to init), so neither ``killpg`` nor a walk of
the child's descendants finds it. Two ways that do, best first:

- **cgroup**: a cgroup v2 of the child's own, ``edgekit-selftest-*`` beside the agent's own
  cgroup, where the agent may make one (root, or a delegated subtree). Every descendant is born
  in it whatever it does; ``cgroup.kill`` (Linux 5.14+; else freeze, kill each, thaw) ends them
  all at once, and the empty cgroup is removed.
- **subreaper**: the child makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``), so an
  orphaned descendant is re-parented to it instead of init and stays in its tree, where the
  parent (``stop_tree``: stop them all, then kill them) and the child itself (before it exits)
  find it. A helper of a child that *crashes* is re-parented to init; the parent's own record of
  the descendants it saw (``ContainedChild``) still kills those it saw.

``containment`` (``[selftest] containment``): ``"auto"`` tries the cgroup and falls back to the
subreaper; ``"cgroup"`` requires the cgroup; ``"subreaper"`` never makes one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import time
import uuid
from pathlib import Path
from typing import Any

from device_agents.threads import _prctl as libc_prctl  # the process's own prctl, found once

log = logging.getLogger("edgekit.agent")

CONTAINMENTS = ("auto", "cgroup", "subreaper")
CGROUP_ENV = "EDGEKIT_SELFTEST_CGROUP"  # the child joins the cgroup named here before anything else
CGROUP_PREFIX = "edgekit-selftest-"
_PR_SET_CHILD_SUBREAPER = 36
_POLL_S = 0.01


def cgroup2_mount(mountinfo: str | None = None) -> Path | None:
    """Where the cgroup v2 hierarchy is mounted (``/sys/fs/cgroup``, or ``/sys/fs/cgroup/unified``
    on a hybrid system), or None."""
    try:
        text = mountinfo if mountinfo is not None else Path("/proc/self/mountinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        head, _, tail = line.partition(" - ")
        if tail.split(" ", 1)[0] == "cgroup2":
            return Path(head.split(" ")[4])
    return None


def own_cgroup() -> str | None:
    """This process's cgroup v2 path (``0::/system.slice/x.service`` -> that path), or None."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    return next((line[3:] for line in lines if line.startswith("0::")), None)


class Cgroup:
    """A cgroup v2 made for one child and removed after it."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    def create(cls) -> tuple[Cgroup | None, str]:
        """A new empty cgroup beside this process's own, or (None, why not)."""
        mount, own = cgroup2_mount(), own_cgroup()
        if mount is None or own is None:
            return None, "no cgroup v2 hierarchy is mounted"
        base = mount / own.lstrip("/")
        _remove_stale(base)
        path = base / f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            path.mkdir()
        except OSError as exc:
            return None, f"cannot make a cgroup under {base} ({exc.strerror or exc})"
        return cls(path), ""

    def add(self, pid: int) -> None:
        """Move ``pid`` in (``OSError`` when the kernel refuses: not delegated, controllers on)."""
        (self.path / "cgroup.procs").write_text(str(pid))

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except (OSError, ValueError):
            return []

    def kill(self, wait_s: float = 2.0) -> None:
        """SIGKILL every process in it, those being forked included; wait (briefly) until it is empty."""
        try:
            (self.path / "cgroup.kill").write_text("1")
        except OSError:  # before Linux 5.14: freeze, so nothing forks while each is killed
            with contextlib.suppress(OSError):
                (self.path / "cgroup.freeze").write_text("1")
            for pid in self.pids():
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(OSError):
                (self.path / "cgroup.freeze").write_text("0")  # killed tasks die once thawed
        deadline = time.monotonic() + wait_s
        while self.pids() and time.monotonic() < deadline:
            time.sleep(_POLL_S)

    def remove(self) -> None:
        """rmdir, once its last process is gone (a zombie not yet reaped still counts)."""
        deadline = time.monotonic() + 2.0
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() >= deadline:
                    log.warning("self-test cgroup %s is not empty yet; removed with the next one", self.path)
                    return
                time.sleep(_POLL_S)


def _remove_stale(base: Path) -> None:
    """Remove the empty ``edgekit-selftest-<pid>-*`` cgroups of agents no longer running (killed
    before they cleaned up); a running agent's are left alone, even empty (one just made, its
    child not in it yet), and rmdir refuses one that still holds a process."""
    with contextlib.suppress(OSError):
        for old in base.glob(f"{CGROUP_PREFIX}*"):
            owner = old.name.removeprefix(CGROUP_PREFIX).split("-", 1)[0]
            if owner.isdigit() and not _running(int(owner)):
                with contextlib.suppress(OSError):
                    old.rmdir()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's
    return True


def become_subreaper() -> bool:
    """Make this process a child subreaper (Linux 3.4+); False where it cannot."""
    prctl = libc_prctl()
    return prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def join_cgroup_from_env() -> Cgroup | None:
    """In the child, first thing: join the cgroup the parent made (it moves us too; whichever is
    first, nothing we start is born outside it). Returns it, or None."""
    path = os.environ.pop(CGROUP_ENV, "")
    if not path:
        return None
    cgroup = Cgroup(Path(path))
    with contextlib.suppress(OSError):
        cgroup.add(os.getpid())
    return cgroup


def stop_tree(root: Any) -> list[Any]:
    """SIGSTOP ``root`` (a psutil.Process) and every descendant, scanning again until a scan finds
    no new one (a process stopped mid-fork leaves a running child), so that nothing forks or dies
    (re-parenting its children out of the tree) while they are killed. Returns them, root first."""
    import psutil

    stopped: dict[int, Any] = {}
    for _ in range(16):
        try:
            found = [root, *root.children(recursive=True)]
        except psutil.Error:
            break
        new = [p for p in found if p.pid not in stopped]
        if not new:
            break
        for p in new:
            with contextlib.suppress(psutil.Error):
                p.suspend()
            stopped[p.pid] = p
    return list(stopped.values())


def kill_all(processes: list[Any]) -> None:
    """SIGKILL each (psutil.Process: a pid reused since is left alone), descendants before ``processes[0]``."""
    import psutil

    for p in [*processes[1:], *processes[:1]]:
        with contextlib.suppress(psutil.Error):
            p.kill()
