"""The agent's budgets object on fixture trees and a fake clock: the power budget enforced against
a RAPL counter that advances with the work, thermal back-off, recovery, the battery predicate,
the /metrics series and the stats line."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from device_agents.budgets.state import Budgets
from device_agents.config import BudgetsConfig
from tests.budgets.test_readers import RAPL, X86, tree

MB = 1024 * 1024


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _budgets(root: Path, clock: Clock, **config: object) -> Budgets:
    cfg = BudgetsConfig(sysfs_root=root, **config)  # type: ignore[arg-type]  # test keyword arguments
    return Budgets(cfg, root / "store", clock=clock, rss=lambda: 80 * MB)


def _advance(root: Path, joules: float) -> None:
    path = root / RAPL.format(0) / "energy_uj"
    path.write_text(f"{int(path.read_text()) + int(joules * 1e6)}\n")


def test_budgets_degrade_when_the_energy_counter_outruns_the_budget_and_recover(tmp_path: Path) -> None:
    root = tree(tmp_path, {k: v for k, v in X86.items() if "rapl:1" not in k and "thermal" not in k})
    clock = Clock()
    b = _budgets(root, clock, power_w=5.0, power_window_s=10.0, min_dwell_s=1.0)
    assert b.meter is not None and b.meter.name == "rapl"
    b.start()
    b.stop()  # sampled by hand below
    for _ in range(20):  # 10 W for 20 s against 5 W: the 50 J bucket empties after 10 s
        clock.now += 1.0
        _advance(root, 10.0)
        b.sample()
    assert b.level == 2 and b.power_w == pytest.approx(10.0)
    assert b.retry_after() >= 1
    for _ in range(20):  # idle: the bucket refills, one level at a time
        clock.now += 1.0
        b.sample()
    assert b.level == 0
    assert b.energy_j_total == pytest.approx(200.0)
    assert b.degradation is not None and b.degradation.changes >= 3


def test_budgets_back_off_before_a_thermal_trip_point(tmp_path: Path) -> None:
    root = tree(tmp_path, {k: v for k, v in X86.items() if "thermal_zone1" not in k})
    clock = Clock()
    b = _budgets(root, clock, thermal_c=90.0, thermal_margin_c=8.0, min_dwell_s=0.0)
    temp = root / "sys/class/thermal/thermal_zone0/temp"
    assert b.sample() == 0  # 61 C, limit 90 C (below the 95 C passive trip)
    temp.write_text("87500\n")  # 2.5 C below the limit: 0.31 of the margin
    clock.now = 1.0
    assert b.sample() == 0
    temp.write_text("88500\n")  # 1.5 C below: back off
    clock.now = 2.0
    assert b.sample() == 1
    temp.write_text("60000\n")
    clock.now = 3.0
    assert b.sample() == 0


def test_budgets_say_on_battery_from_the_power_supply(tmp_path: Path) -> None:
    root = tree(tmp_path, X86)
    b = _budgets(root, Clock())
    assert b.on_battery() is True
    (root / "sys/class/power_supply/AC/online").write_text("1\n")
    assert b.on_battery() is False


def test_budgets_export_the_budget_state_and_which_reader_is_in_use(tmp_path: Path) -> None:
    root = tree(tmp_path, X86)
    clock = Clock()
    b = _budgets(root, clock, memory_mb=512, power_w=20.0)
    registry = CollectorRegistry()
    b.register(registry)
    b.sample()
    clock.now = 2.0
    _advance(root, 6.0)
    b.sample()
    text = generate_latest(registry).decode()
    for line in (
        "edgekit_budget_memory_bytes 5.36870912e+08",
        "edgekit_rss_bytes 8.388608e+07",
        'edgekit_power_watts{reader="rapl"} 3.0',
        'edgekit_energy_joules_total{reader="rapl"} 6.0',
        "edgekit_degradation_level 0.0",
        'edgekit_budget_reader{detail="intel-rapl:0 package-0, intel-rapl:1 package-1",'
        'modelled="false",reader="rapl"} 1.0',
        'edgekit_temperature_celsius{limit_c="82",zone="thermal_zone1 acpitz"} 78.0',
    ):
        assert line in text, line
    assert b.line() == (
        "budgets: power 3.00 W (rapl); budget 20 W, 99% left; level 0; memory 80/512 MB (agent 80, no model; "
        "0 unloads, 0 refused); thermal_zone1 acpitz 78.0/82.0 C"
    )


def test_budgets_without_a_sensor_model_the_energy_or_warn_and_run(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    bare = tmp_path / "bare"
    bare.mkdir()
    modelled = _budgets(bare, Clock(), power_w=5.0, device_power_w=10.0)
    assert modelled.meter is not None and modelled.meter.modelled
    assert modelled.describe()["reader"] == "model" and modelled.describe()["modelled"] is True
    unread = Budgets(BudgetsConfig(sysfs_root=bare, power_w=5.0), bare, rss=lambda: 1, meter=None)
    if unread.meter is not None:  # an NVIDIA GPU on this machine: NVML is a sensor
        return
    with caplog.at_level(logging.WARNING, "edgekit.agent"):
        unread.start()
    unread.stop()
    assert any("power budget is not enforced" in r.message for r in caplog.records)
    assert unread.level == 0


def test_budgets_read_the_nvpmodel_mode_and_start_in_it_when_the_configured_one_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from tests.budgets.test_readers import ORIN

    root = tree(tmp_path, ORIN)
    b = _budgets(root, Clock()).start()
    b.stop()
    assert b.power_mode is not None and b.power_mode.current_name == "15W"
    assert b.describe()["nvpmodel"] == "15W"
    b = _budgets(root, Clock(), nvpmodel_mode=7)
    with caplog.at_level(logging.ERROR, "edgekit.agent"):
        b.start()
    b.stop()
    assert any("defines no such mode" in r.message for r in caplog.records)
    assert b.power_mode is not None and b.power_mode.current_name == "15W"


def test_budgets_report_their_state_as_numbers_for_the_reported_topic(tmp_path: Path) -> None:
    root = tree(tmp_path, X86)
    clock = Clock()
    b = _budgets(root, clock, memory_mb=512, power_w=20.0)
    b.sample()
    clock.now = 2.0
    _advance(root, 6.0)
    b.sample()
    assert b.report() == {
        "budget_level": 0.0,
        "budget_energy_j": 6.0,
        "budget_rss_mb": 80.0,
        "budget_power_w": 3.0,
        "budget_power_left": 0.99,
        "budget_memory_mb": 512.0,
        "budget_temp_c": 78.0,
    }


def test_budget_line_reads_the_daemon_metrics(tmp_path: Path) -> None:
    from device_agents.budgets.state import budget_line

    root = tree(tmp_path, X86)
    clock = Clock()
    b = _budgets(root, clock, memory_mb=512, power_w=20.0)
    registry = CollectorRegistry()
    b.register(registry)
    b.sample()
    clock.now = 2.0
    _advance(root, 6.0)
    b.sample()
    assert budget_line(generate_latest(registry).decode()) == (
        "budgets: power 3.00 W (rapl); 99% of the power budget left; level 0; memory 80/512 MB (no model; 0 unloads)"
    )


def test_budgets_sample_in_the_background_again_after_a_restart(tmp_path: Path) -> None:
    import time

    root = tree(tmp_path, {k: v for k, v in X86.items() if "rapl:1" not in k})
    b = Budgets(BudgetsConfig(sysfs_root=root, sample_interval_s=0.01), root, rss=lambda: 1)
    for _ in range(2):
        b.start()
        before = b.energy_j_total
        _advance(root, 1.0)
        deadline = time.monotonic() + 30
        while b.energy_j_total < before + 1.0 and time.monotonic() < deadline:
            time.sleep(0.01)
        b.stop()
        assert b.energy_j_total == pytest.approx(before + 1.0)
