"""``Slots``: a counting semaphore whose acquire and release are C calls.

``threading.BoundedSemaphore`` is Python around a ``Condition``: an uncontended acquire and
release cost ~4 us (2-core x86_64 VM), a request's worth of parsing. A ``queue.SimpleQueue`` of tokens (C)
does the same job in ~0.4 us: ``acquire`` takes a token (waiting up to its timeout for one),
``release`` puts it back. Waiters are served in arrival order.
"""

from __future__ import annotations

import queue


class Slots:
    """``capacity`` slots. Every ``acquire`` that returned True is paired with one ``release``."""

    __slots__ = ("_tokens", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"slots need a capacity of at least 1, got {capacity}")
        self.capacity = capacity
        self._tokens: queue.SimpleQueue[None] = queue.SimpleQueue()
        for _ in range(capacity):
            self._tokens.put(None)

    def acquire(self, timeout: float) -> bool:
        """Take a slot, waiting up to ``timeout`` seconds for one; False if none came free."""
        try:
            self._tokens.get(timeout=timeout)
        except queue.Empty:
            return False
        return True

    def release(self) -> None:
        self._tokens.put(None)

    def free(self) -> int:
        """Slots free now (a snapshot)."""
        return self._tokens.qsize()
