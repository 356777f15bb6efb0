"""OS names for the agent's threads: ``top -H``, ``ps -L`` and ``/proc/<pid>/task/*/comm`` then say
which thread takes a device's CPU.

Python 3.11 names threads for Python only; to the OS every thread is the process (``python3``).
Linux keeps 15 bytes of a thread's name (``prctl(PR_SET_NAME)``), and a thread that C or C++ code
starts inherits the name of the thread that started it: a model's runner is built under
``rt-<model>``, so the worker threads ONNX Runtime (and LiteRT, OpenVINO, where they start them
then) creates with the session carry the model's name. The names the agent uses:

- ``http``: the accept loop; ``http-conn``: a connection's thread (one per open connection)
- ``infer-<model>``: a model's batch worker (it also runs its share of the runtime's work)
- ``rt-<model>``: the runtime's own threads (ONNX Runtime's intra-op pool: spinning shows here)
- ``hung-<model>``, ``health-<model>``, ``mqtt``, ``updates``, ``update-<model>``,
  ``verify-at-rest``, ``systemd-watchdog``: watchdogs, timers and the update client

Elsewhere (macOS, Windows) nothing is named: the calls do nothing. ``ThreadCpu.read`` sums a
process's CPU by thread name (``edgekit-agent stats`` prints it as cores by thread).
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path

_PR_SET_NAME = 15
_PR_GET_NAME = 16
_NAME_BYTES = 15  # the kernel keeps 16 with the NUL
_PREFIX = "edgekit-"  # the Python names' prefix, left out of the OS's 15 bytes


@cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        # the process's own symbols (libc's among them): no find_library, which runs ldconfig
        fn: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return fn


def os_name_for(name: str) -> bytes:
    """What the OS keeps of the Python thread name ``name``."""
    return name.removeprefix(_PREFIX).encode("utf-8", "replace")[:_NAME_BYTES]


def set_os_name(name: str) -> None:
    """Name the calling thread ``name`` for the OS (its first 15 bytes; an ``edgekit-`` prefix left out)."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(os_name_for(name)), 0, 0, 0)


def os_name() -> str | None:
    """The calling thread's OS name; ``None`` where threads have none here."""
    prctl = _prctl()
    if prctl is None:
        return None
    buf = ctypes.create_string_buffer(_NAME_BYTES + 1)
    if prctl(_PR_GET_NAME, buf, 0, 0, 0) != 0:
        return None
    return buf.value.decode("utf-8", "replace")


@contextmanager
def os_named(name: str) -> Iterator[None]:
    """The calling thread is ``name`` to the OS inside the block (threads started there inherit it)."""
    before = os_name()
    set_os_name(name)
    try:
        yield
    finally:
        if before is not None:
            set_os_name(before)


class NamedThread(threading.Thread):
    """A thread whose OS name is its Python ``name``."""

    def run(self) -> None:
        set_os_name(self.name)
        super().run()


class NamedTimer(NamedThread, threading.Timer):
    """``threading.Timer`` whose thread has its ``name`` as its OS name (``NamedThread.run``, then the timer's)."""


ENDED = "ended threads"  # CPU of threads that ended between two readings (mostly connections)


@dataclass(frozen=True)
class ThreadCpu:
    """One reading of a process's CPU seconds (user + system): in all, and its live threads' by OS name."""

    total_s: float  # the process's, threads that ended included
    by_name: dict[str, float]

    @classmethod
    def read(cls, pid: int) -> ThreadCpu | None:
        """Read ``/proc/<pid>``; None where there is no such thing (not Linux, the process is gone)."""
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        try:
            total = _cpu_ticks(Path(f"/proc/{pid}/stat").read_text()) / tick
            tasks = list(Path(f"/proc/{pid}/task").iterdir())
        except (OSError, ValueError, IndexError):
            return None
        by_name: dict[str, float] = {}
        for task in tasks:
            try:
                name = (task / "comm").read_text().strip()
                spent = _cpu_ticks((task / "stat").read_text()) / tick
            except (OSError, ValueError, IndexError):
                continue  # it ended meanwhile
            by_name[name] = by_name.get(name, 0.0) + spent
        return cls(total, by_name)

    def since(self, earlier: ThreadCpu) -> dict[str, float]:
        """CPU seconds by thread name between ``earlier`` and this reading; what the threads alive
        now do not account for (threads that ended meanwhile: connections, timers) as ``ENDED``."""
        spent = {n: s - earlier.by_name.get(n, 0.0) for n, s in self.by_name.items()}
        spent = {n: s for n, s in spent.items() if s > 0}
        rest = self.total_s - earlier.total_s - sum(spent.values())
        if rest > 0:
            spent[ENDED] = rest
        return spent


def _cpu_ticks(stat: str) -> int:
    fields = stat.rsplit(")", 1)[1].split()  # past the name, which may hold spaces and parentheses
    return int(fields[11]) + int(fields[12])  # utime, stime
