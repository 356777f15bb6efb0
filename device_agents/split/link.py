"""The link to the tail as the device sees it: RTT and bandwidth, each an EWMA.

RTT samples come from light probes (``GET /v2/health/ready``: a few hundred bytes each way).
Bandwidth samples come from every split request and from the probe's small infer: the bytes sent
and received over the time left once the RTT and the tail's compute are taken off; a transfer
too quick to tell from noise (under ``MIN_TRANSFER_MS``) is counted as taking that long (a lower
bound on the bandwidth, so that a fast link is never read as a slow one).
"""

from __future__ import annotations

import threading

MIN_TRANSFER_MS = 0.05
MAX_BANDWIDTH_MBPS = 100_000.0


class LinkEstimate:
    def __init__(self, *, alpha: float, bandwidth_mbps: float, rtt_ms: float | None = None) -> None:
        self.alpha = alpha
        self.bandwidth_mbps = bandwidth_mbps
        self.rtt_ms = rtt_ms  # None until the first probe
        self.samples = 0
        self._lock = threading.Lock()

    def observe_rtt(self, rtt_ms: float) -> None:
        with self._lock:
            self.rtt_ms = rtt_ms if self.rtt_ms is None else self._mix(self.rtt_ms, rtt_ms)

    def observe_transfer(self, size_bytes: int, elapsed_ms: float, server_ms: float) -> float:
        """One request: ``size_bytes`` both ways in ``elapsed_ms`` of which ``server_ms`` computing.
        Returns the bandwidth sample (Mbit/s)."""
        rtt = self.rtt_ms if self.rtt_ms is not None else 0.0
        transfer_ms = max(MIN_TRANSFER_MS, elapsed_ms - rtt - server_ms)
        sample = min(MAX_BANDWIDTH_MBPS, size_bytes * 8.0 / (transfer_ms * 1000.0))
        with self._lock:
            self.bandwidth_mbps = sample if self.samples == 0 else self._mix(self.bandwidth_mbps, sample)
            self.samples += 1
        return sample

    def transfer_ms(self, size_bytes: int) -> float:
        return size_bytes * 8.0 / (self.bandwidth_mbps * 1000.0)

    def _mix(self, old: float, new: float) -> float:
        return (1.0 - self.alpha) * old + self.alpha * new
