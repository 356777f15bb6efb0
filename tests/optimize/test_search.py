"""The search loop on candidates built in Python (no SDK): failures recorded, dominated
refinements skipped and said so, explicit precisions chosen among their own candidates."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from edgekit.bundle.manifest import Precision, Signature, TensorSpec, Tolerance
from edgekit.optimize.candidates import BuildSpace, Built, Candidate, CandidatePlan, Refinement, RunFn
from edgekit.optimize.data import search_data
from edgekit.optimize.engine import search

SERVED = Signature(inputs=(TensorSpec("x", "float32", ("n", 8)),), outputs=(TensorSpec("y", "float32", ("n", 8, 1)),))
HEAVY = np.random.default_rng(0).standard_normal((200, 200)).astype(np.float32)


def _exact(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": feed["x"][..., None] * 2.0}


def _slow_and_wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for _ in range(3):  # a thousand times the work of the exact one: measurably slower
        HEAVY @ HEAVY
    return {"y": -feed["x"][..., None]}


def _fast_and_wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {"y": -feed["x"][..., None]}


def _candidate(name: str, precision: str, fn, baseline: bool = False, raises: Exception | None = None) -> Candidate:
    def build(space: BuildSpace) -> Built:
        if raises is not None:
            raise raises
        (space.work_dir / "a.bin").write_bytes(b"x" * (100 if precision == "int8" else 400))
        return Built({"a.bin": "artifact"}, "python", Precision("fp32", "fp32", name), open=lambda threads: fn)

    return Candidate(name, precision, "python", build, {"recipe": name}, family=name, baseline=baseline)


def _search(tmp_path: Path, plan: CandidatePlan, precision: str, **kw):
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    return search(
        plan, target="test", work_dir=tmp_path / "c", data=data, served=SERVED, reference=_exact,
        reference_open=lambda threads: _exact, kind="dense", tolerance=Tolerance(), precision=precision,
        latency_budget_s=1.0, progress=lambda _m: None, **kw,
    )  # fmt: skip


def test_search_skips_a_refinement_of_a_layout_slower_than_fp32_under_auto(tmp_path: Path) -> None:
    plan = CandidatePlan(
        first=(_candidate("fp32", "fp32", _exact, baseline=True), _candidate("int8 slow", "int8", _slow_and_wrong)),
        refinements=(Refinement(_candidate("int8 slow percentile", "int8", _slow_and_wrong), of="int8 slow"),),
    )
    # no prescreen: the quick round's dominance over the baseline is what skips the refinement
    result = _search(tmp_path, plan, "auto", dominated_factor=None)
    by_name = {o.name: o for o in result.outcomes}
    assert by_name["int8 slow"].status == "failed" and "cosine" in by_name["int8 slow"].reason
    skipped = by_name["int8 slow percentile"]
    assert skipped.status == "skipped" and skipped.reason.startswith("dominated: int8 slow measured")
    assert result.chosen.name == "fp32" and not result.slower_than_fp32


def test_search_records_a_raising_build_and_chooses_among_the_requested_precision(tmp_path: Path) -> None:
    plan = CandidatePlan(
        first=(
            _candidate("fp32", "fp32", _exact, baseline=True),
            _candidate("int8 broken", "int8", _exact, raises=ValueError("The truth value of an array is ambiguous")),
            _candidate("int8 ok", "int8", _exact),
        ),
        # an explicit int8 refines what missed regardless of speed; this one did not miss
        refinements=(Refinement(_candidate("int8 ok entropy", "int8", _exact), of="int8 ok"),),
    )
    result = _search(tmp_path, plan, "int8")
    by_name = {o.name: o for o in result.outcomes}
    assert by_name["int8 broken"].status == "error"
    assert by_name["int8 broken"].reason == "ValueError: The truth value of an array is ambiguous"
    assert by_name["int8 ok entropy"].reason == "int8 ok is already within the budget"
    assert result.chosen.name == "int8 ok" and result.chosen.size_bytes == 100
    assert result.reference_latency is not None and result.chosen.latency is not None


def test_search_builds_an_identical_candidate_once_across_targets(tmp_path: Path) -> None:
    builds: list[str] = []

    def counted(name: str) -> Candidate:
        inner = _candidate(name, "fp32", _exact, baseline=True)

        def build(space: BuildSpace) -> Built:
            builds.append(str(space.work_dir))
            return inner.build(space)

        return Candidate(name, "fp32", "python", build, {"recipe": name, "device": "CPU"}, baseline=True)

    shared: dict = {}
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    results = [
        search(
            CandidatePlan(first=(counted("ir fp32"),)),
            target=t,
            work_dir=tmp_path / t,
            data=data,
            served=SERVED,
            reference=_exact,
            reference_open=lambda threads: _exact,
            kind="dense",
            tolerance=Tolerance(),
            precision="fp32",
            latency_budget_s=0.5,
            progress=lambda _m: None,
            shared=shared,
        )
        for t in ("cpu", "intel")
    ]
    assert len(builds) == 1  # the second target measured the first one's build
    assert results[0].built_dir == results[1].built_dir and results[1].chosen.status == "chosen"


def test_search_skips_refinements_over_the_time_budget_and_says_so(tmp_path: Path) -> None:
    def wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": -feed["x"][..., None]}

    plan = CandidatePlan(
        first=(_candidate("fp32", "fp32", _exact, baseline=True), _candidate("int8", "int8", wrong)),
        refinements=(Refinement(_candidate("int8 entropy", "int8", _exact), of="int8"),),
    )
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    result = search(
        plan, target="test", work_dir=tmp_path / "c", data=data, served=SERVED, reference=_exact,
        reference_open=lambda threads: _exact, kind="dense", tolerance=Tolerance(), precision="int8",
        mixed_precision=True, latency_budget_s=0.5, progress=lambda _m: None, time_budget_s=0.0,
    )  # fmt: skip
    skipped = next(o for o in result.outcomes if o.name == "int8 entropy")
    assert (skipped.status, skipped.reason) == ("skipped", "over the search time budget (0 s)")
    # nothing choosable passed: the rescue is not cut by the budget (it has nothing to rank here)
    assert "over the search time budget (0 s) with nothing within the budget: mixed precision tried anyway" in (
        result.notes
    )


def test_search_skips_mixed_precision_over_the_time_budget_when_a_candidate_passed(tmp_path: Path) -> None:
    def wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": -feed["x"][..., None]}

    plan = CandidatePlan(first=(_candidate("fp32", "fp32", _exact, baseline=True), _candidate("int8", "int8", wrong)))
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    result = search(
        plan, target="test", work_dir=tmp_path / "c", data=data, served=SERVED, reference=_exact,
        reference_open=lambda threads: _exact, kind="dense", tolerance=Tolerance(), precision="auto",
        latency_budget_s=0.5, progress=lambda _m: None, time_budget_s=0.0,
    )  # fmt: skip
    assert "mixed precision not tried: over the search time budget (0 s)" in result.notes
    assert result.chosen.name == "fp32"


def test_search_stops_refining_a_layout_once_one_refinement_meets_the_budget(tmp_path: Path) -> None:
    def wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": -feed["x"][..., None]}

    plan = CandidatePlan(
        first=(_candidate("fp32", "fp32", _exact, baseline=True), _candidate("int8 minmax", "int8", wrong)),
        refinements=(
            Refinement(_candidate("int8 percentile", "int8", _exact), of="int8 minmax"),
            Refinement(_candidate("int8 entropy", "int8", _exact), of="int8 minmax"),
        ),
    )
    result = _search(tmp_path, plan, "int8")
    by_name = {o.name: o for o in result.outcomes}
    assert by_name["int8 percentile"].status == "chosen"
    assert by_name["int8 entropy"].reason == "int8 percentile (a refinement of int8 minmax) already meets the budget"


def test_search_times_the_chosen_in_the_final_round_with_the_reference_when_nothing_passes(tmp_path: Path) -> None:
    # an explicit int8 where every int8 misses the budget: the most accurate one is chosen (for the
    # gate to report); its p50, the baseline's and the reference's must be one measurement
    def wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": -feed["x"][..., None]}

    plan = CandidatePlan(
        first=(_candidate("fp32", "fp32", _exact, baseline=True), _candidate("int8 wrong", "int8", wrong)),
    )
    result = _search(tmp_path, plan, "int8")
    assert result.chosen.name == "int8 wrong" and result.chosen.comparison is not None
    assert not result.chosen.comparison.passed
    assert result.reference_latency is not None and result.baseline is not None
    assert result.chosen.timed_in == result.baseline.timed_in == "final"
    assert result.chosen.reference_p50_ms == result.baseline.reference_p50_ms == result.reference_latency.p50_ms
    assert result.chosen.speed_vs_reference == result.reference_latency.p50_ms / result.chosen.latency.p50_ms


def test_search_ratios_of_quick_round_candidates_are_to_the_quick_round_reference(tmp_path: Path) -> None:
    plan = CandidatePlan(
        first=(
            _candidate("fp32", "fp32", _exact, baseline=True),
            _candidate("int8 ok", "int8", _exact),
            _candidate("int8 slow", "int8", _slow_and_wrong),
        ),
    )
    result = _search(tmp_path, plan, "int8")
    by_name = {o.name: o for o in result.outcomes}
    slow, chosen = by_name["int8 slow"], result.chosen
    assert chosen.name == "int8 ok" and chosen.timed_in == result.baseline.timed_in  # one round
    assert slow.timed_in == "quick" and slow.reference_p50_ms is not None  # failed: not in the final round
    assert slow.speed_vs_reference == slow.reference_p50_ms / slow.latency.p50_ms


def _slow_exact(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    for _ in range(3):
        HEAVY @ HEAVY
    return _exact(feed)


def test_search_finalists_are_the_passing_candidates_close_to_the_fastest_with_the_baseline() -> None:
    import dataclasses

    from edgekit.optimize.engine import _finalists
    from edgekit.optimize.search_state import CandidateState, Outcome
    from edgekit.validate.latency import LatencyStats

    def state(name: str, p50: float, status: str = "passed", baseline: bool = False, precision: str = "int8"):
        cand = _candidate(name, "fp32" if baseline else precision, _exact, baseline=baseline)
        lat = LatencyStats(p50_ms=p50, p90_ms=p50, iqr_ms=0.0, calls=10)
        o = Outcome(name, cand.precision, "python", {}, status, latency=lat, timed_in="final", baseline=baseline)
        return CandidateState(cand, Path("."), run=_exact, outcome=o)

    base, a, b, slow, wrong = state("fp32", 1.0, baseline=True), state("a", 0.97), state("b", 1.05), state(
        "slow", 5.0), state("wrong", 0.5, status="failed")  # fmt: skip
    names = lambda got: [s.candidate.name for s in got]  # noqa: E731  # a one-line reader
    # within 10% of the fastest passing one (a failed one is no finalist, however fast), in build order
    assert names(_finalists([base, a, b, slow, wrong], base, True, "auto")) == ["fp32", "a", "b"]
    # the baseline joins two close ones even when it is far behind
    far = dataclasses.replace(base, outcome=dataclasses.replace(base.outcome, latency=LatencyStats(3.0, 3.0, 0, 10)))
    assert names(_finalists([far, a, b], far, True, "auto")) == ["fp32", "a", "b"]
    # one clear winner: nothing to separate, no extra round
    assert _finalists([far, a, slow], far, True, "auto") == []
    # an explicit precision: only its candidates (and the baseline) are finalists
    fp16 = state("other fp16", 0.98, precision="fp16")
    assert names(_finalists([base, a, fp16], base, False, "int8")) == ["fp32", "a"]


def test_search_times_the_chosen_and_the_baseline_in_one_round_and_never_a_slow_one_as_finalist(
    tmp_path: Path,
) -> None:
    # the latencies of near-equal candidates are noise: which round the chosen comes from is not
    # asserted, only that its p50, the baseline's and the reference's are one measurement
    plan = CandidatePlan(
        first=(
            _candidate("fp32", "fp32", _exact, baseline=True),
            _candidate("int8 a", "int8", _exact),
            _candidate("int8 b", "int8", _exact),
            _candidate("int8 slow", "int8", _slow_exact),
        ),
    )
    result = _search(tmp_path, plan, "auto", dominated_factor=None)  # the slow one measured, not prescreened
    by_name = {o.name: o for o in result.outcomes}
    assert by_name["int8 slow"].status == "passed" and by_name["int8 slow"].timed_in == "final"
    assert result.chosen.name != "int8 slow" and result.chosen.timed_in == result.baseline.timed_in
    assert result.reference_latency is not None
    assert result.chosen.reference_p50_ms == result.baseline.reference_p50_ms == result.reference_latency.p50_ms
    finalists = {n for n, o in by_name.items() if o.timed_in == "finalists"}
    if finalists:
        assert result.chosen.name in finalists and "fp32" in finalists
        assert any(n.startswith("finalists timed again") for n in result.notes)


def _untimed(name: str, precision: str, fn, rank: int, baseline: bool = False) -> Candidate:
    """A candidate whose runtime does not run here: gated through its intermediate, ranked."""

    def build(space: BuildSpace) -> Built:
        (space.work_dir / "a.bin").write_bytes(b"x" * 100)
        return Built({"a.bin": "artifact"}, "device", Precision("fp32", "fp32", name), open=None, intermediate=fn)

    return Candidate(name, precision, "device", build, {"recipe": name}, family=name, baseline=baseline,
                     device_rank=rank)  # fmt: skip


def test_search_skips_a_refinement_when_an_untimed_candidate_ranked_as_fast_already_passed(tmp_path: Path) -> None:
    wrong = lambda feed: {"y": -feed["x"][..., None]}  # noqa: E731  # a one-line stand-in
    plan = CandidatePlan(
        first=(
            _untimed("fp32", "fp32", _exact, 3, baseline=True),
            _untimed("int8 a", "int8", wrong, 0),
            _untimed("int8 b", "int8", _exact, 0),
        ),
        refinements=(Refinement(_untimed("int8 a percentile", "int8", _exact, 0), of="int8 a"),),
    )
    result = _search(tmp_path, plan, "auto")
    by_name = {o.name: o for o in result.outcomes}
    assert by_name["int8 a percentile"].status == "skipped"
    assert by_name["int8 a percentile"].reason.startswith("int8 b (device rank 0) already meets the budget")
    assert result.chosen.name == "int8 b" and "rank 0" in result.why


def test_search_builds_the_fallback_only_when_nothing_met_the_budget_under_auto(tmp_path: Path) -> None:
    def plan(int8_fn: RunFn) -> CandidatePlan:
        return CandidatePlan(
            first=(_candidate("int8", "int8", int8_fn),), fallback=(_candidate("float fallback", "fp32", _exact),)
        )

    missed = _search(tmp_path / "a", plan(_slow_and_wrong), "auto")
    assert missed.chosen.name == "float fallback" and missed.chosen.comparison is not None
    met = _search(tmp_path / "b", plan(_exact), "auto")
    rows = {o.name: o for o in met.outcomes}
    assert met.chosen.name == "int8" and rows["float fallback"].status == "skipped"
    assert rows["float fallback"].reason.startswith("int8 already meets the budget")
    asked = _search(tmp_path / "c", plan(_slow_and_wrong), "int8")
    assert {o.name: o.status for o in asked.outcomes}["float fallback"] == "skipped"  # int8 asked: never float


def _very_slow_exact(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    time.sleep(0.06)  # over DOMINATED_MIN_MS per call, and thousands of times _exact's
    return _exact(feed)


def test_search_skips_a_candidate_dominated_on_its_first_calls_before_its_accuracy_run_under_auto(
    tmp_path: Path,
) -> None:
    calls: list[int] = []

    def counted_slow(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        calls.append(len(next(iter(feed.values()))))
        return _very_slow_exact(feed)

    plan = CandidatePlan(
        first=(_candidate("int16 slow", "int8", counted_slow), _candidate("int8 fast", "int8", _exact)),
        refinements=(Refinement(_candidate("int16 slow minmax", "int8", _very_slow_exact), of="int16 slow"),),
    )
    result = _search(tmp_path, plan, "auto")
    by_name = {o.name: o for o in result.outcomes}
    slow = by_name["int16 slow"]
    assert slow.status == "skipped" and slow.comparison is None and slow.latency is None
    assert slow.reason.startswith("dominated on its first calls: ") and "x onnxruntime fp32 (source)" in slow.reason
    assert len(calls) == 3 and set(calls) == {1}  # a warm-up and two timed single-sample calls, no accuracy run
    assert by_name["int16 slow minmax"].status == "skipped"
    assert by_name["int16 slow minmax"].reason.startswith("int16 slow was skipped (dominated on its first calls)")
    assert result.chosen.name == "int8 fast"
    assert [o.name for o in result.outcomes].count("int16 slow") == 1  # recorded once


def test_search_measures_a_slow_candidate_fully_under_an_explicit_precision_or_the_size_objective(
    tmp_path: Path,
) -> None:
    plan = CandidatePlan(first=(_candidate("int16 slow", "int8", _very_slow_exact),))
    explicit = _search(tmp_path / "a", plan, "int8")
    assert explicit.chosen.name == "int16 slow" and explicit.chosen.comparison is not None
    size = _search(tmp_path / "b", plan, "auto", objective="size")
    assert size.chosen.name == "int16 slow" and size.chosen.comparison is not None


def test_search_builds_the_fallback_when_the_only_candidate_that_would_pass_is_dominated(tmp_path: Path) -> None:
    plan = CandidatePlan(
        first=(_candidate("int8", "int8", _fast_and_wrong), _candidate("int16 slow", "int8", _very_slow_exact)),
        fallback=(_candidate("float fallback", "fp32", _exact),),
    )
    result = _search(tmp_path, plan, "auto")
    rows = {o.name: o for o in result.outcomes}
    # the wrong one is microseconds a call, far under DOMINATED_MIN_MS even on a loaded machine:
    # measured (failed); the slow one that would pass: prescreened
    assert rows["int16 slow"].status == "skipped" and rows["int8"].status == "failed"
    assert result.chosen.name == "float fallback" and result.chosen.comparison is not None


def test_search_prescreen_compares_with_the_targets_own_fp32_where_it_has_one(tmp_path: Path) -> None:
    def slow_fp32(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        time.sleep(0.04)  # the target's own runtime: far slower than the ONNX Runtime source here
        return _exact(feed)

    plan = CandidatePlan(
        first=(_candidate("fp32", "fp32", slow_fp32, baseline=True), _candidate("int8", "int8", _very_slow_exact))
    )
    result = _search(tmp_path, plan, "auto")
    rows = {o.name: o for o in result.outcomes}
    # 1.5x its own fp32 (though thousands of times the source's): measured, not prescreened
    assert rows["int8"].comparison is not None and rows["int8"].status in ("passed", "chosen")


def test_search_skips_a_refinement_that_would_outlast_the_time_budget(tmp_path: Path) -> None:
    import dataclasses

    def wrong(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {"y": -feed["x"][..., None]}

    seen: list[tuple[float, int]] = []

    def cost(fp32_ms: float, calib_samples: int) -> tuple[float, str]:
        seen.append((fp32_ms, calib_samples))
        return 1e6, "the model evaluated once per layer"

    costly = dataclasses.replace(_candidate("int8 accuracy control", "int8", _exact), cost_s=cost)
    cheap = _candidate("int8 entropy", "int8", _exact)
    data = search_data({"x": np.random.default_rng(1).standard_normal((40, 8)).astype(np.float32)}, 16)
    for refinement, expect in ((costly, ("skipped",)), (cheap, ("passed", "chosen"))):
        plan = CandidatePlan(
            first=(_candidate("fp32", "fp32", _exact, baseline=True), _candidate("int8", "int8", wrong)),
            refinements=(Refinement(refinement, of="int8"),),
        )
        result = search(
            plan, target="test", work_dir=tmp_path / refinement.name.replace(" ", "-"), data=data, served=SERVED,
            reference=_exact, reference_open=lambda threads: _exact, kind="dense", tolerance=Tolerance(),
            precision="auto", latency_budget_s=0.5, progress=lambda _m: None, time_budget_s=3600.0,
            dominated_factor=None,
        )  # fmt: skip
        got = next(o for o in result.outcomes if o.name == refinement.name)
        assert got.status in expect
        if refinement is costly:
            assert got.reason.startswith("would take up to ~1000000 s (the model evaluated once per layer), over the")
            assert "left of the search time budget (3600 s)" in got.reason
    # the estimate was asked with the baseline's measured p50 and the search's calibration samples
    assert len(seen) == 1 and seen[0][0] > 0 and seen[0][1] == 16


def test_search_closes_the_sessions_of_failed_candidates_before_the_final_rounds(tmp_path: Path) -> None:
    import weakref

    class Runner:
        def __init__(self, fn) -> None:
            self.fn = fn

        def __call__(self, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            return self.fn(feed)

    failed_alive: list[bool] = []
    refs: list[weakref.ref] = []

    def failing_open(threads: int) -> Runner:
        runner = Runner(_fast_and_wrong)
        refs.append(weakref.ref(runner))
        return runner

    def passing_open(threads: int):  # records, each call, whether the failed one's session is still open
        def run(feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
            failed_alive.append(any(r() is not None for r in refs))
            return _exact(feed)

        return run

    def candidate(name: str, precision: str, opener, baseline: bool = False) -> Candidate:
        def build(space: BuildSpace) -> Built:
            (space.work_dir / "a.bin").write_bytes(b"x" * 100)
            return Built({"a.bin": "artifact"}, "python", Precision("fp32", "fp32", name), open=opener)

        return Candidate(name, precision, "python", build, {"recipe": name}, family=name, baseline=baseline)

    plan = CandidatePlan(
        first=(
            candidate("fp32", "fp32", passing_open, baseline=True),
            candidate("int8 wrong", "int8", failing_open),
            candidate("int8 ok", "int8", passing_open),
        )
    )
    result = _search(tmp_path, plan, "auto", dominated_factor=None)
    assert {o.name: o.status for o in result.outcomes}["int8 wrong"] == "failed"
    assert refs and failed_alive
    assert True in failed_alive  # open while it was measured and timed in the quick round
    assert failed_alive[-1] is False  # closed before the final rounds
