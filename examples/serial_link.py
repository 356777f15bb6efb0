"""A null-modem cable between two real ttys: two pty pairs whose master sides are joined by a thread.

``with NullModem() as link:`` gives ``link.device_port`` (a ``/dev/pts/N`` for the agent's
``[console] device``) and ``link.host_port`` (another ``/dev/pts/M`` for the host client, pyserial
or labgrid): each end is opened by path as a real tty, as a USB gadget port or a UART would be.
Both slave sides are held open in raw mode for the cable's lifetime (no echo before an end opens
it; no EIO on the master when an end closes and opens again).

Fault injection at a named point: ``link.corrupt_next(direction, byte_index)`` flips one byte of
the next chunk relayed ``"to_device"`` or ``"to_host"``; ``link.drop_next(direction)`` drops it.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import tty
from types import TracebackType
from typing import Literal

Direction = Literal["to_device", "to_host"]


class NullModem:
    def __init__(self) -> None:
        self._device_master, self._device_slave = os.openpty()
        self._host_master, self._host_slave = os.openpty()
        for fd in (self._device_slave, self._host_slave):
            tty.setraw(fd)
        self.device_port = os.ttyname(self._device_slave)
        self.host_port = os.ttyname(self._host_slave)
        self.relayed = {"to_device": 0, "to_host": 0}  # bytes carried each way
        self._faults: dict[Direction, tuple[str, int]] = {}
        self._lock = threading.Lock()
        self._stop_r, self._stop_w = os.pipe()
        self._thread = threading.Thread(target=self._relay, name="null-modem", daemon=True)

    def __enter__(self) -> NullModem:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def corrupt_next(self, direction: Direction, byte_index: int = 0) -> None:
        """Flip byte ``byte_index`` (modulo its length) of the next chunk carried ``direction``."""
        with self._lock:
            self._faults[direction] = ("corrupt", byte_index)

    def drop_next(self, direction: Direction) -> None:
        with self._lock:
            self._faults[direction] = ("drop", 0)

    def close(self) -> None:
        if self._thread.is_alive():
            os.write(self._stop_w, b"x")
            self._thread.join(5)
        for fd in (
            self._device_master,
            self._device_slave,
            self._host_master,
            self._host_slave,
            self._stop_r,
            self._stop_w,
        ):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _relay(self) -> None:
        routes: dict[int, tuple[int, Direction]] = {
            self._host_master: (self._device_master, "to_device"),
            self._device_master: (self._host_master, "to_host"),
        }
        while True:
            ready, _, _ = select.select([*routes, self._stop_r], [], [])
            if self._stop_r in ready:
                return
            for fd in ready:
                try:
                    data = os.read(fd, 65536)
                except OSError:  # EIO: no end holds the slave open (cannot happen while we hold it)
                    continue
                target, direction = routes[fd]
                with self._lock:
                    fault = self._faults.pop(direction, None)
                if fault is not None and fault[0] == "drop":
                    continue
                if fault is not None:
                    damaged = bytearray(data)
                    damaged[fault[1] % len(damaged)] ^= 0x5A
                    data = bytes(damaged)
                self.relayed[direction] += len(data)
                view = memoryview(data)
                while view:
                    written = os.write(target, view)
                    view = view[written:]
