"""Decisions beyond noise: under ``auto`` a candidate ships as faster than the target's FP32 only
when the 95 % interval of its speed-up over paired side-by-side rounds lies above 1; else the
plain FP32 artifact ships. The timing is made deterministic through the engine's clock: each
function advances it by a set cost with seeded jitter (no sleeping, no wall-clock asserts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from edgekit.bundle.manifest import Precision, Tolerance
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, RunFn
from edgekit.optimize.data import search_data
from edgekit.optimize.engine import search
from edgekit.validate.latency import LatencyStats, speedup_interval, stats_side_by_side
from tests.optimize.test_search import SERVED, _exact


class Clock:
    """Seconds that only the timed functions move."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def costing(self, ms: float, jitter: float, seed: int) -> RunFn:
        """``_exact`` that costs ``ms`` per call, each call off by up to ``jitter`` (a share)."""
        rng = np.random.default_rng(seed)

        def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            self.now += ms / 1e3 * (1 + jitter * rng.uniform(-1, 1))
            return _exact(feed)

        return run

    def loaded(self, ms: float, sigma: float, seed: int) -> RunFn:
        """``_exact`` costing ``ms`` times a log-normal factor per call: a busy host's heavy tail."""
        rng = np.random.default_rng(seed)

        def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            self.now += ms / 1e3 * float(np.exp(sigma * rng.standard_normal()))
            return _exact(feed)

        return run


def _candidate(name: str, precision: str, fn: RunFn, baseline: bool = False) -> Candidate:
    def build(space: BuildSpace) -> Built:
        (space.work_dir / "a.bin").write_bytes(b"x" * (100 if precision == "int8" else 400))
        return Built({"a.bin": "artifact"}, "python", Precision(precision, precision, name), open=lambda threads: fn)

    return Candidate(name, precision, "python", build, {"recipe": name}, family=name, baseline=baseline)


def _search(tmp_path: Path, clock: Clock, int8_ms: float):
    plan = CandidatePlan(
        first=(
            _candidate("fp32", "fp32", clock.costing(1.0, 0.3, seed=1), baseline=True),
            _candidate("int8", "int8", clock.costing(int8_ms, 0.3, seed=2)),
        )
    )
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    reference = clock.costing(1.0, 0.3, seed=3)
    return search(
        plan, target="test", work_dir=tmp_path / "c", data=data, served=SERVED, reference=reference,
        reference_open=lambda threads: reference, kind="dense", tolerance=Tolerance(), precision="auto",
        latency_budget_s=10.0, progress=lambda _m: None, clock=clock,
    )  # fmt: skip


def test_search_ships_fp32_when_no_candidate_beats_it_beyond_the_measured_noise(tmp_path: Path) -> None:
    result = _search(tmp_path, Clock(), int8_ms=0.98)
    by_name = {o.name: o for o in result.outcomes}
    int8, fp32 = by_name["int8"], by_name["fp32"]
    # the premise: int8 passed and its median was lower, so p50 alone would have shipped it
    assert int8.comparison is not None and int8.comparison.passed
    assert int8.p50_ms is not None and fp32.p50_ms is not None and int8.p50_ms < fp32.p50_ms
    assert result.chosen.name == "fp32" and not result.slower_than_fp32
    assert result.why.startswith("no candidate beat fp32 beyond the measured noise (the fastest within the budget, ")
    assert "int8: speed " in result.why and "x fp32 (95 % CI " in result.why
    assert result.why.endswith("); the plain fp32 artifact ships")
    (note,) = [n for n in result.notes if n.startswith("not faster than fp32 beyond the measured noise")]
    low = float(note.split("95 % CI ")[1].split("-")[0])
    assert low <= 1.0


