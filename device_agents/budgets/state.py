"""The agent's budgets as one object: the memory budget, the sensors, the power budget's bucket
and the degradation level, sampled by one background thread and exported to ``/metrics``.

``level`` is a plain attribute (read by the admission stage on every request, written by the
sampler): 0 normal, ``k`` = the first ``k`` steps of ``[budgets] degrade`` are on. Where no
power budget and no temperature limit is set, it stays 0 and the sensors are only reported.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from device_agents.budgets.energy import EnergyMeter, pick_meter
from device_agents.budgets.memory import FOOTPRINTS_NAME, Footprints, MemoryBudget, current_rss_bytes
from device_agents.budgets.nvpmodel import NvpModel, PowerMode, PowerModeError
from device_agents.budgets.power import Degradation, EnergyBucket, thermal_pressure
from device_agents.budgets.power_supply import PowerSupplyReader
from device_agents.budgets.thermal import ThermalReader, ThermalReading
from device_agents.config import AgentConfig, BudgetsConfig

log = logging.getLogger("edgekit.agent")


class Budgets:
    """Everything ``[budgets]`` asks for, and the sensor readings ``/metrics`` always shows."""

    def __init__(
        self,
        config: BudgetsConfig,
        store_root: Path,
        *,
        retry_after_s: int = 1,
        clock: Callable[[], float] = time.monotonic,
        rss: Callable[[], int] = current_rss_bytes,
        meter: EnergyMeter | None = None,
    ) -> None:
        self.config = config
        self.clock = clock
        self.rss = rss
        self.retry_after_s = retry_after_s
        self.memory: MemoryBudget | None = None
        if config.memory_bytes is not None:
            self.memory = MemoryBudget(
                config.memory_bytes,
                footprints=Footprints(Path(store_root) / FOOTPRINTS_NAME),
                when_full=config.when_full,
                reload=config.reload,
                retry_after_s=retry_after_s,
                rss=rss,
            )
        root = config.sysfs_root
        self.meter = meter if meter is not None else pick_meter(root, device_power_w=config.device_power_w)
        self.thermal = ThermalReader.probe(root, limit_c=config.thermal_c)
        self.supply = PowerSupplyReader.probe(root)
        self.nvpmodel = NvpModel.probe(root)
        now = clock()
        budget_w = config.budget_w
        self.bucket = EnergyBucket(budget_w, config.power_window_s, now) if budget_w is not None else None
        self.degradation = (
            Degradation(len(config.degrade), hysteresis=config.hysteresis, min_dwell_s=config.min_dwell_s)
            if config.degrades
            else None
        )
        self.level = 0
        self.energy_j_total = 0.0
        self.power_w: float | None = None
        self.temperature: ThermalReading | None = None
        self.power_mode: PowerMode | None = None
        self._last_sample: float | None = None
        self._sample_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.reason = ""  # why the level is what it is (for the messages of refused requests)
        _live[Path(store_root)] = self

    # -- start / stop ------------------------------------------------------------------------
    def start(self) -> Budgets:
        """Set the configured power mode, say what is read, start sampling."""
        if self.nvpmodel is not None:
            self.power_mode = self.nvpmodel.read()
            if self.config.nvpmodel_mode is not None:
                try:
                    self.power_mode = self.nvpmodel.set_mode(self.config.nvpmodel_mode)
                except PowerModeError as exc:  # the agent serves on in the mode the board is in
                    log.error("budgets: %s", exc)
        if self.config.budget_w is not None and self.meter is None:
            log.warning(
                "[budgets] power budget set, but this device has no energy sensor the agent reads (powercap, "
                "INA3221 hwmon, NVML) and no device_power_w to model one: the power budget is not enforced; set "
                "[budgets] device_power_w to the device's power when busy"
            )
        log.info(
            "budgets: energy %s%s; thermal %s; memory %s",
            self.meter.describe() if self.meter else "not read",
            " (a model, not a measurement)" if self.meter is not None and self.meter.modelled else "",
            f"{len(self.thermal.zones)} zones" if self.thermal else "no zones",
            f"{self.memory.budget_bytes >> 20} MB (the agent itself {self.memory.baseline_bytes >> 20} MB)"
            if self.memory
            else "no budget",
        )
        self.sample()
        if self._thread is None and (self.meter is not None or self.thermal is not None):
            self._thread = threading.Thread(target=self._run, name="budgets", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._thread, self._stop = None, threading.Event()  # a later start samples again

    def _run(self) -> None:
        while not self._stop.wait(self.config.sample_interval_s):
            try:
                self.sample()
            except Exception:  # a sensor's driver may raise anything; the sampler must go on
                log.exception("budgets: sampling failed; trying again next interval")

    # -- sampling ------------------------------------------------------------------------------
    def sample(self, now: float | None = None) -> int:
        """Read the sensors once, drain the bucket, update the level; the level."""
        with self._sample_lock:
            now = self.clock() if now is None else now
            joules = self.meter.sample(now) if self.meter is not None else None
            last, self._last_sample = self._last_sample, now
            if joules is not None:
                self.energy_j_total += joules
                if last is not None and now > last:
                    self.power_w = joules / (now - last)
            if self.bucket is not None:
                self.bucket.spend(joules or 0.0, now)
            self.temperature = self.thermal.read() if self.thermal is not None else None
            if self.degradation is not None:
                pressure = math.inf
                if self.bucket is not None and self.meter is not None:
                    pressure = self.bucket.fill
                if self.temperature is not None:
                    pressure = min(
                        pressure, thermal_pressure(self.temperature.headroom_c, self.config.thermal_margin_c)
                    )
                if pressure != math.inf:
                    before = self.level
                    self.level = self.degradation.update(pressure, now)
                    self.reason = self._why(pressure)
                    if self.level != before:
                        log.warning("budgets: degradation level %d -> %d (%s)", before, self.level, self.reason)
            return self.level

    def _why(self, pressure: float) -> str:
        parts = []
        if self.bucket is not None:
            parts.append(f"power budget {self.bucket.fill * 100:.0f}% left")
        if self.temperature is not None:
            t = self.temperature
            parts.append(f"{t.zone} {t.temp_c:.1f} C, limit {t.limit_c:.1f} C")
        return "; ".join(parts) or f"pressure {pressure:.2f}"

    def step(self, name: str) -> int:
        """The level at which degradation step ``name`` is on (1-based); 0 if not configured."""
        return self.config.degrade.index(name) + 1 if name in self.config.degrade else 0

    def retry_after(self) -> int:
        """Seconds until the bucket is back above the current level's exit point (at least 1)."""
        if self.bucket is None or self.degradation is None:
            return self.retry_after_s
        return max(self.retry_after_s, math.ceil(self.bucket.seconds_to(self.degradation.recover_at())))

    # -- what others ask -------------------------------------------------------------------------
    def on_battery(self) -> bool | None:
        """True on battery, False on mains, None with no battery (the update client defers downloads on battery)."""
        if self.supply is not None:
            return self.supply.read().on_battery
        from device_agents.platforms import probe  # where sysfs has no power_supply (macOS): psutil's view

        return probe().on_battery

    def describe(self) -> dict[str, Any]:
        """The budget line of ``status``/``stats`` and the device's reported state."""
        out: dict[str, Any] = {
            "reader": self.meter.name if self.meter is not None else "none",
            "modelled": bool(self.meter is not None and self.meter.modelled),
            "level": self.level,
            "power_w": None if self.power_w is None else round(self.power_w, 3),
            "energy_j": round(self.energy_j_total, 3),
            "rss_mb": round(self.rss() / 2**20, 1),
        }
        if self.bucket is not None:
            out["power_budget_w"] = self.bucket.budget_w
            out["power_budget_left"] = round(max(-1.0, min(1.0, self.bucket.fill)), 3)
        if self.memory is not None:
            out["memory"] = self.memory.describe()
        if self.temperature is not None:
            t = self.temperature
            out["thermal"] = {"zone": t.zone, "temp_c": t.temp_c, "limit_c": t.limit_c}
        if self.power_mode is not None and self.power_mode.current_id is not None:
            out["nvpmodel"] = self.power_mode.current_name
        return out

    def report(self) -> dict[str, float]:
        """The budget state as numbers, for the device's reported state (``budget_*`` keys)."""
        out = {"budget_level": float(self.level), "budget_energy_j": round(self.energy_j_total, 3)}
        out["budget_rss_mb"] = round(self.rss() / 2**20, 1)
        if self.power_w is not None:
            out["budget_power_w"] = round(self.power_w, 3)
        if self.bucket is not None:
            out["budget_power_left"] = round(max(-1.0, min(1.0, self.bucket.fill)), 3)
        if self.memory is not None:
            out["budget_memory_mb"] = round(self.memory.budget_bytes / 2**20, 1)
        if self.temperature is not None:
            out["budget_temp_c"] = self.temperature.temp_c
        return out

    def line(self) -> str:
        """One line for ``edgekit-agent stats``."""
        d = self.describe()
        power = "-" if d["power_w"] is None else f"{d['power_w']:.2f} W"
        parts = [f"power {power} ({d['reader']}{', modelled' if d['modelled'] else ''})"]
        if "power_budget_w" in d:
            parts.append(f"budget {d['power_budget_w']:g} W, {d['power_budget_left'] * 100:.0f}% left")
        parts.append(f"level {d['level']}")
        mem = d.get("memory")
        if mem:
            held = ", ".join(f"{k} {v:g}" for k, v in mem["held_mb"].items()) or "no model"
            parts.append(
                f"memory {mem['rss_mb']:g}/{mem['budget_mb']:g} MB (agent {mem['baseline_mb']:g}, {held}; "
                f"{mem['unloads']} unloads, {mem['refusals']} refused)"
            )
        else:
            parts.append(f"rss {d['rss_mb']:g} MB")
        if "thermal" in d:
            parts.append(f"{d['thermal']['zone']} {d['thermal']['temp_c']:.1f}/{d['thermal']['limit_c']:.1f} C")
        return "budgets: " + "; ".join(parts)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(_BudgetCollector(self))


