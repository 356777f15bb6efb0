"""Thermal zones and their trip points (``/sys/class/thermal/thermal_zone*``).

A zone's ``temp`` is in millidegrees Celsius; ``trip_point_<k>_temp`` / ``_type`` say where the
kernel acts: ``active`` (a fan turns on: not a limit), ``passive`` (the kernel starts throttling
the CPU), ``hot`` and ``critical`` (shutdown). The agent backs off *before* the first limit:
``headroom_c`` is how far the hottest zone is below its lowest passive/hot/critical trip (or
below ``limit_c`` where the operator set one with ``[budgets] thermal_c``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from device_agents.budgets.sysfs import LogOnce, read_int, read_text, under

log = logging.getLogger("edgekit.agent")

LIMIT_TRIP_TYPES = ("passive", "hot", "critical")


@dataclass(frozen=True)
class Zone:
    name: str  # thermal_zone0
    kind: str  # its ``type``: cpu-thermal, x86_pkg_temp, CPU-therm...
    temp_path: Path
    limit_c: float | None  # the lowest passive/hot/critical trip point


@dataclass(frozen=True)
class ThermalReading:
    zone: str  # the zone with the least headroom
    temp_c: float
    limit_c: float
    headroom_c: float  # limit_c - temp_c (negative: past it)


class ThermalReader:
    """The device's thermal zones that have a limit (a trip point, or ``limit_c``)."""

    name = "thermal"

    def __init__(self, zones: list[Zone], limit_c: float | None = None) -> None:
        self.zones = zones
        self.limit_c = limit_c
        self.problems = LogOnce()

    @classmethod
    def probe(cls, root: Path | str = "/", *, limit_c: float | None = None) -> ThermalReader | None:
        base = under(root, "/sys/class/thermal")
        if not base.is_dir():
            return None
        zones = []
        for zone in sorted(base.glob("thermal_zone*"), key=lambda p: (len(p.name), p.name)):
            if read_text(zone / "mode") == "disabled":
                continue
            kind = read_text(zone / "type") or zone.name
            if read_int(zone / "temp") is None:
                log.warning("thermal %s (%s): temp missing or not a number; not used", zone.name, kind)
                continue
            trips = []
            for trip in zone.glob("trip_point_*_type"):
                if read_text(trip) in LIMIT_TRIP_TYPES:
                    milli = read_int(trip.with_name(trip.name.replace("_type", "_temp")))
                    if milli is not None and milli > 0:
                        trips.append(milli / 1000)
            zone_limit = min(trips) if trips else None
            if limit_c is not None:
                zone_limit = limit_c if zone_limit is None else min(zone_limit, limit_c)
            if zone_limit is not None:
                zones.append(Zone(zone.name, kind, zone / "temp", zone_limit))
        return cls(zones, limit_c) if zones else None

    def read(self) -> ThermalReading | None:
        """The zone nearest its limit, or None when no zone could be read."""
        worst: ThermalReading | None = None
        for zone in self.zones:
            milli = read_int(zone.temp_path)
            if milli is None or zone.limit_c is None:
                self.problems.warn(f"thermal {zone.name} ({zone.kind}): temp unreadable; not counted")
                continue
            temp_c = milli / 1000
            reading = ThermalReading(f"{zone.name} {zone.kind}", temp_c, zone.limit_c, zone.limit_c - temp_c)
            if worst is None or reading.headroom_c < worst.headroom_c:
                worst = reading
        return worst
