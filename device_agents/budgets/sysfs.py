"""Reading sysfs-style one-value files under a root (``/`` on a device, a fixture tree in tests).

A reader built on these is either available or not: a file that is missing, unreadable or holds
a garbage value makes ``read_int`` return None, and the reader logs it once (``LogOnce``) and
goes on without that value. Nothing here raises on what the kernel (or a broken driver) left.
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger("edgekit.agent")


def read_text(path: Path) -> str | None:
    """The stripped content of ``path``, or None when it is missing or unreadable."""
    try:
        return path.read_text(encoding="ascii", errors="strict").strip()
    except (OSError, UnicodeDecodeError):
        return None


def read_int(path: Path) -> int | None:
    """The integer in ``path``, or None (missing, unreadable, not an integer)."""
    text = read_text(path)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        return None


def under(root: Path | str, absolute: str) -> Path:
    """``absolute`` (e.g. ``/sys/class/thermal``) inside ``root``."""
    return Path(root) / absolute.lstrip("/")


class LogOnce:
    """Logs each distinct problem of one reader once (a sensor polled every second that is gone
    would otherwise fill the journal)."""

    __slots__ = ("_seen",)

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def warn(self, message: str) -> None:
        if message not in self._seen:
            self._seen.add(message)
            log.warning("%s", message)