def budget_line(metrics_text: str) -> str:
    """The ``budgets:`` line of ``edgekit-agent stats``, from a daemon's ``/metrics`` text."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    reader, modelled, held = "none", False, []
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if family.name == "edgekit_budget_reader":
                reader, modelled = sample.labels.get("reader", "none"), sample.labels.get("modelled") == "true"
            elif family.name == "edgekit_budget_model_memory_bytes":
                held.append(f"{sample.labels.get('model', '')} {sample.value / 2**20:.0f}")
            elif family.name == "edgekit_power_watts" or not sample.labels:
                values[sample.name] = sample.value
    power = values.get("edgekit_power_watts", math.nan)
    watts = "-" if math.isnan(power) else f"{power:.2f} W"
    parts = [f"power {watts} ({reader}{', modelled' if modelled else ''})"]
    left = values.get("edgekit_power_budget_left_ratio", math.nan)
    if not math.isnan(left):
        parts.append(f"{left * 100:.0f}% of the power budget left")
    parts.append(f"level {values.get('edgekit_degradation_level', 0):.0f}")
    rss = values.get("edgekit_rss_bytes", 0) / 2**20
    budget = values.get("edgekit_budget_memory_bytes", 0) / 2**20
    if budget:
        unloads = values.get("edgekit_budget_unloads_total", 0)
        parts.append(f"memory {rss:.0f}/{budget:.0f} MB ({', '.join(held) or 'no model'}; {unloads:.0f} unloads)")
    else:
        parts.append(f"rss {rss:.0f} MB")
    return "budgets: " + "; ".join(parts)


# The budgets of each agent store in this process (the admission stage finds its agent's here).
_live: dict[Path, Budgets] = {}


def budgets_for(store: Path) -> Budgets | None:
    """The budgets of the agent serving ``store`` in this process, if one was built."""
    return _live.get(Path(store))


def batch_step(config: AgentConfig) -> Callable[[], bool] | None:
    """Whether the ``batch`` step of ``[budgets] degrade`` is on now, as a function a batcher calls
    once per batch; None where the step is not configured (or no agent owns this store's budgets)."""
    budgets = budgets_for(config.store)
    at = budgets.step("batch") if budgets is not None else 0
    if budgets is None or not at:
        return None
    return lambda: budgets.level >= at


class _BudgetCollector(Collector):
    """The budget series, read when scraped (nothing per request)."""

    def __init__(self, budgets: Budgets) -> None:
        self.budgets = budgets

    def collect(self) -> Iterable[Metric]:
        b = self.budgets
        reader = b.meter.name if b.meter is not None else "none"
        memory = b.memory.state() if b.memory is not None else None
        yield _gauge(
            "edgekit_budget_memory_bytes",
            "The memory budget ([budgets] memory_mb; 0: none)",
            memory.budget_bytes if memory else 0,
        )
        yield _gauge(
            "edgekit_rss_bytes", "Resident memory of the agent process", memory.rss_bytes if memory else b.rss()
        )
        held = GaugeMetricFamily(
            "edgekit_budget_model_memory_bytes",
            "Memory held by each loaded model, measured at its load",
            labels=["model"],
        )
        for model, n in sorted((memory.held_by if memory else {}).items()):
            held.add_metric([model], n)
        yield held
        yield _gauge(
            "edgekit_budget_baseline_bytes",
            "The agent's own memory, before any model",
            memory.baseline_bytes if memory else 0,
        )
        unloads = CounterMetricFamily("edgekit_budget_unloads", "Models unloaded to make room under the memory budget")
        unloads.add_metric([], memory.unloads if memory else 0)
        yield unloads
        refusals = CounterMetricFamily("edgekit_budget_refusals", "Model loads refused by the memory budget")
        refusals.add_metric([], memory.refusals if memory else 0)
        yield refusals
        info = GaugeMetricFamily(
            "edgekit_budget_reader",
            "The energy reader in use (1); modelled=true: an estimate, not a sensor",
            labels=["reader", "modelled", "detail"],
        )
        info.add_metric(
            [
                reader,
                "true" if b.meter is not None and b.meter.modelled else "false",
                b.meter.detail if b.meter else "",
            ],
            1,
        )
        yield info
        power = GaugeMetricFamily(
            "edgekit_power_watts", "Power over the last sample interval (NaN: not read)", labels=["reader"]
        )
        power.add_metric([reader], math.nan if b.power_w is None else b.power_w)
        yield power
        energy = CounterMetricFamily("edgekit_energy_joules", "Energy used since the agent started", labels=["reader"])
        energy.add_metric([reader], b.energy_j_total)
        yield energy
        yield _gauge("edgekit_degradation_level", "0 normal; k: the first k [budgets] degrade steps are on", b.level)
        changes = CounterMetricFamily("edgekit_degradation_changes", "Degradation level changes")
        changes.add_metric([], b.degradation.changes if b.degradation is not None else 0)
        yield changes
        left = b.bucket.fill if b.bucket is not None else math.nan
        yield _gauge(
            "edgekit_power_budget_left_ratio",
            "Energy bucket fill: 1 full, 0 budget used, <0 in debt (NaN: no budget)",
            left,
        )
        t = b.temperature
        temp = GaugeMetricFamily(
            "edgekit_temperature_celsius", "Hottest thermal zone relative to its limit", labels=["zone", "limit_c"]
        )
        if t is not None:
            temp.add_metric([t.zone, f"{t.limit_c:g}"], t.temp_c)
        yield temp


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    g = GaugeMetricFamily(name, doc)
    g.add_metric([], value)
    return g
