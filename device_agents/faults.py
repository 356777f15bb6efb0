"""Named fault points for crash tests: faults are injected at named places, never by sleeping and hoping.

``fault_point("switch")`` does nothing unless the environment variable ``EDGEKIT_FAULT`` is
``switch``; then the process SIGKILLs itself right there, like a power cut would stop it: no
``finally`` blocks, no atexit handlers, no flushed buffers. Tests start the agent with
``EDGEKIT_FAULT=<point>`` and check what the store looks like after the next start.
"""

from __future__ import annotations

import os
import signal
import threading
import time

FAULT_ENV = "EDGEKIT_FAULT"
STALL_ENV = "EDGEKIT_FAULT_STALL_S"  # how long a stall point blocks (default 3600 s: a hang)
STALL_ONCE_ENV = "EDGEKIT_FAULT_STALL_ONCE"  # "1": only the first pass through the point stalls
# With a counted point (``FaultCounter``): die on the Nth pass through it (default 1).
FAULT_AT_ENV = "EDGEKIT_FAULT_AT"

# Where each point sits: see Lifecycle.install (stage..cleanup), the self-test child
# (selftest_child) and the update client (download).
FAULT_POINTS = ("verify", "stage", "selftest", "selftest_child", "switch", "commit", "cleanup", "download")
# Counted points: one name covers many places that write (``FaultCounter``); ``cache_write`` is
# every step of a result-cache write (device_agents/cache/store.py).
COUNTED_POINTS = ("cache_write",)
# Stall points block instead of killing: ``infer_stall`` sits just before the runtime call of a
# batch (pipeline/batching.py), to make a call slow (drain tests) or hang (hung-call detection).
STALL_POINTS = ("infer_stall",)
_stalled: set[str] = set()
_stall_lock = threading.Lock()
# Misbehaviours a test can switch on the same way (``EDGEKIT_FAULT=<name>``); the code at the
# point does what the name says instead of dying. ``selftest_flood``: the self-test child starts
# grandchildren (one in a session of its own) and floods its stdout and stderr, forever.
# ``selftest_double_fork``: the self-test child starts a helper that double-forks a sleeper into a
# session of its own (out of its process group and parent chain), then goes on with the test; the
# sleeper's pid is appended to the file named by ``EDGEKIT_FAULT_PID_FILE``.
FAULT_BEHAVIOURS = ("selftest_flood", "selftest_double_fork")
PID_FILE_ENV = "EDGEKIT_FAULT_PID_FILE"


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL if ``EDGEKIT_FAULT`` names this point."""
    if name not in FAULT_POINTS:
        raise ValueError(f"unknown fault point {name!r}; add it to FAULT_POINTS ({', '.join(FAULT_POINTS)})")
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


class FaultCounter:
    """A counted fault point: ``EDGEKIT_FAULT=<name> EDGEKIT_FAULT_AT=N`` SIGKILLs the process on
    the Nth pass through any place that calls ``hit()``, so a test can stop a writer after each
    of its write steps in turn (N = 1, 2, ...), counted, never timed. Built once per object that
    writes (the environment is read then); ``armed`` is False when the variable names another point,
    and ``hit`` is then never worth calling."""

    def __init__(self, name: str) -> None:
        if name not in COUNTED_POINTS:
            known = ", ".join(COUNTED_POINTS)
            raise ValueError(f"unknown counted fault point {name!r}; add it to COUNTED_POINTS ({known})")
        self.armed = os.environ.get(FAULT_ENV) == name
        self.left = int(os.environ.get(FAULT_AT_ENV, "1")) if self.armed else 0
        self._lock = threading.Lock()

    def hit(self) -> None:
        if not self.armed:
            return
        with self._lock:
            self.left -= 1
            if self.left <= 0:
                os.kill(os.getpid(), signal.SIGKILL)


def stall_point(name: str) -> None:
    """Block for ``EDGEKIT_FAULT_STALL_S`` seconds if ``EDGEKIT_FAULT`` names this point."""
    if name not in STALL_POINTS:
        raise ValueError(f"unknown stall point {name!r}; add it to STALL_POINTS ({', '.join(STALL_POINTS)})")
    if os.environ.get(FAULT_ENV) != name:
        return
    if os.environ.get(STALL_ONCE_ENV) == "1":
        with _stall_lock:
            if name in _stalled:
                return
            _stalled.add(name)
    time.sleep(float(os.environ.get(STALL_ENV, "3600")))


def stall_armed(name: str) -> bool:
    """Whether ``EDGEKIT_FAULT`` names stall point ``name`` now. A hot path reads it once (when its
    object is built) and calls ``stall_point`` only if armed: an environment look-up costs ~1-2 us,
    a share of a small request's whole budget."""
    if name not in STALL_POINTS:
        raise ValueError(f"unknown stall point {name!r}; add it to STALL_POINTS ({', '.join(STALL_POINTS)})")
    return os.environ.get(FAULT_ENV) == name


def fault_active(name: str) -> bool:
    """True if ``EDGEKIT_FAULT`` names this misbehaviour."""
    if name not in FAULT_BEHAVIOURS:
        known = ", ".join(FAULT_BEHAVIOURS)
        raise ValueError(f"unknown fault behaviour {name!r}; add it to FAULT_BEHAVIOURS ({known})")
    return os.environ.get(FAULT_ENV) == name
