"""The approximate mode: a request near enough to a cached one (a camera that sees nearly the same
frame) is answered with the cached answer, and the agent measures how often that answer is wrong.

- ``signature(inputs)``: a cheap, fixed-size copy of the inputs: every numeric input, in name
  order, area-averaged down to at most ``GRID`` x ``GRID`` per channel (image-like tensors) or
  ``FLAT`` values (others), concatenated, minus its mean, scaled to unit length. Two signatures'
  distance is their cosine distance (0: the same pattern; 2: the opposite), so small shifts,
  noise and a brightness or contrast change stay close, while another scene does not.
- ``NearIndex``: per context (the exact key's header: model, version, shapes, dtypes, asked
  outputs and parameters, so only requests that would share an exact key's shape are compared),
  the signatures of the latest ``capacity`` stored answers, searched by brute force with numpy:
  one matrix-vector product. Measured on a 2-core EPYC for 192-value signatures, per query:
  1024 entries, numpy 41-63 us, hnswlib 82 us, usearch 384 us; 4096 entries, numpy 520-750 us,
  hnswlib 122 us, usearch 554 us, but hnswlib's insertion cost ~0.36 ms (paid on every miss, where
  numpy's is a row copy) and a replaced entry needs its own bookkeeping. So numpy, 1024 per context.
- ``FalseHitMeter``: of the approximate hits re-run through the model (``recheck_fraction``), the
  share whose answer differs (top-1 for a score vector, else cosine below ``DENSE_COSINE``), with
  its Wilson interval at 95% (the upper end is what /metrics shows: the rate is below it with 95%
  confidence). Once even the lower end is over the budget (the rate is over it with 95%
  confidence), the distance threshold is halved and measured afresh, and the agent says so in one
  log line.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping

import numpy as np

log = logging.getLogger("edgekit.agent")

GRID = 8  # image-like inputs: at most GRID x GRID values per channel
FLAT = 256  # other inputs: at most this many values
DENSE_COSINE = 0.96  # a dense answer agrees with a fresh one at or above this cosine (the validation gate's)
_Z95 = 1.96
MIN_RECHECKS = 10  # rechecks before the threshold may be tightened


def signature(inputs: Mapping[str, np.ndarray]) -> np.ndarray | None:
    """The unit-length signature of ``inputs`` (float32), or None when no input is numeric."""
    parts = []
    for name in sorted(inputs):
        arr = np.asarray(inputs[name])
        if arr.dtype.kind not in "biuf" or arr.size == 0:
            continue
        parts.append(_downsample(arr.astype(np.float32, copy=False)))
    if not parts:
        return None
    sig = np.concatenate(parts)
    sig -= sig.mean()
    norm = float(np.linalg.norm(sig))
    return sig / norm if norm > 0 else sig


def _downsample(arr: np.ndarray) -> np.ndarray:
    if arr.ndim >= 3 and arr.shape[-1] > 1 and arr.shape[-2] > 1:  # [..., H, W]: area means over a grid
        h, w = arr.shape[-2:]
        gh, gw = min(GRID, h), min(GRID, w)
        rows = np.array_split(np.arange(h), gh)
        cols = np.array_split(np.arange(w), gw)
        lead = arr.reshape(-1, h, w)
        cells = [lead[:, r[0] : r[-1] + 1, c[0] : c[-1] + 1].mean(axis=(1, 2)) for r in rows for c in cols]
        return np.stack(cells, axis=1).ravel()
    flat = arr.ravel()
    if flat.size <= FLAT:
        return flat.astype(np.float32)
    return np.array([chunk.mean() for chunk in np.array_split(flat, FLAT)], np.float32)


class NearIndex:
    """Signatures of stored answers by context; ``nearest`` finds the closest one. Thread-safe."""

    def __init__(self, capacity: int = 1024) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._groups: dict[bytes, _Group] = {}

    def add(self, context: bytes, sig: np.ndarray, digest: bytes) -> None:
        with self._lock:
            group = self._groups.get(context)
            if group is None:
                group = self._groups[context] = _Group(sig.size, self.capacity)
            group.add(sig, digest)

    def nearest(self, context: bytes, sig: np.ndarray) -> tuple[bytes, float] | None:
        """(digest, cosine distance) of the closest stored signature in ``context``, or None."""
        with self._lock:
            group = self._groups.get(context)
            if group is None or group.count == 0 or group.rows.shape[1] != sig.size:
                return None
            sims = group.rows[: group.count] @ sig
            i = int(np.argmax(sims))
            return group.digests[i], float(1.0 - sims[i])

    def clear(self) -> None:
        with self._lock:
            self._groups.clear()


class _Group:
    __slots__ = ("count", "digests", "next", "rows")

    def __init__(self, size: int, capacity: int) -> None:
        self.rows = np.zeros((capacity, size), np.float32)
        self.digests: list[bytes] = [b""] * capacity
        self.count = 0
        self.next = 0  # the slot the next signature takes (the oldest, once full)

    def add(self, sig: np.ndarray, digest: bytes) -> None:
        self.rows[self.next] = sig
        self.digests[self.next] = digest
        self.next = (self.next + 1) % len(self.digests)
        self.count = min(self.count + 1, len(self.digests))


def agrees(cached: Mapping[str, np.ndarray], fresh: Mapping[str, np.ndarray]) -> bool:
    """Whether a cached answer agrees with a fresh one: per output, the same top-1 for a score
    vector per sample ([N, classes]), the same items for a BYTES output (labels, text), else a
    cosine of at least ``DENSE_COSINE``."""
    for name, new in fresh.items():
        old = cached.get(name)
        if old is None or old.shape != new.shape:
            return False
        if old.dtype.kind in "OSU" or np.asarray(new).dtype.kind in "OSU":  # BYTES (labels, text): the same items
            if [_item_bytes(v) for v in np.asarray(old).ravel()] != [_item_bytes(v) for v in np.asarray(new).ravel()]:
                return False
            continue
        a, b = np.asarray(old, np.float64), np.asarray(new, np.float64)
        if a.ndim == 2:
            if not np.array_equal(a.argmax(axis=1), b.argmax(axis=1)):
                return False
            continue
        na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
        if na == 0 or nb == 0:
            if na != nb:
                return False
            continue
        if float(a.ravel() @ b.ravel()) / (na * nb) < DENSE_COSINE:
            return False
    return True


def _item_bytes(value: object) -> bytes:
    return bytes(value) if isinstance(value, bytes | np.bytes_) else str(value).encode()


def wilson(false: int, n: int, z: float = _Z95) -> tuple[float, float]:
    """The Wilson score interval (lower, upper) of a rate of ``false`` in ``n`` ((0, 1) with no samples)."""
    if n <= 0:
        return 0.0, 1.0
    p = false / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    scale = 1 + z * z / n
    return max(0.0, (centre - spread) / scale), min(1.0, (centre + spread) / scale)


class FalseHitMeter:
    """The measured false-hit rate of one endpoint's approximate hits, and its threshold."""

    def __init__(self, endpoint: str, threshold: float, budget: float) -> None:
        self.endpoint = endpoint
        self.threshold = threshold
        self.budget = budget
        self.rechecked = 0
        self.false = 0
        self._lock = threading.Lock()

    @property
    def rate(self) -> float | None:
        return self.false / self.rechecked if self.rechecked else None

    @property
    def bound(self) -> float:
        """The upper end of the rate's 95% interval."""
        return wilson(self.false, self.rechecked)[1]

    def record(self, agreed: bool) -> bool:
        """Count one recheck; True when it tightened the threshold (the rate is over the budget
        with 95% confidence: the interval's lower end is above it)."""
        with self._lock:
            self.rechecked += 1
            self.false += 0 if agreed else 1
            lower = wilson(self.false, self.rechecked)[0]
            if self.rechecked < MIN_RECHECKS or lower <= self.budget:
                return False
            old, self.threshold = self.threshold, self.threshold / 2
            rate, n, false = self.false / self.rechecked, self.rechecked, self.false
            self.rechecked = self.false = 0  # the new threshold is measured afresh
        log.warning(
            "%s: approximate cache hits were wrong in %d of %d rechecks (%.1f%%, over the %.1f%% budget with 95%% "
            "confidence); distance threshold %.4g -> %.4g",
            self.endpoint,
            false,
            n,
            100 * rate,
            100 * self.budget,
            old,
            self.threshold,
        )
        return True
