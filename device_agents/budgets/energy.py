"""Energy meters: what the device used, in joules, from its own sensors where it has them.

Each meter is chosen when its sensors are present (``probe`` returns None otherwise, with one
log line when a sensor is there but unreadable) and answers ``sample(now)``: the joules used
since its previous sample (0.0 on the first), or None when that reading failed.

- ``RaplMeter``: Linux powercap (``/sys/class/powercap/intel-rapl:N``, Intel and AMD CPUs): a
  cumulative ``energy_uj`` counter per package that wraps at ``max_energy_range_uj``.
- ``HwmonMeter``: board power monitors through hwmon (``ina*``): a Jetson's INA3221
  (``in*_input`` millivolts x ``curr*_input`` milliamps per labelled channel), or
  ``power*_input`` (microwatts) where the driver gives it; power is sampled and integrated over
  time. On a Jetson the ``VDD_IN`` rail is the whole board, so it alone is counted when present
  (the others are parts of it).
- ``NvmlMeter``: NVIDIA GPUs through NVML (``pynvml``, imported here only): the driver's
  energy counter (Volta and later), else its power reading integrated.
- ``ModelMeter``: where no sensor is: the agent's CPU busy time x ``device_power_w`` / the CPUs it
  may use. It is a model, not a measurement, and says so (``modelled``; ``reader="model"`` in
  ``/metrics``).

``pick_meter`` chooses: the board's input rail (hwmon) when present, as it includes everything;
else RAPL and NVML together (CPU packages + GPUs); else the model when ``device_power_w`` is set.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from device_agents.budgets.sysfs import LogOnce, read_int, read_text, under
from device_agents.cpus import affinity_cpus

log = logging.getLogger("edgekit.agent")

# The hwmon channel that is the whole board's input on Jetson modules (Orin: VDD_IN; Xavier and
# Nano's INA3221 labels: VDD_IN / POM_5V_IN / VIN_SYS_5V0); when one is present it alone counts.
BOARD_INPUT_RAILS = ("VDD_IN", "POM_5V_IN", "VIN_SYS_5V0", "VDD_IN_TOTAL")
_RAPL_TOP = re.compile(r"^intel-rapl:\d+$")


class EnergyMeter:
    """Base of the meters: ``name`` (the ``reader`` label), ``detail`` (what it reads), ``modelled``."""

    name = ""
    modelled = False

    def __init__(self, detail: str) -> None:
        self.detail = detail
        self.problems = LogOnce()

    def sample(self, now: float) -> float | None:
        """Joules used since the previous sample (0.0 on the first); None when the reading failed."""
        raise NotImplementedError

    def describe(self) -> str:
        return f"{self.name} ({self.detail})" if self.detail else self.name


class _WrappingCounter:
    """A cumulative counter that restarts at 0 after ``max_range`` (RAPL's ``energy_uj``)."""

    __slots__ = ("last", "max_range")

    def __init__(self, max_range: int) -> None:
        self.max_range = max_range
        self.last: int | None = None

    def advance(self, value: int) -> int:
        """The increase since the last value (0 for the first); one wrap between reads is undone."""
        last, self.last = self.last, value
        if last is None:
            return 0
        if value >= last:
            return value - last
        return value + self.max_range - last


class RaplMeter(EnergyMeter):
    """CPU package energy from Linux powercap. Sub-zones (core, uncore, dram) are parts of their
    package and are not counted again; a ``psys`` zone (the whole platform) is counted alone."""

    name = "rapl"

    def __init__(self, zones: Sequence[tuple[Path, str, int]]) -> None:
        super().__init__(", ".join(f"{p.name} {label}" for p, label, _ in zones))
        self.zones = [(p / "energy_uj", _WrappingCounter(max_range)) for p, _, max_range in zones]

    @classmethod
    def probe(cls, root: Path | str = "/") -> RaplMeter | None:
        base = under(root, "/sys/class/powercap")
        if not base.is_dir():
            return None
        zones = []
        for zone in sorted(p for p in base.iterdir() if _RAPL_TOP.match(p.name)):
            label = read_text(zone / "name") or zone.name
            energy, max_range = read_int(zone / "energy_uj"), read_int(zone / "max_energy_range_uj")
            if energy is None or max_range is None or max_range <= 0 or energy < 0:
                log.warning(
                    "powercap %s: energy_uj / max_energy_range_uj missing, unreadable (root only on recent "
                    "kernels: run the agent as root or grant read access) or not a number; not used",
                    zone.name,
                )
                continue
            zones.append((zone, label, max_range))
        platform = [z for z in zones if z[1].startswith("psys")]
        chosen = platform or zones
        return cls(chosen) if chosen else None

    def sample(self, now: float) -> float | None:
        total_uj = 0
        ok = False
        for path, counter in self.zones:
            value = read_int(path)
            if value is None or value < 0:
                self.problems.warn(f"powercap {path.parent.name}: energy_uj unreadable; its energy is not counted")
                continue
            total_uj += counter.advance(value)
            ok = True
        return total_uj / 1e6 if ok else None


class _Integrator:
    """Joules from power readings: the trapezoid between successive samples."""

    __slots__ = ("last_t", "last_w")

    def __init__(self) -> None:
        self.last_t: float | None = None
        self.last_w = 0.0

    def add(self, watts: float, now: float) -> float:
        last_t, last_w = self.last_t, self.last_w
        self.last_t, self.last_w = now, watts
        if last_t is None or now <= last_t:
            return 0.0
        return (last_w + watts) / 2 * (now - last_t)


class HwmonMeter(EnergyMeter):
    """Power rails read through hwmon and integrated over time."""

    name = "hwmon"

    def __init__(self, sensor: str, channels: Sequence[tuple[str, Path, Path | None]]) -> None:
        """``channels``: (label, power_uw file, None) or (label, millivolt file, milliamp file)."""
        super().__init__(f"{sensor}: {', '.join(label for label, _, _ in channels)}")
        self.channels = list(channels)
        self._integrator = _Integrator()

    @classmethod
    def probe(cls, root: Path | str = "/") -> HwmonMeter | None:
        base = under(root, "/sys/class/hwmon")
        if not base.is_dir():
            return None
        found: list[tuple[str, list[tuple[str, Path, Path | None]]]] = []
        for hw in sorted(base.iterdir(), key=lambda p: p.name):
            sensor = read_text(hw / "name") or hw.name
            if not sensor.startswith("ina"):  # board power monitors (INA3221, INA226...); not a GPU's own sensor
                continue
            channels: list[tuple[str, Path, Path | None]] = []
            for power in sorted(hw.glob("power*_input")):
                n = power.name[len("power") : -len("_input")]
                channels.append((read_text(hw / f"power{n}_label") or f"power{n}", power, None))
            if not channels:
                for volts in sorted(hw.glob("in*_input")):
                    n = volts.name[len("in") : -len("_input")]
                    amps = hw / f"curr{n}_input"
                    if amps.exists():
                        channels.append((read_text(hw / f"in{n}_label") or f"in{n}", volts, amps))
            if not channels:
                continue
            readable = [c for c in channels if _channel_watts(c) is not None]
            if not readable:
                log.warning("hwmon %s (%s): power channels unreadable or not numbers; not used", sensor, hw.name)
                continue
            found.append((f"{sensor} {hw.name}", readable))
        if not found:
            return None
        for sensor, channels in found:  # the board's input rail, where one is labelled, is everything
            board = [c for c in channels if c[0].upper() in BOARD_INPUT_RAILS]
            if board:
                return cls(sensor, board[:1])
        sensor = " + ".join(s for s, _ in found)
        return cls(sensor, [c for _, channels in found for c in channels])

    def power_w(self) -> float | None:
        total, ok = 0.0, False
        for channel in self.channels:
            watts = _channel_watts(channel)
            if watts is None:
                self.problems.warn(f"hwmon {channel[0]}: reading failed; its power is not counted")
                continue
            total += watts
            ok = True
        return total if ok else None

    def sample(self, now: float) -> float | None:
        watts = self.power_w()
        return None if watts is None else self._integrator.add(watts, now)


def _channel_watts(channel: tuple[str, Path, Path | None]) -> float | None:
    _, first, amps = channel
    if amps is None:
        uw = read_int(first)
        return None if uw is None or uw < 0 else uw / 1e6
    mv, ma = read_int(first), read_int(amps)
    if mv is None or ma is None:
        return None
    return max(0.0, mv * ma / 1e6)


class NvmlMeter(EnergyMeter):
    """NVIDIA GPUs through NVML: each GPU's energy counter (millijoules since the driver loaded),
    or its power draw integrated where the GPU has no counter (before Volta)."""

    name = "nvml"

    def __init__(self, nvml: Any, gpus: Sequence[tuple[str, Any, bool]]) -> None:
        super().__init__(", ".join(name for name, _, _ in gpus))
        self._nvml = nvml
        self._gpus = [(name, handle, counter, _Integrator()) for name, handle, counter in gpus]
        self._last_mj: dict[str, int] = {}

    @classmethod
    def probe(cls) -> NvmlMeter | None:
        try:
            import pynvml
        except ImportError:
            return None
        try:
            pynvml.nvmlInit()
            gpus = []
            for i in range(pynvml.nvmlDeviceGetCount()):
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                name = pynvml.nvmlDeviceGetName(handle)
                name = f"{i} {name.decode() if isinstance(name, bytes) else name}"
                try:
                    pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
                    counter = True
                except pynvml.NVMLError:
                    pynvml.nvmlDeviceGetPowerUsage(handle)  # neither: NVMLError, the GPU is not metered
                    counter = False
                gpus.append((name, handle, counter))
        except pynvml.NVMLError as exc:  # no driver, no GPU, or a GPU that reports no power
            log.info("NVML: no GPU power reading (%s)", exc)
            return None
        return cls(pynvml, gpus) if gpus else None

    def sample(self, now: float) -> float | None:
        nvml = self._nvml
        joules, ok = 0.0, False
        for name, handle, counter, integrator in self._gpus:
            try:
                if counter:
                    mj = int(nvml.nvmlDeviceGetTotalEnergyConsumption(handle))
                    last = self._last_mj.get(name)
                    self._last_mj[name] = mj
                    joules += 0.0 if last is None or mj < last else (mj - last) / 1e3
                else:
                    joules += integrator.add(nvml.nvmlDeviceGetPowerUsage(handle) / 1e3, now)
                ok = True
            except nvml.NVMLError as exc:
                self.problems.warn(f"NVML GPU {name}: reading failed ({exc}); its energy is not counted")
        return joules if ok else None


class ModelMeter(EnergyMeter):
    """No sensor: CPU busy time of the agent x ``device_power_w`` / the CPUs it may use (a busy
    device draws ``device_power_w``). A model: ``modelled`` is True and ``/metrics`` says so."""

    name = "model"
    modelled = True

    def __init__(
        self, device_power_w: float, *, cpu_seconds: Callable[[], float] = time.process_time, cpus: int = 0
    ) -> None:
        self.cpus = cpus or len(affinity_cpus()) or 1
        super().__init__(f"busy time x {device_power_w:g} W / {self.cpus} CPUs")
        self.device_power_w = device_power_w
        self._cpu_seconds = cpu_seconds
        self._last: float | None = None

    def sample(self, now: float) -> float | None:
        busy = self._cpu_seconds()
        last, self._last = self._last, busy
        if last is None:
            return 0.0
        return max(0.0, busy - last) / self.cpus * self.device_power_w


class SumMeter(EnergyMeter):
    """Several meters counted together (CPU packages and GPUs)."""

    def __init__(self, parts: Sequence[EnergyMeter]) -> None:
        super().__init__(", ".join(p.describe() for p in parts))
        self.name = "+".join(p.name for p in parts)
        self.parts = list(parts)

    def sample(self, now: float) -> float | None:
        readings = [p.sample(now) for p in self.parts]
        got = [r for r in readings if r is not None]
        return sum(got) if got else None


def pick_meter(root: Path | str = "/", *, device_power_w: float | None = None, nvml: bool = True) -> EnergyMeter | None:
    """The meter this device has (see the module docstring); None when it has none and no
    ``device_power_w`` is set to model one."""
    hwmon = HwmonMeter.probe(root)
    if hwmon is not None:
        return hwmon
    parts: list[EnergyMeter] = []
    rapl = RaplMeter.probe(root)
    if rapl is not None:
        parts.append(rapl)
    gpu = NvmlMeter.probe() if nvml else None
    if gpu is not None:
        parts.append(gpu)
    if len(parts) == 1:
        return parts[0]
    if parts:
        return SumMeter(parts)
    if device_power_w:
        return ModelMeter(device_power_w)
    return None
