"""The search's timing, in one place: side-by-side latency rounds of the candidates with the FP32
source (``time_round``), device-profile latencies in place of the host's (``device_times``), the
prescreen's first calls (``prescreen_ms``), the speed-up a choice may claim beyond the measured
noise (``beyond_noise``) and the head-to-head round that settles a leader the noise left undecided
(``head_to_head``). The side-by-side loop itself is ``validate.latency``'s."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping

import numpy as np

from edgekit.optimize.candidates import RunFn
from edgekit.optimize.profile import DeviceLatency, candidate_key
from edgekit.optimize.search_state import CandidateState, Outcome
from edgekit.validate.latency import LatencyStats, call_with, speedup_interval, stats_side_by_side

REFERENCE = "onnxruntime fp32 (source)"
HEAD_TO_HEAD = "head-to-head"  # the round of the undecided leader and the baseline alone


def time_round(
    states: list[CandidateState],
    reference_open: Callable[[int], RunFn],
    one: dict[str, np.ndarray],
    threads: int,
    round_name: str,
    *,
    repeats: int,
    budget_s: float,
    say: Callable[[str], None],
    target: str,
    discard: int = 1,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, LatencyStats]:
    """Side-by-side latency of the runnable built states (and the reference); updates outcomes."""
    runnable = [s for s in states if s.run is not None and s.built is not None and s.built.open is not None]
    if not runnable:
        return {}
    fns: dict[str, Callable[[], object]] = {REFERENCE: call_with(reference_open(threads), one)}
    for s in runnable:
        if s.run is not None:
            fns[s.candidate.name] = call_with(s.run, one)
    say(f"[{target}] timing {len(runnable)} candidate(s) side by side ({threads} threads, batch 1)")
    stats = stats_side_by_side(fns, repeats=repeats, budget_s=budget_s, min_repeats=3, discard=discard, clock=clock)
    ref = stats[REFERENCE].p50_ms
    for s in runnable:
        if s.outcome is not None:
            lat = stats[s.candidate.name]
            s.outcome = dataclasses.replace(s.outcome, latency=lat, timed_in=round_name, reference_p50_ms=ref)
    return stats


def device_times(states: list[CandidateState], device: DeviceLatency) -> None:
    """Every built candidate's latency := the device profile's (None where the profile has none).
    The ratios are then to the target's own FP32 on the device (the baseline's profiled p50): the
    host's ONNX Runtime FP32 is another machine's measurement."""
    found: dict[int, LatencyStats | None] = {}
    for i, s in enumerate(states):
        o = s.outcome
        if o is not None and s.built is not None:
            found[i] = device.lookup(o.name, candidate_key(o.runtime, o.precision, o.settings))
    base = next((found.get(i) for i, s in enumerate(states) if s.candidate.baseline), None)
    ref = base.p50_ms if base is not None else None
    for i, lat in found.items():
        o = states[i].outcome
        assert o is not None
        states[i].outcome = dataclasses.replace(
            o,
            latency=lat,
            latency_from=device.label if lat is not None else "",
            timed_in="device profile" if lat is not None else "",
            reference_p50_ms=ref if lat is not None else None,
        )


def prescreen_ms(
    run: RunFn,
    feed: dict[str, np.ndarray],
    calls: int,
    statistic: str = "min",
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Milliseconds per call of ``run`` on ``feed``: one warm-up call, then the min (or median) of
    ``calls`` timed calls (min: a candidate is called dominated only when even its fastest call is)."""
    run(feed)
    times = []
    for _ in range(calls):
        started = clock()
        run(feed)
        times.append((clock() - started) * 1e3)
    return float(np.min(times) if statistic == "min" else np.median(times))


def head_to_head(
    states: list[CandidateState],
    baseline: CandidateState,
    rounds: Mapping[str, Mapping[str, LatencyStats]],
    one: dict[str, np.ndarray],
    *,
    eligible: Callable[[Outcome], bool],
    budget_s: float,
    say: Callable[[str], None],
    target: str,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[str, dict[str, LatencyStats]] | None:
    """The passing candidate with the largest speed-up over ``baseline`` whose interval still
    reaches 1 (faster by its point estimate, not beyond the noise), timed again with the baseline
    alone: two functions per round are many more paired rounds in the same time (MiniLM on a
    loaded 2-core host: 2.51x, 95 % CI 0.43-14.63 over 3 rounds among 7 candidates). Returns
    (its name, the round's stats), or None when no leader is undecided."""
    base = baseline.outcome
    if base is None or baseline.run is None:
        return None
    best: tuple[float, CandidateState] | None = None
    for s in states:
        o = s.outcome
        if s is baseline or o is None or s.run is None or o.comparison is None or not o.comparison.passed:
            continue
        if not eligible(o):
            continue
        stats = rounds.get(o.timed_in, {})
        cand, ref = stats.get(o.name), stats.get(base.name)
        interval = speedup_interval(cand, ref) if cand is not None and ref is not None else None
        if interval is None or interval.low > 1.0 or interval.ratio <= 1.0:
            continue
        if best is None or interval.ratio > best[0]:
            best = (interval.ratio, s)
    if best is None:
        return None
    leader = best[1]
    name = leader.candidate.name
    say(f"[{target}] {name} leads {base.name} within the timing noise: timing the two alone")
    assert leader.run is not None
    fns = {name: call_with(leader.run, one), base.name: call_with(baseline.run, one)}
    stats = stats_side_by_side(fns, repeats=60, budget_s=budget_s, min_repeats=3, discard=2, clock=clock)
    return name, stats


def beyond_noise(
    chain: list[Outcome],
    baseline: Outcome,
    rounds: Mapping[str, Mapping[str, LatencyStats]],
    round_of: Mapping[str, str] | None = None,
) -> tuple[list[Outcome], dict[str, str], list[str]]:
    """The chain less the candidates whose speed-up over ``baseline`` is not beyond the measured
    noise: the lower end of its 95 % interval (``validate.latency.speedup_interval``, over the
    paired rounds of the last round both were timed in, or of the round ``round_of`` names for it)
    at or below 1. A candidate without such rounds (not timed here) stays. Returns (chain, name ->
    speed-up text, what was left out)."""
    kept: list[Outcome] = []
    texts: dict[str, str] = {}
    dropped: list[str] = []
    for o in chain:
        stats = rounds.get((round_of or {}).get(o.name, o.timed_in), {})
        cand, base = stats.get(o.name), stats.get(baseline.name)
        interval = speedup_interval(cand, base) if cand is not None and base is not None else None
        if interval is None:
            kept.append(o)
            continue
        texts[o.name] = f"speed {interval.text(baseline.name)}"
        if interval.low > 1.0:
            kept.append(o)
        else:
            dropped.append(f"{o.name} {interval.text(baseline.name)}")
    return kept, texts, dropped
