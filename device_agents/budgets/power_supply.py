"""Battery and AC state from ``/sys/class/power_supply`` (what psutil and upower read too).

Each supply has a ``type``: ``Mains`` / ``USB`` (``online`` 1 when powering the device) or
``Battery`` (``status``: Charging, Discharging, Full, Not charging; ``capacity`` in percent).
The device is on battery when no mains or USB supply is online and a battery is discharging;
``on_battery`` is None where there is no battery at all (mains powered).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from device_agents.budgets.sysfs import read_int, read_text, under


@dataclass(frozen=True)
class SupplyState:
    on_battery: bool | None  # None: no battery
    battery_percent: float | None
    supplies: tuple[str, ...]  # "BAT0 Battery Discharging", "AC Mains online"


class PowerSupplyReader:
    name = "power_supply"

    def __init__(self, base: Path) -> None:
        self.base = base

    @classmethod
    def probe(cls, root: Path | str = "/") -> PowerSupplyReader | None:
        base = under(root, "/sys/class/power_supply")
        if not base.is_dir() or not any(read_text(p / "type") for p in base.iterdir()):
            return None
        return cls(base)

    def read(self) -> SupplyState:
        mains_online, battery_seen, discharging = False, False, False
        percent: float | None = None
        described = []
        for supply in sorted(self.base.iterdir(), key=lambda p: p.name):
            kind = read_text(supply / "type")
            if kind in ("Mains", "USB", "USB_C", "USB_PD"):
                online = read_int(supply / "online") == 1
                mains_online = mains_online or online
                described.append(f"{supply.name} {kind} {'online' if online else 'offline'}")
            elif kind == "Battery":
                if read_int(supply / "present") == 0:
                    continue
                battery_seen = True
                status = read_text(supply / "status") or "Unknown"
                discharging = discharging or status == "Discharging"
                capacity = read_int(supply / "capacity")
                if capacity is not None and 0 <= capacity <= 100:
                    percent = float(capacity) if percent is None else min(percent, capacity)
                described.append(f"{supply.name} Battery {status}")
        if not battery_seen:
            on_battery = None
        else:
            on_battery = discharging and not mains_online
        return SupplyState(on_battery, percent, tuple(described))
