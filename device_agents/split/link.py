"""The link to the tail as the device sees it: RTT and bandwidth estimates.

RTT: samples from light probes (``GET /v2/health/ready``: a few hundred bytes each way); the
estimate is their EWMA (queueing behind bulk transfers included: a real cost of each request),
and ``base_rtt_ms`` the least of the last ``BASE_RTT_SAMPLES`` (the path's own delay).

Bandwidth: samples from every split request and from the probes' small infers: the bytes sent and
received over the time left once the base RTT and the tail's compute are taken off. A transfer
too quick to tell from noise (under ``MIN_TRANSFER_MS``) counts as taking that long (a lower
bound, so a fast link is never read as a slow one). The estimate is an EWMA of log(bandwidth):
links span 1 to 10000 Mbit/s, and a drop from 1000 to 1 must show within a few requests (a plain
EWMA would stay near 700, then 490, ...), as must the way back up.
"""

from __future__ import annotations

import math
import threading
from collections import deque

MIN_TRANSFER_MS = 0.05
MAX_BANDWIDTH_MBPS = 100_000.0
BASE_RTT_SAMPLES = 20


class LinkEstimate:
    def __init__(self, *, alpha: float, bandwidth_mbps: float, rtt_ms: float | None = None) -> None:
        self.alpha = alpha
        self._log_bw = math.log(bandwidth_mbps)
        self.rtt_ms = rtt_ms  # None until the first probe
        self._rtts: deque[float] = deque(maxlen=BASE_RTT_SAMPLES)
        self.samples = 0
        self._lock = threading.Lock()

    @property
    def bandwidth_mbps(self) -> float:
        return math.exp(self._log_bw)

    @bandwidth_mbps.setter
    def bandwidth_mbps(self, value: float) -> None:
        self._log_bw = math.log(value)

    @property
    def base_rtt_ms(self) -> float:
        return min(self._rtts) if self._rtts else 0.0

    def observe_rtt(self, rtt_ms: float) -> None:
        with self._lock:
            self._rtts.append(rtt_ms)
            self.rtt_ms = rtt_ms if self.rtt_ms is None else self._mix(self.rtt_ms, rtt_ms)

    def observe_transfer(self, size_bytes: int, elapsed_ms: float, server_ms: float) -> float:
        """One request: ``size_bytes`` both ways in ``elapsed_ms`` of which ``server_ms`` computing.
        Returns the bandwidth sample (Mbit/s)."""
        transfer_ms = max(MIN_TRANSFER_MS, elapsed_ms - self.base_rtt_ms - server_ms)
        sample = min(MAX_BANDWIDTH_MBPS, size_bytes * 8.0 / (transfer_ms * 1000.0))
        with self._lock:
            self._log_bw = self._mix(self._log_bw, math.log(sample))
            self.samples += 1
        return sample

    def transfer_ms(self, size_bytes: int) -> float:
        return size_bytes * 8.0 / (self.bandwidth_mbps * 1000.0)

    def _mix(self, old: float, new: float) -> float:
        return (1.0 - self.alpha) * old + self.alpha * new
