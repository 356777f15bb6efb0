"""Recent inference times of one served model, for comparisons over a time window.

The self-test compares a candidate with the serving version side by side in its child; where
the child cannot hold both, it compares with what the serving version took *live* over the
same window (``p50_between``), so that load on the device weighs on both sides alike. Times
are ``time.monotonic()`` (CLOCK_MONOTONIC: the same clock in the self-test child).
"""

from __future__ import annotations

import statistics
import threading
from collections import deque

DEFAULT_KEEP = 4096


class LatencyWindow:
    """The last ``keep`` (end time, duration) pairs of ``infer`` calls; thread-safe."""

    def __init__(self, keep: int = DEFAULT_KEEP) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def record(self, end_s: float, duration_ms: float) -> None:
        with self._lock:
            self._samples.append((end_s, duration_ms))

    def p50_between(self, start_s: float, end_s: float) -> tuple[float | None, int]:
        """Median duration (ms) of the calls that ended in ``[start_s, end_s]``, and their count."""
        with self._lock:
            within = [ms for t, ms in self._samples if start_s <= t <= end_s]
        return (round(statistics.median(within), 4) if within else None), len(within)
