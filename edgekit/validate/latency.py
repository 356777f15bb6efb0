"""Side-by-side latency: candidates and the FP32 baseline run interleaved in one loop, so drift in
machine load hits all of them alike; medians over the repeats.

Used by the packager and by targets choosing among candidates. Not a test: nothing asserts on
these numbers; they are measured and recorded.
"""

from __future__ import annotations

import dataclasses
import math
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
    # per round of a side-by-side run, the median of that round's block: rounds of the functions of
    # one run are paired by index (``speedup_interval``); empty where not measured that way
    rounds_ms: tuple[float, ...] = ()


@dataclass(frozen=True)
class Speedup:
    """``baseline`` p50 / ``candidate`` p50 over paired rounds of one side-by-side run, with its 95 %
    confidence interval: the geometric mean of the per-round ratios, and a t interval on their logs."""

    ratio: float
    low: float
    high: float
    rounds: int

    def text(self, baseline: str) -> str:
        return f"{self.ratio:.2f}x {baseline} (95 % CI {self.low:.2f}-{self.high:.2f}, {self.rounds} paired rounds)"


def speedup_interval(candidate: LatencyStats, baseline: LatencyStats) -> Speedup | None:
    """How much faster ``candidate`` ran than ``baseline`` in the same side-by-side run: per round
    r, log(baseline_r / candidate_r) (the pairing cancels load drift that hits both); their mean
    ± t(0.975, k-1) x sd / sqrt(k), exponentiated. None with fewer than 3 paired rounds."""
    k = min(len(candidate.rounds_ms), len(baseline.rounds_ms))
    if k < 3:
        return None
    logs = [math.log(b / c) for b, c in zip(baseline.rounds_ms[:k], candidate.rounds_ms[:k], strict=True) if b > 0 < c]
    k = len(logs)
    if k < 3:
        return None
    mean = sum(logs) / k
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (k - 1))
    half = _t975(k - 1) * sd / math.sqrt(k)
    return Speedup(math.exp(mean), math.exp(mean - half), math.exp(mean + half), k)


_T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def _t975(df: int) -> float:
    """Student's t 0.975 quantile: tabled below 10 degrees of freedom, else the Cornish-Fisher
    expansion about the normal's (within 0.1 % there)."""
    if df in _T975:
        return _T975[df]
    z = 1.959964
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


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
    clock: Callable[[], float] = time.perf_counter,
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
    ``budget_s`` is spent. ``clock``: seconds, for the calls and the budget (the engine's tests
    give one that the functions advance by set amounts).
    """
    names = list(fns)
    if not names:
        return {}
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {n: [] for n in names}
    rounds: dict[str, list[float]] = {n: [] for n in names}
    start = clock()
    shuffle = random.Random(0).shuffle
    for r in range(repeats):
        order = list(names)
        shuffle(order)
        for name in order:
            fn, out = fns[name], times[name]
            for _ in range(discard):
                fn()
            for _ in range(block):
                t0 = clock()
                fn()
                out.append(clock() - t0)
            rounds[name].append(_quantile(sorted(out[-block:]), 0.5) * 1000.0)
        if r + 1 >= min_repeats and clock() - start > budget_s:
            break
    return {n: dataclasses.replace(_stats(v), rounds_ms=tuple(rounds[n])) for n, v in times.items()}


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
