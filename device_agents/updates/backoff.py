"""Jittered exponential backoff for reconnects and retries.

"Full jitter": each delay is drawn uniformly from ``[0, min(max_s, base_s * 2**attempt)]``.
When a broker restarts, every device of a fleet loses its connection at the same instant; drawing
the whole delay at random spreads their reconnects over the window instead of letting them
arrive in synchronised waves.
"""

from __future__ import annotations

import random


class Backoff:
    def __init__(self, base_s: float = 1.0, max_s: float = 60.0, rng: random.Random | None = None) -> None:
        if base_s <= 0 or max_s < base_s:
            raise ValueError(f"backoff needs 0 < base_s <= max_s, got {base_s} and {max_s}")
        self.base_s = base_s
        self.max_s = max_s
        self.attempt = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        """The delay before the next attempt; each call doubles the ceiling, up to ``max_s``."""
        ceiling = min(self.max_s, self.base_s * 2 ** min(self.attempt, 32))
        self.attempt += 1
        return self._rng.uniform(0.0, ceiling)

    def reset(self) -> None:
        """Call after a success: the next failure starts again from ``base_s``."""
        self.attempt = 0
