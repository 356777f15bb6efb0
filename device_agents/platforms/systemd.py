"""systemd's notify protocol (``sd_notify(3)``) with the stdlib: ``READY=1``, ``WATCHDOG=1``, ``STOPPING=1``.

Under a ``Type=notify`` unit systemd passes ``NOTIFY_SOCKET`` (a datagram socket path; a leading
``@`` means the abstract namespace) and, with ``WatchdogSec=``, ``WATCHDOG_USEC`` (and
``WATCHDOG_PID``). Without ``NOTIFY_SOCKET`` (a shell, a test, a container) every call does nothing.

The agent announces ``READY=1`` once its API listens and every installed model is loaded, then
sends ``WATCHDOG=1`` at half the watchdog interval, but only while its own v2 API answers
``/v2/health/live``: a wedged serving loop stops the pings and systemd restarts the agent.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import urllib.request
from collections.abc import Callable, MutableMapping

from device_agents.threads import NamedThread

log = logging.getLogger("edgekit.agent.systemd")

_ENV_KEYS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
_PROBE_TIMEOUT_S = 5.0


class SystemdNotifier:
    """Sends notify messages to the socket systemd gave this process (or nothing, without one)."""

    def __init__(self, socket_path: str | None, watchdog_usec: int | None = None) -> None:
        self.socket_path = socket_path or None
        self.watchdog_usec = watchdog_usec if watchdog_usec and watchdog_usec > 0 else None
        self._failed = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @classmethod
    def from_env(cls, env: MutableMapping[str, str] | None = None) -> SystemdNotifier:
        """Read and remove the notify variables, so that child processes (the self-test) do not inherit them.

        ``WATCHDOG_USEC`` counts only when ``WATCHDOG_PID`` is unset or this process's pid.
        """
        env = os.environ if env is None else env
        values = {k: env.pop(k, None) for k in _ENV_KEYS}
        usec: int | None = None
        pid = values["WATCHDOG_PID"]
        if values["WATCHDOG_USEC"] and (pid is None or pid.strip() == str(os.getpid())):
            try:
                usec = int(values["WATCHDOG_USEC"])
            except ValueError:
                log.warning("ignoring WATCHDOG_USEC=%r: not an integer", values["WATCHDOG_USEC"])
        return cls(values["NOTIFY_SOCKET"], usec)

    @property
    def enabled(self) -> bool:
        return self.socket_path is not None

    @property
    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half of ``WatchdogSec=`` (what ``sd_watchdog_enabled(3)`` advises)."""
        return None if self.watchdog_usec is None else self.watchdog_usec / 2e6

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=VALUE`` lines as one datagram; False (logged once) when it cannot be sent.

        A lost notification must not take the daemon down: systemd then restarts it on its own terms.
        """
        if self.socket_path is None:
            return False
        address = "\0" + self.socket_path[1:] if self.socket_path.startswith("@") else self.socket_path
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(address)
                sock.sendall("\n".join(assignments).encode())
        except OSError as exc:
            if not self._failed:
                log.warning("cannot notify systemd at %s: %s", self.socket_path, exc)
            self._failed = True
            return False
        return True

    def ready(self, status: str) -> None:
        """``READY=1`` with a status line."""
        self.notify("READY=1", f"STATUS={status}", f"MAINPID={os.getpid()}")

    def start_watchdog(self, alive: Callable[[], bool]) -> None:
        """Ping ``WATCHDOG=1`` every half interval while ``alive()`` is true (no-op without a watchdog)."""
        interval = self.watchdog_interval_s
        if not self.enabled or interval is None or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(interval):
                if alive():
                    self.notify("WATCHDOG=1")
                else:
                    log.warning("serving loop does not answer; withholding WATCHDOG=1")

        self._thread = NamedThread(target=loop, name="systemd-watchdog", daemon=True)
        self._thread.start()

    def stopping(self) -> None:
        """``STOPPING=1``, and the watchdog pings end."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=_PROBE_TIMEOUT_S + 1)
            self._thread = None
        self.notify("STOPPING=1")


def http_alive(url: str, timeout_s: float = _PROBE_TIMEOUT_S) -> Callable[[], bool]:
    """A probe that is true when the agent at ``url`` answers ``GET /v2/health/live`` with 200."""

    from device_agents.serving.tls import local_context_for

    context = local_context_for(url)

    def alive() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/v2/health/live", timeout=timeout_s, context=context) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    return alive


def announce_serving(url: str, status: str, env: MutableMapping[str, str] | None = None) -> SystemdNotifier:
    """``READY=1`` now, then watchdog pings while ``url`` answers; call ``.stopping()`` on shutdown."""
    notifier = SystemdNotifier.from_env(env)
    notifier.ready(status)
    notifier.start_watchdog(http_alive(url))
    return notifier
