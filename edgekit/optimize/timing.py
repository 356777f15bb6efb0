"""The search's timing, in one place: side-by-side latency rounds of the candidates with the FP32
source (``time_round``), device-profile latencies in place of the host's (``device_times``), the
prescreen's first calls (``prescreen_ms``) and the speed-up a choice may claim beyond the measured
noise (``beyond_noise``). The side-by-side loop itself is ``validate.latency``'s."""

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


def beyond_noise(
    chain: list[Outcome], baseline: Outcome, rounds: Mapping[str, Mapping[str, LatencyStats]]
) -> tuple[list[Outcome], dict[str, str], list[str]]:
    """The chain less the candidates whose speed-up over ``baseline`` is not beyond the measured
    noise: the lower end of its 95 % interval (``validate.latency.speedup_interval``, over the
    paired rounds of the last round both were timed in) at or below 1. A candidate without such
    rounds (not timed here) stays. Returns (chain, name -> speed-up text, what was left out)."""
    kept: list[Outcome] = []
    texts: dict[str, str] = {}
    dropped: list[str] = []
    for o in chain:
        stats = rounds.get(o.timed_in, {})
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
