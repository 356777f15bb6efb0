"""A systemd ``NOTIFY_SOCKET`` stand-in: a real AF_UNIX datagram socket that collects messages."""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path


class NotifyListener:
    """Binds a datagram socket at ``path`` (mode 0666, so a process of another user can send)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        os.chmod(path, 0o666)
        self.messages: list[dict[str, str]] = []

    def wait_for(self, key: str, value: str, timeout_s: float = 60.0) -> dict[str, str]:
        """The first message (already received or arriving within ``timeout_s``) with ``key=value``."""
        for msg in self.messages:
            if msg.get(key) == value:
                return msg
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                break
            msg = dict(line.split("=", 1) for line in data.decode().splitlines() if "=" in line)
            self.messages.append(msg)
            if msg.get(key) == value:
                return msg
        raise AssertionError(f"no {key}={value} within {timeout_s} s; got {self.messages}")

    def close(self) -> None:
        self.sock.close()
        self.path.unlink(missing_ok=True)
