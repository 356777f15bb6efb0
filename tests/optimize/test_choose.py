"""Choosing among measured candidates (pure: outcomes built by hand, no timing)."""

from __future__ import annotations

from edgekit.bundle.manifest import Tolerance
from edgekit.optimize.choose import choose
from edgekit.optimize.search_state import Outcome
from edgekit.validate.latency import LatencyStats
from edgekit.validate.metrics import Comparison


def _o(name: str, p50: float | None, size: int, agreement: float = 1.0, passed: bool = True, **kw) -> Outcome:
    comparison = Comparison(
        "classifier", 10, Tolerance(), top1_agreement=agreement, cosine=0.99, failures=() if passed else ("short",)
    )
    latency = None if p50 is None else LatencyStats(p50, p50 * 1.2, p50 * 0.1, 100)
    return Outcome(name, kw.pop("precision", "int8"), "onnxruntime", {}, "passed" if passed else "failed",
                   comparison=comparison, size_bytes=size, latency=latency, **kw)  # fmt: skip


def test_choose_fastest_passing_with_noise_ties_going_to_the_smaller() -> None:
    fp32 = _o("fp32", 1.0, 1000, precision="fp32", baseline=True)
    a, b = _o("a", 0.50, 300), _o("b", 0.51, 250)  # within 3 %: the smaller wins
    assert choose([fp32, a, b], "latency", auto=True, baseline=fp32)[0] is b
    c = _o("c", 0.60, 100)  # not within 3 %: the faster is kept although larger
    assert choose([fp32, a, c], "latency", auto=True, baseline=fp32)[0] is a


def test_choose_auto_never_ships_slower_than_fp32() -> None:
    fp32 = _o("fp32", 1.0, 1000, precision="fp32", baseline=True)
    slow = _o("int8", 1.4, 250)
    pick, why = choose([fp32, slow], "latency", auto=True, baseline=fp32)
    assert pick is fp32 and "1 passing candidate(s) slower than fp32 left out" in why
    # the size objective keeps the rule: smaller but slower is not shipped by auto
    assert choose([fp32, slow], "size", auto=True, baseline=fp32)[0] is fp32
    # an explicit precision is what the user asked for: it is chosen (and marked slower later)
    assert choose([slow], "latency", auto=False, baseline=fp32)[0] is slow


def test_choose_by_size_and_without_latency_and_when_nothing_passes() -> None:
    fp32 = _o("fp32", 1.0, 1000, precision="fp32", baseline=True)
    small, fast = _o("small", 0.9, 200), _o("fast", 0.5, 400)
    assert choose([fp32, small, fast], "size", auto=True, baseline=fp32)[0] is small
    untimed = [_o("w8", None, 300), _o("w4", None, 200)]  # latency not measurable here
    pick, why = choose(untimed, "latency", auto=True, baseline=None)
    assert pick.name == "w4" and "latency not measured here" in why
    failed = [_o("x", 0.5, 100, 0.5, passed=False), _o("y", 0.6, 100, 0.9, passed=False)]
    pick, why = choose(failed, "latency", auto=False, baseline=fp32)
    assert pick.name == "y" and why.startswith("no candidate met the accuracy budget")


def test_choose_untimed_by_the_device_rank_then_size() -> None:
    # TensorRT-like: int8 is expected fastest (rank 0), fp16 next; nothing is timed here
    int8, fp16 = _o("int8", None, 300, device_rank=0), _o("fp16", None, 500, precision="fp16", device_rank=1)
    pick, why = choose([fp16, int8], "latency", auto=True, baseline=None)
    assert pick is int8 and "latency not measured here" in why and "rank 0" in why
    # the fastest-ranked one missed the budget: the next rank ships
    missed = _o("int8", None, 300, 0.5, passed=False, device_rank=0)
    assert choose([fp16, missed], "latency", auto=True, baseline=None)[0] is fp16
    # the size objective ignores the rank
    assert choose([fp16, int8, _o("w4", None, 100, device_rank=2)], "size", auto=True, baseline=None)[0].name == "w4"


def test_choose_untimed_same_rank_and_near_size_goes_to_the_more_accurate() -> None:
    # two Q/DQ placements of one model: same speed class, a few scales apart in size
    edge, margin = _o("weighted", None, 1000, 0.984, device_rank=0), _o("all", None, 1015, 1.0, device_rank=0)
    pick, why = choose([edge, margin], "latency", auto=True, baseline=None)
    assert pick is margin and "won by the more accurate" in why
    much_smaller = _o("small", None, 500, 0.984, device_rank=0)  # not within 2 %: the smaller still wins
    assert choose([much_smaller, margin], "latency", auto=True, baseline=None)[0] is much_smaller


def test_choose_within_the_speed_tie_sizes_within_the_size_tie_go_to_the_faster() -> None:
    fp32 = _o("fp32", 1.0, 1000, precision="fp32", baseline=True)
    per_channel, per_tensor = _o("per-channel", 0.226, 688), _o("per-tensor", 0.230, 680)  # 1.2 % smaller
    pick, why = choose([fp32, per_tensor, per_channel], "latency", auto=True, baseline=fp32)
    assert pick is per_channel and "won by the faster" in why
