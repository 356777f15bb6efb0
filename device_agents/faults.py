"""Named fault points for crash tests (house rule 9).

``fault_point("switch")`` does nothing unless the environment variable ``EDGEKIT_FAULT`` is
``switch``; then the process SIGKILLs itself right there, like a power cut would stop it: no
``finally`` blocks, no atexit handlers, no flushed buffers. Tests start the agent with
``EDGEKIT_FAULT=<point>`` and check what the store looks like after the next start.
"""

from __future__ import annotations

import os
import signal

FAULT_ENV = "EDGEKIT_FAULT"

# Where each point sits: see ModelManager.install (stage..cleanup), the self-test child
# (selftest_child) and the update client (download).
FAULT_POINTS = ("verify", "stage", "selftest", "selftest_child", "switch", "commit", "cleanup", "download")
# Misbehaviours a test can switch on the same way (``EDGEKIT_FAULT=<name>``); the code at the
# point does what the name says instead of dying. ``selftest_flood``: the self-test child starts
# grandchildren (one in a session of its own) and floods its stdout and stderr, forever.
FAULT_BEHAVIOURS = ("selftest_flood",)


def fault_point(name: str) -> None:
    """Kill this process with SIGKILL if ``EDGEKIT_FAULT`` names this point."""
    if name not in FAULT_POINTS:
        raise ValueError(f"unknown fault point {name!r}; add it to FAULT_POINTS ({', '.join(FAULT_POINTS)})")
    if os.environ.get(FAULT_ENV) == name:
        os.kill(os.getpid(), signal.SIGKILL)


def fault_active(name: str) -> bool:
    """True if ``EDGEKIT_FAULT`` names this misbehaviour."""
    if name not in FAULT_BEHAVIOURS:
        known = ", ".join(FAULT_BEHAVIOURS)
        raise ValueError(f"unknown fault behaviour {name!r}; add it to FAULT_BEHAVIOURS ({known})")
    return os.environ.get(FAULT_ENV) == name
