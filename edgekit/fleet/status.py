"""``edgekit fleet status``: every device's reported state, from the retained reported topics."""

from __future__ import annotations

import json
from dataclasses import dataclass

from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import (
    NoticeError,
    device_of_reported_topic,
    parse_reported,
    reported_wildcard,
)
from edgekit.fleet.session import FleetSession

COLUMNS = ("DEVICE", "MODEL", "VERSION", "DESIRED", "STATE", "UPDATED", "REASON")


@dataclass(frozen=True)
class DeviceStatus:
    device: str
    model: str = ""
    version: int = 0
    desired_version: int = 0
    state: str = ""
    updated: str = ""
    reason: str = ""  # why an update was rejected, failed or rolled back; or why it waits

    def cells(self) -> tuple[str, ...]:
        return (
            self.device,
            self.model or "-",
            str(self.version) if self.version else "-",
            str(self.desired_version) if self.desired_version else "-",
            self.state,
            self.updated or "-",
            self.reason,
        )


def read_status(
    address: BrokerAddress, fleet: str, *, window_s: float = 1.0, timeout_s: float = 10.0
) -> list[DeviceStatus]:
    """The reported state of every device of ``fleet`` that the broker retains, sorted by device."""
    with FleetSession(address, timeout_s=timeout_s) as session:
        messages = session.collect_retained(reported_wildcard(fleet), window_s)
    rows = []
    for topic, payload in messages.items():
        if not payload:  # an empty retained message clears a device's state
            continue
        device = device_of_reported_topic(topic)
        try:
            r = parse_reported(payload)
        except NoticeError as exc:
            rows.append(DeviceStatus(device, state="unreadable", reason=str(exc)))
            continue
        rows.append(DeviceStatus(device, r.name, r.version, r.desired_version, r.state, r.updated, r.error or r.detail))
    return sorted(rows, key=lambda s: s.device)


def format_table(rows: list[DeviceStatus]) -> str:
    table = [COLUMNS, *(r.cells() for r in rows)]
    widths = [max(len(row[i]) for row in table) for i in range(len(COLUMNS) - 1)]
    lines = [
        "  ".join([*(cell.ljust(w) for cell, w in zip(row[:-1], widths, strict=True)), row[-1]]).rstrip()
        for row in table
    ]
    return "\n".join(lines)


def format_json(rows: list[DeviceStatus]) -> str:
    return json.dumps([r.__dict__ for r in rows], indent=1)
