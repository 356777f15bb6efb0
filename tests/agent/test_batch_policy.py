"""The batch-size policy as a pure function of recorded call times: the per-size cost model
(``CallCost``), whether batching pays, the size limit of each batch with its exploring batches
(``BatchPolicy``), and how long a batch waits (``wait_until``). No model, no threads, no clock."""

from __future__ import annotations

import pytest

from device_agents.config import BatchingConfig
from device_agents.pipeline.policy import (
    DEADLINE_MARGIN_S,
    EXPLORE_EVERY,
    EXPLORE_MAX,
    EXPLORE_ROWS,
    BatchPolicy,
    CallCost,
    wait_until,
)


def _recorded(calls: list[tuple[int, float]], repeat: int = 3) -> CallCost:
    cost = CallCost()
    for _ in range(repeat):
        for rows, seconds in calls:
            cost.record(rows, seconds)
    return cost


DIGITS = [(1, 0.00069), (2, 0.00117), (4, 0.0055)]  # the digits conv net, 2 threads: 4 rows cost 8 calls
MLP = [(1, 0.003), (4, 0.0034), (8, 0.0038)]  # an MLP reading its weights once per call


def test_call_cost_splits_a_call_s_time_into_fixed_and_per_row_parts() -> None:
    cost = CallCost()
    assert cost.fixed_s == 0.0
    cost.record(4, 0.005)
    assert cost.fixed_s == pytest.approx(0.005)  # one size seen: the split is unknown, all counted fixed
    for rows in (1, 8, 16, 2, 32):
        cost.record(rows, 0.003 + 0.0005 * rows)
    assert cost.fixed_s == pytest.approx(0.003, rel=0.05)
    assert cost.per_row_s == pytest.approx(0.0005, rel=0.05)


def test_call_cost_keeps_the_split_of_a_rare_batch_size_through_many_single_calls() -> None:
    cost = CallCost()
    for _ in range(3):
        cost.record(4, 0.00015 + 0.001 * 4)  # an exploring batch of a small conv net
    for _ in range(500):
        cost.record(1, 0.00015 + 0.001)  # then single calls only, as a model run unbatched makes
    # the split is still the one measured: not "all of a call is fixed" (which says batching pays)
    assert cost.fixed_s == pytest.approx(0.00015, rel=0.01)
    assert cost.per_row_s == pytest.approx(0.001, rel=0.01)
    slower = CallCost()
    for rows, seconds in ((1, 0.0008), (4, 0.0064), (1, 0.0008)):  # a batch of 4 costs 8 single calls
        slower.record(rows, seconds)
    assert slower.fixed_s == 0.0 and slower.per_row_s > 0.0


def test_batch_policy_keeps_not_paying_while_a_model_is_run_as_if_unbatched() -> None:
    policy = BatchPolicy()
    for rows in (1, 4, 1, 4):
        policy.cost.record(rows, 0.0008 * rows)  # nothing saved by batching
    assert not policy.pays()
    for _ in range(300):
        policy.cost.record(1, 0.0008)  # the single calls it then makes
        assert not policy.pays()


def test_batch_policy_pays_only_when_a_call_s_fixed_part_is_a_real_share_of_it() -> None:
    policy = BatchPolicy()
    assert policy.pays()  # nothing measured: batch, as a plain dynamic batcher would
    for rows in (1, 4, 16, 1, 4, 16):
        policy.cost.record(rows, 0.003 + 0.0001 * rows)  # an MLP reading its weights once per call
    assert policy.pays()
    policy = BatchPolicy()
    for rows in (1, 4, 16, 1, 4, 16):
        policy.cost.record(rows, 0.00015 + 0.001 * rows)  # a small conv net: 13% of a single call is fixed
    assert not policy.pays()


def test_call_cost_s_cheapest_batch_size_is_measured_per_row_not_read_off_the_line() -> None:
    cost = CallCost()
    for _ in range(3):
        for rows, seconds in ((1, 0.00069), (2, 0.00117), (4, 0.0055)):  # the digits conv net, 2 threads
            cost.record(rows, seconds)
    assert cost.fixed_s == 0.0  # the line through these says a batch saves nothing...
    assert cost.cheapest_rows(32) == 2  # ...but a batch of 2 costs 15% less per row than single calls
    assert cost.cheapest_rows(1) == 1
    cost.record(8, 0.001)  # one call of a size is not a measurement of it
    assert cost.cheapest_rows(32) == 2


def test_call_cost_s_cheapest_batch_size_allows_for_noise_in_a_bigger_size_s_mean() -> None:
    cost = CallCost()
    for _ in range(3):
        # an MLP under load: 4 rows measured 2% dearer per row than 3; they are no dearer
        for rows, seconds in ((1, 0.0018), (2, 0.0018), (3, 0.00181), (4, 0.00246)):
            cost.record(rows, seconds)
    assert cost.measured_sizes(32) == (4, 4)  # the biggest measured counts as the cheapest: batches may grow
    for _ in range(3):
        cost.record(8, 0.008)  # 1 ms a row, 1.6x the cheapest: dearer, batches stop at 4
    assert cost.measured_sizes(32) == (4, 8)


# -- the size of each batch -------------------------------------------------------------------------