def test_search_ships_a_candidate_faster_beyond_the_noise_and_prints_its_interval(tmp_path: Path) -> None:
    result = _search(tmp_path, Clock(), int8_ms=0.5)
    assert result.chosen.name == "int8"
    speed = result.why.split("; speed ")[1]
    ratio, low, high = float(speed.split("x")[0]), *map(float, speed.split("95 % CI ")[1].split(",")[0].split("-"))
    assert 1.0 < low < ratio < high and ratio == pytest.approx(2.0, rel=0.1)


def test_speedup_interval_is_a_t_interval_on_paired_log_ratios() -> None:
    def stats(rounds: list[float]) -> LatencyStats:
        return LatencyStats(p50_ms=float(np.median(rounds)), p90_ms=0, iqr_ms=0, calls=10, rounds_ms=tuple(rounds))

    base = stats([2.0, 4.0, 2.0, 4.0])  # load drift hits both alike: the pairing cancels it
    same = speedup_interval(stats([1.0, 2.0, 1.0, 2.0]), base)
    assert same is not None and same.ratio == pytest.approx(2.0) and same.low == pytest.approx(2.0)
    logs = np.log([2.0 / 1.0, 2.0 / 1.5, 2.0 / 1.0, 2.0 / 1.5])
    half = 3.182 * logs.std(ddof=1) / 2  # t(0.975, 3 df)
    got = speedup_interval(stats([1.0, 1.5, 1.0, 1.5]), stats([2.0] * 4))
    assert got is not None and got.rounds == 4
    assert got.low == pytest.approx(np.exp(logs.mean() - half)) and got.high == pytest.approx(
        np.exp(logs.mean() + half)
    )
    assert speedup_interval(stats([1.0, 1.0]), stats([2.0, 2.0])) is None  # too few rounds to say


def test_side_by_side_rounds_are_each_rounds_median_read_on_the_given_clock() -> None:
    clock = Clock()
    stats = stats_side_by_side(
        {"a": lambda: clock.costing(2.0, 0.0, 0)({"x": np.zeros((1, 8))})}, repeats=4, warmup=0, block=3, clock=clock
    )
    assert stats["a"].rounds_ms == pytest.approx((2.0, 2.0, 2.0, 2.0)) and stats["a"].p50_ms == pytest.approx(2.0)


def test_an_undecided_leader_is_timed_again_alone_with_fp32_and_ships(tmp_path: Path) -> None:
    """Among many candidates a round holds few paired rounds, so a leader clearly faster by its
    median can have an interval reaching below 1; timed again with FP32 alone (many more rounds in
    the same time) it is faster beyond the noise and ships, where before the plain FP32 shipped."""
    clock = Clock()
    slow = tuple(
        _candidate(f"slow{i}", "fp16", clock.costing(20.0, 0.0, seed=10 + i)) for i in range(8)
    )  # passing, slower than fp32: only make each side-by-side round long
    plan = CandidatePlan(
        first=(
            _candidate("fp32", "fp32", clock.loaded(1.0, 1.2, seed=1), baseline=True),
            _candidate("int8", "int8", clock.loaded(0.6, 1.2, seed=2)),
            *slow,
        )
    )
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    reference = clock.loaded(1.0, 1.2, seed=3)
    said: list[str] = []
    result = search(
        plan, target="test", work_dir=tmp_path / "c", data=data, served=SERVED, reference=reference,
        reference_open=lambda threads: reference, kind="dense", tolerance=Tolerance(), precision="auto",
        latency_budget_s=1.0, progress=said.append, clock=clock,
    )  # fmt: skip
    final = {o.name: o for o in result.outcomes}["int8"]
    assert final.timed_in == "final"  # the premise: decided on the long round's few paired rounds
    assert any("int8 leads fp32 within the timing noise: timing the two alone" in m for m in said)
    (note,) = [n for n in result.notes if n.startswith("int8 timed again alone with fp32: speed ")]
    rounds = int(note.split(", ")[-1].split(" paired")[0])
    assert rounds > 10
    assert result.chosen.name == "int8"
