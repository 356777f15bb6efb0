"""Side-by-side latency: candidates and the FP32 baseline run interleaved in one loop, so drift in
machine load hits all of them alike; medians over the repeats.

Used by the packager and by targets choosing among candidates. Not a test: nothing asserts on
these numbers; they are measured and recorded.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LatencyStats:
    """Per-call milliseconds of one function in a side-by-side run: median, p90, interquartile range."""

    p50_ms: float
    p90_ms: float
    iqr_ms: float
    calls: int
    p25_ms: float = 0.0
    p75_ms: float = 0.0


def p50_side_by_side(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int = 20,
    warmup: int = 2,
    budget_s: float = 5.0,
    min_repeats: int = 5,
    block: int = 10,
) -> dict[str, float]:
    """Median milliseconds per call of each function (``stats_side_by_side``'s p50)."""
    stats = stats_side_by_side(
        fns, repeats=repeats, warmup=warmup, budget_s=budget_s, min_repeats=min_repeats, block=block
    )
    return {n: s.p50_ms for n, s in stats.items()}


def stats_side_by_side(
    fns: Mapping[str, Callable[[], object]],
    *,
    repeats: int = 20,
    warmup: int = 2,
    budget_s: float = 5.0,
    min_repeats: int = 5,
    block: int = 10,
    discard: int = 0,
) -> dict[str, LatencyStats]:
    """p50, p90 and IQR milliseconds per call of each function, measured interleaved in blocks.

    Each round calls every function ``discard + block`` times in a row, in a shuffled order (a
    fixed seed: the same orders every run), and times the last ``block``. Shuffled, not rotated:
    a rotation keeps each function's neighbours, so one always ran right after the same other
    runtime (the same ONNX Runtime FP32 graph measured 15.7 and 23.5 ms in one rotated loop with
    OpenVINO sides on a loaded 2-core host; 7.0 and 7.0 ms alone). Blocks rather than single calls: alternating runtimes
    call by call penalises the one whose worker threads sleep between calls (OpenVINO measured
    3.5 ms interleaved with ONNX Runtime per call, 0.42 ms alone, on this 2-core machine); a
    discarded first call absorbs the previous runtime's threads still spinning (the optimisation
    engine discards one). Stops after ``repeats`` rounds, or after ``min_repeats`` rounds once
    ``budget_s`` is spent.
    """
    names = list(fns)
    if not names:
        return {}
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    start = time.perf_counter()
    shuffle = random.Random(0).shuffle
    for r in range(repeats):
        order = list(names)
        shuffle(order)
        for name in order:
            fn, out = fns[name], times[name]
            for _ in range(discard):
                fn()
            for _ in range(block):
                t0 = time.perf_counter()
                fn()
                out.append(time.perf_counter() - t0)
        if r + 1 >= min_repeats and time.perf_counter() - start > budget_s:
            break
    return {n: _stats(v) for n, v in times.items()}


def _stats(values: list[float]) -> LatencyStats:
    ms = sorted(v * 1000.0 for v in values)
    q1, q3 = _quantile(ms, 0.25), _quantile(ms, 0.75)
    return LatencyStats(
        p50_ms=_quantile(ms, 0.5), p90_ms=_quantile(ms, 0.9), iqr_ms=q3 - q1, calls=len(ms), p25_ms=q1, p75_ms=q3
    )


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default), on sorted values."""
    pos = (len(sorted_values) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def call_with(fn: Callable[[Any], object], feed: Any) -> Callable[[], object]:
    """``fn(feed)`` as a no-argument callable, for ``p50_side_by_side``."""
    return lambda: fn(feed)
