"""Each power and thermal reader on a fixture tree that copies its platform's sysfs layout
(an x86 laptop with RAPL, thermal zones and a battery; a Jetson Orin with INA3221 rails and
nvpmodel), including counter wraparound, missing files and garbage values."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from device_agents.budgets.energy import HwmonMeter, ModelMeter, NvmlMeter, RaplMeter, SumMeter, pick_meter
from device_agents.budgets.nvpmodel import NvpModel, PowerModeError
from device_agents.budgets.power_supply import PowerSupplyReader
from device_agents.budgets.thermal import ThermalReader


def tree(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


RAPL = "sys/class/powercap/intel-rapl:{}"
# An x86 laptop: two packages (each with a core sub-zone that must not be counted again).
X86 = {
    f"{RAPL.format(0)}/name": "package-0\n",
    f"{RAPL.format(0)}/energy_uj": "1000000\n",
    f"{RAPL.format(0)}/max_energy_range_uj": "262143328850\n",
    f"{RAPL.format('0:0')}/name": "core\n",
    f"{RAPL.format('0:0')}/energy_uj": "500000\n",
    f"{RAPL.format('0:0')}/max_energy_range_uj": "262143328850\n",
    f"{RAPL.format(1)}/name": "package-1\n",
    f"{RAPL.format(1)}/energy_uj": "2000000\n",
    f"{RAPL.format(1)}/max_energy_range_uj": "262143328850\n",
    "sys/class/thermal/thermal_zone0/type": "x86_pkg_temp\n",
    "sys/class/thermal/thermal_zone0/temp": "61000\n",
    "sys/class/thermal/thermal_zone0/trip_point_0_type": "passive\n",
    "sys/class/thermal/thermal_zone0/trip_point_0_temp": "95000\n",
    "sys/class/thermal/thermal_zone0/trip_point_1_type": "critical\n",
    "sys/class/thermal/thermal_zone0/trip_point_1_temp": "105000\n",
    "sys/class/thermal/thermal_zone1/type": "acpitz\n",
    "sys/class/thermal/thermal_zone1/temp": "78000\n",
    "sys/class/thermal/thermal_zone1/trip_point_0_type": "active\n",  # a fan: not a limit
    "sys/class/thermal/thermal_zone1/trip_point_0_temp": "60000\n",
    "sys/class/thermal/thermal_zone1/trip_point_1_type": "critical\n",
    "sys/class/thermal/thermal_zone1/trip_point_1_temp": "82000\n",
    "sys/class/power_supply/AC/type": "Mains\n",
    "sys/class/power_supply/AC/online": "0\n",
    "sys/class/power_supply/BAT0/type": "Battery\n",
    "sys/class/power_supply/BAT0/present": "1\n",
    "sys/class/power_supply/BAT0/status": "Discharging\n",
    "sys/class/power_supply/BAT0/capacity": "57\n",
}
HWMON = "sys/class/hwmon/hwmon{}"
# A Jetson Orin: INA3221 channels VDD_IN (the board), VDD_CPU_GPU_CV, VDD_SOC; a fan sensor.
ORIN = {
    f"{HWMON.format(0)}/name": "pwmfan\n",
    f"{HWMON.format(0)}/fan1_input": "3000\n",
    f"{HWMON.format(1)}/name": "ina3221\n",
    f"{HWMON.format(1)}/in1_label": "VDD_IN\n",
    f"{HWMON.format(1)}/in1_input": "5000\n",  # mV
    f"{HWMON.format(1)}/curr1_input": "1200\n",  # mA: 6 W
    f"{HWMON.format(1)}/in2_label": "VDD_CPU_GPU_CV\n",
    f"{HWMON.format(1)}/in2_input": "5000\n",
    f"{HWMON.format(1)}/curr2_input": "400\n",
    f"{HWMON.format(1)}/in3_label": "VDD_SOC\n",
    f"{HWMON.format(1)}/in3_input": "5000\n",
    f"{HWMON.format(1)}/curr3_input": "300\n",
    f"{HWMON.format(1)}/in7_input": "20\n",  # a shunt-voltage sum channel: no current, not a rail
    "etc/nvpmodel.conf": (
        "< POWER_MODEL ID=0 NAME=MAXN >\nCPU_ONLINE CORE_0 1\n< POWER_MODEL ID=1 NAME=10W >\n"
        "CPU_ONLINE CORE_0 1\n< POWER_MODEL ID=2 NAME=15W >\n< PM_CONFIG DEFAULT=2 >\n"
    ),
    "var/lib/nvpmodel/status": "pmode:0002 fmode:quiet\n",
}


def test_rapl_meter_counts_packages_not_their_sub_zones(tmp_path: Path) -> None:
    root = tree(tmp_path, X86)
    meter = RaplMeter.probe(root)
    assert meter is not None and meter.describe() == "rapl (intel-rapl:0 package-0, intel-rapl:1 package-1)"
    assert meter.sample(0.0) == 0.0
    (root / RAPL.format(0) / "energy_uj").write_text("3000000\n")  # +2 J
    (root / RAPL.format("0:0") / "energy_uj").write_text("9000000\n")  # a part of package-0
    (root / RAPL.format(1) / "energy_uj").write_text("2500000\n")  # +0.5 J
    assert meter.sample(1.0) == pytest.approx(2.5)


def test_rapl_meter_undoes_the_counter_wraparound(tmp_path: Path) -> None:
    root = tree(tmp_path, {k: v for k, v in X86.items() if "rapl:1" not in k})
    (root / RAPL.format(0) / "max_energy_range_uj").write_text("10000000\n")  # wraps every 10 J
    (root / RAPL.format(0) / "energy_uj").write_text("9500000\n")
    meter = RaplMeter.probe(root)
    assert meter is not None
    meter.sample(0.0)
    (root / RAPL.format(0) / "energy_uj").write_text("700000\n")  # 9.5 J -> wrapped -> 0.7 J
    assert meter.sample(1.0) == pytest.approx(1.2)


def test_rapl_meter_uses_the_platform_zone_alone_when_present(tmp_path: Path) -> None:
    root = tree(tmp_path, X86)
    tree(root, {f"{RAPL.format(2)}/name": "psys\n", f"{RAPL.format(2)}/energy_uj": "5\n",
                f"{RAPL.format(2)}/max_energy_range_uj": "262143328850\n"})  # fmt: skip
    meter = RaplMeter.probe(root)
    assert meter is not None and meter.detail == "intel-rapl:2 psys"


def test_rapl_meter_is_unavailable_when_files_are_missing_or_garbage(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tree(tmp_path, {f"{RAPL.format(0)}/name": "package-0\n", f"{RAPL.format(0)}/energy_uj": "12\n",
                           f"{RAPL.format(1)}/name": "package-1\n", f"{RAPL.format(1)}/energy_uj": "n/a\n",
                           f"{RAPL.format(1)}/max_energy_range_uj": "100\n"})  # fmt: skip
    with caplog.at_level(logging.WARNING, "edgekit.agent"):
        assert RaplMeter.probe(root) is None
    assert sum("powercap intel-rapl" in r.message for r in caplog.records) == 2
    assert RaplMeter.probe(tmp_path / "nothing") is None


def test_rapl_meter_logs_a_counter_that_vanishes_once_and_reads_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tree(tmp_path, X86)
    meter = RaplMeter.probe(root)
    assert meter is not None
    meter.sample(0.0)
    (root / RAPL.format(1) / "energy_uj").unlink()
    (root / RAPL.format(0) / "energy_uj").write_text("2000000\n")
    with caplog.at_level(logging.WARNING, "edgekit.agent"):
        assert meter.sample(1.0) == pytest.approx(1.0)
        assert meter.sample(2.0) == pytest.approx(0.0)
    assert sum("intel-rapl:1" in r.message for r in caplog.records) == 1
    (root / RAPL.format(0) / "energy_uj").unlink()
    assert meter.sample(3.0) is None  # nothing readable: no number rather than a made-up 0


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_rapl_meter_is_unavailable_when_energy_uj_is_root_only(tmp_path: Path) -> None:
    root = tree(tmp_path, {k: v for k, v in X86.items() if "rapl:1" not in k})
    (root / RAPL.format(0) / "energy_uj").chmod(0o000)
    assert RaplMeter.probe(root) is None


def test_hwmon_meter_reads_the_jetson_board_input_rail_alone(tmp_path: Path) -> None:
    root = tree(tmp_path, ORIN)
    meter = HwmonMeter.probe(root)
    assert meter is not None and meter.describe() == "hwmon (ina3221 hwmon1: VDD_IN)"
    assert meter.power_w() == pytest.approx(6.0)
    assert meter.sample(10.0) == 0.0
    (root / HWMON.format(1) / "curr1_input").write_text("1600\n")  # 8 W
    assert meter.sample(12.0) == pytest.approx((6.0 + 8.0) / 2 * 2)  # trapezoid over 2 s


def test_hwmon_meter_sums_rails_without_a_board_input_and_reads_power_inputs(tmp_path: Path) -> None:
    files = {k: v for k, v in ORIN.items() if "in1_" not in k and "curr1" not in k}
    files |= {f"{HWMON.format(2)}/name": "ina226\n", f"{HWMON.format(2)}/power1_input": "1500000\n"}  # uW
    meter = HwmonMeter.probe(tree(tmp_path, files))
    assert meter is not None
    assert meter.power_w() == pytest.approx(2.0 + 1.5 + 1.5)
    assert "VDD_CPU_GPU_CV" in meter.detail and "power1" in meter.detail


def test_hwmon_meter_skips_garbage_channels_and_non_board_sensors(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = {f"{HWMON.format(1)}/name": "ina3221\n", f"{HWMON.format(1)}/in1_input": "5000\n",
             f"{HWMON.format(1)}/curr1_input": "garbage\n",
             f"{HWMON.format(2)}/name": "amdgpu\n", f"{HWMON.format(2)}/power1_input": "30000000\n"}  # fmt: skip
    with caplog.at_level(logging.WARNING, "edgekit.agent"):
        assert HwmonMeter.probe(tree(tmp_path, files)) is None
    assert any("ina3221" in r.message and "unreadable" in r.message for r in caplog.records)


def test_model_meter_is_busy_time_times_device_power_labelled_a_model() -> None:
    busy = [10.0]
    meter = ModelMeter(8.0, cpu_seconds=lambda: busy[0], cpus=4)
    assert meter.modelled and meter.name == "model"
    assert meter.sample(0.0) == 0.0
    busy[0] = 12.0  # 2 CPU-seconds on a 4-CPU device at 8 W busy
    assert meter.sample(1.0) == pytest.approx(4.0)


def test_pick_meter_prefers_the_board_rail_then_rapl_then_the_model(tmp_path: Path) -> None:
    orin = pick_meter(tree(tmp_path / "orin", ORIN), nvml=False)
    assert isinstance(orin, HwmonMeter)
    x86 = pick_meter(tree(tmp_path / "x86", X86), device_power_w=15.0, nvml=False)
    assert isinstance(x86, RaplMeter)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert pick_meter(bare, nvml=False) is None
    model = pick_meter(bare, device_power_w=15.0, nvml=False)
    assert isinstance(model, ModelMeter) and model.modelled


def test_sum_meter_counts_what_its_parts_read(tmp_path: Path) -> None:
    rapl = RaplMeter.probe(tree(tmp_path, X86))
    busy = [0.0]
    assert rapl is not None
    meter = SumMeter([rapl, ModelMeter(4.0, cpu_seconds=lambda: busy[0], cpus=1)])
    assert meter.name == "rapl+model"
    meter.sample(0.0)
    (tmp_path / RAPL.format(0) / "energy_uj").write_text("2000000\n")
    busy[0] = 0.5
    assert meter.sample(1.0) == pytest.approx(1.0 + 2.0)


def test_nvml_meter_is_unavailable_without_an_nvidia_driver_and_reads_a_gpu_where_there_is_one() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        assert NvmlMeter.probe() is None  # the library is installed; no driver here
        return
    meter = NvmlMeter.probe()
    assert meter is not None and meter.name == "nvml"
    assert meter.sample(0.0) == 0.0
    used = meter.sample(1.0)
    assert used is not None and used >= 0.0


def test_thermal_reader_gives_the_zone_nearest_its_lowest_limit(tmp_path: Path) -> None:
    root = tree(tmp_path, X86)
    reader = ThermalReader.probe(root)
    assert reader is not None
    reading = reader.read()
    assert reading is not None
    # zone1 (acpitz): 78 C against its critical 82 C (the 60 C active trip is a fan, not a limit)
    assert (reading.zone, reading.temp_c, reading.limit_c, reading.headroom_c) == (
        "thermal_zone1 acpitz",
        78.0,
        82.0,
        4.0,
    )
    (root / "sys/class/thermal/thermal_zone0/temp").write_text("93000\n")  # 2 C below its passive trip
    reading = reader.read()
    assert reading is not None and reading.zone == "thermal_zone0 x86_pkg_temp" and reading.headroom_c == 2.0


def test_thermal_reader_applies_the_configured_limit_and_skips_broken_zones(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    files = dict(X86)
    files["sys/class/thermal/thermal_zone1/temp"] = "hot\n"
    files["sys/class/thermal/thermal_zone2/type"] = "board\n"  # no trip points: only the configured limit
    files["sys/class/thermal/thermal_zone2/temp"] = "50000\n"
    with caplog.at_level(logging.WARNING, "edgekit.agent"):
        reader = ThermalReader.probe(tree(tmp_path, files), limit_c=70.0)
    assert reader is not None and [z.name for z in reader.zones] == ["thermal_zone0", "thermal_zone2"]
    assert any("thermal_zone1" in r.message for r in caplog.records)
    reading = reader.read()
    assert reading is not None and (reading.zone, reading.limit_c, reading.headroom_c) == (
        "thermal_zone0 x86_pkg_temp",
        70.0,
        9.0,
    )
    (tmp_path / "sys/class/thermal/thermal_zone0/temp").unlink()
    reading = reader.read()
    assert reading is not None and reading.zone == "thermal_zone2 board"
    assert ThermalReader.probe(tmp_path / "nothing") is None


def test_power_supply_reader_says_on_battery_only_while_discharging_off_mains(tmp_path: Path) -> None:
    root = tree(tmp_path, X86)
    reader = PowerSupplyReader.probe(root)
    assert reader is not None
    state = reader.read()
    assert (state.on_battery, state.battery_percent) == (True, 57.0)
    (root / "sys/class/power_supply/AC/online").write_text("1\n")
    (root / "sys/class/power_supply/BAT0/status").write_text("Charging\n")
    assert reader.read().on_battery is False
    mains_only = tree(tmp_path / "mains", {"sys/class/power_supply/AC/type": "Mains\n",
                                           "sys/class/power_supply/AC/online": "1\n"})  # fmt: skip
    supply = PowerSupplyReader.probe(mains_only)
    assert supply is not None and supply.read().on_battery is None  # no battery at all
    garbage = tree(tmp_path / "garbage", {"sys/class/power_supply/BAT0/type": "Battery\n",
                                          "sys/class/power_supply/BAT0/capacity": "lots\n"})  # fmt: skip
    supply = PowerSupplyReader.probe(garbage)
    assert supply is not None and supply.read().battery_percent is None


def test_nvpmodel_reads_the_modes_and_the_one_in_force(tmp_path: Path) -> None:
    reader = NvpModel.probe(tree(tmp_path, ORIN))
    assert reader is not None
    mode = reader.read()
    assert mode.modes == {0: "MAXN", 1: "10W", 2: "15W"}
    assert (mode.default_id, mode.current_id, mode.current_name, mode.source) == (2, 2, "15W", "status file")
    assert NvpModel.probe(tmp_path / "x86") is None


def test_nvpmodel_asks_the_tool_and_sets_a_configured_mode_through_it(tmp_path: Path) -> None:
    files = {k: v for k, v in ORIN.items() if "status" not in k}
    root = tree(tmp_path, files)
    # The tool's interface (nvpmodel -q / -m ID), keeping its mode in a file of the fixture tree.
    tool = root / "usr/sbin/nvpmodel"
    tool.parent.mkdir(parents=True)
    state = root / "tool-mode"
    state.write_text("0")
    tool.write_text(
        "#!/bin/sh\n"
        f'if [ "$1" = "-q" ]; then echo "NV Power Mode: X"; cat {state}; echo; exit 0; fi\n'
        f'if [ "$1" = "-m" ]; then echo -n "$2" > {state}; exit 0; fi\nexit 2\n'
    )
    tool.chmod(0o755)
    reader = NvpModel.probe(root)
    assert reader is not None
    assert (reader.read().current_id, reader.read().source) == (0, "nvpmodel -q")
    assert reader.set_mode(1).current_name == "10W"
    assert state.read_text() == "1"
    with pytest.raises(PowerModeError, match=r"defines no such mode \(modes: 0 \(MAXN\), 1 \(10W\), 2 \(15W\)\)"):
        reader.set_mode(7)