def test_batch_policy_limit_is_max_batch_size_while_nothing_is_measured() -> None:
    policy = BatchPolicy()
    assert policy.limit(1, 32, policy.pays()) == (32, False)
    assert policy.formed == 1


def test_batch_policy_limit_is_the_head_alone_while_batching_does_not_pay_and_no_size_is_measured() -> None:
    policy = BatchPolicy(_recorded([(1, 0.001), (4, 0.004)], repeat=1))  # each size seen once: not measured
    assert not policy.pays()
    assert policy.limit(3, 32, policy.pays()) == (3, False)


def test_batch_policy_limit_stops_at_the_size_measured_cheapest_per_row() -> None:
    policy = BatchPolicy(_recorded(DIGITS))
    assert not policy.pays()
    assert policy.limit(1, 8, policy.pays()) == (2, False)  # 2 rows cheaper per row; 4 rows dearer
    policy = BatchPolicy(_recorded([(1, 0.003), (4, 0.0032), (8, 0.008)]))  # the line says batching pays...
    assert policy.pays()
    assert policy.limit(1, 16, policy.pays()) == (4, False)  # ...but 8 rows cost more per row than 4


def test_batch_policy_limit_grows_to_max_batch_size_while_the_biggest_measured_is_the_cheapest() -> None:
    policy = BatchPolicy(_recorded(MLP))
    assert policy.limit(1, 16, policy.pays()) == (16, False)  # bigger than any size measured


def test_batch_policy_explores_once_every_explore_every_batches_up_to_twice_the_limit() -> None:
    policy = BatchPolicy(_recorded(DIGITS))
    limits = [policy.limit(1, 8, policy.pays()) for _ in range(2 * EXPLORE_EVERY)]
    exploring = [i for i, (_, explore) in enumerate(limits) if explore]
    assert exploring == [EXPLORE_EVERY - 1, 2 * EXPLORE_EVERY - 1]
    assert limits[EXPLORE_EVERY - 1] == (EXPLORE_ROWS, True)  # max(2 x 2, EXPLORE_ROWS), within max_batch_size
    assert BatchPolicy(_recorded(DIGITS)).limit(1, 3, False) == (2, False)


def test_batch_policy_explores_half_as_often_after_a_dearer_exploring_batch_and_resets_after_a_cheaper() -> None:
    policy = BatchPolicy(_recorded(DIGITS))
    policy.explored(4, 8)  # 4 rows cost more per row than 2
    assert policy.explore_every == 2 * EXPLORE_EVERY
    for _ in range(20):
        policy.explored(4, 8)
    assert policy.explore_every == EXPLORE_MAX
    policy.explored(2, 8)  # the cheapest size: as often as at first
    assert policy.explore_every == EXPLORE_EVERY


# -- how long a batch waits ---------------------------------------------------------------------------

CFG = BatchingConfig(max_batch_size=8, max_wait_ms=10.0)


def _wait(cost: CallCost, *, cfg: BatchingConfig = CFG, now: float = 100.0, rows: int = 1, busy: bool = False,
          coming: int = 0, everyone: bool = False, deadline: float = 130.0) -> float | None:  # fmt: skip
    return wait_until(cfg, cost, now, rows=rows, head_enqueued=99.999, head_deadline=deadline, opened=100.0,
                      busy=busy, coming=coming, everyone=everyone)  # fmt: skip


def test_wait_until_runs_an_idle_model_s_batch_at_once_when_nothing_is_coming() -> None:
    assert _wait(_recorded(MLP)) is None


def test_wait_until_waits_for_requests_coming_to_an_idle_model_no_longer_than_a_call_s_fixed_cost() -> None:
    cost = _recorded(MLP)
    assert _wait(cost, coming=2) == pytest.approx(100.0 + cost.fixed_s)  # under max_wait_ms (10 ms)
    all_fixed = _recorded([(1, 60.0), (4, 60.0)])
    assert _wait(all_fixed, coming=2) == pytest.approx(100.0 + CFG.max_wait_ms / 1000)


def test_wait_until_a_busy_model_s_batch_waits_up_to_max_wait_after_its_head_unless_everyone_is_in_it() -> None:
    cost = _recorded(MLP)
    assert _wait(cost, busy=True) == pytest.approx(99.999 + 0.010)
    assert _wait(cost, busy=True, everyone=True) is None
    assert _wait(cost, busy=True, everyone=True, coming=1) == pytest.approx(99.999 + 0.010)
    assert _wait(cost, busy=True, now=100.02) is None  # its wait is over


def test_wait_until_a_batch_under_min_batch_size_waits_until_its_head_s_deadline_nears() -> None:
    cfg = BatchingConfig(max_batch_size=8, max_wait_ms=10.0, min_batch_size=4)
    cost = _recorded(MLP)
    until = _wait(cost, cfg=cfg, rows=2, deadline=101.0)
    assert until == pytest.approx(101.0 - max(DEADLINE_MARGIN_S, 2 * cost.mean_s))
    assert _wait(cost, cfg=cfg, rows=2, deadline=101.0, now=101.0) is None
    assert _wait(cost, cfg=cfg, rows=4, deadline=101.0) is None  # big enough: the usual rules
