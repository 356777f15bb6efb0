"""When to act on a desired-state notice: replay guard, rollout, maintenance window, power.

``decide`` is a pure function of the notice, what the store remembers about the model and the
device's situation (clock, power), so that each rule is tested on its own. Its answer, in the
order the rules are checked:

- ``ignore``: the notice was handled already (same ``notice_id``), is stale (issued before the
  last one handled), or asks for the version that is running. Nothing is reported as an error.
- ``reject``: the notice can never succeed here: older than a version installed before
  (anti-rollback: the counter rises at commit, so a version that failed its self-test does not
  block a lower later one), the version that was rolled back, expired, or larger than
  ``max_bundle_mb``. The reason is reported and the old model keeps serving. The version of an
  install that was interrupted (power cut, SIGKILL) is tried again.
- ``skip``: the rollout percentage does not select this device (a later notice may).
- ``defer``: outside the maintenance window or on battery; ``retry_in_s`` says when to look again.
- ``apply``: download and install.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Literal

from device_agents.config import UpdatesConfig, parse_window
from device_agents.store import ModelState
from edgekit.bundle.fleet_protocol import Notice
from edgekit.bundle.manifest import parse_time

# How often a device on battery looks again whether it is back on mains power.
BATTERY_RECHECK_S = 60.0


@dataclass(frozen=True)
class Decision:
    action: Literal["apply", "ignore", "reject", "skip", "defer"]
    reason: str = ""
    retry_in_s: float | None = None  # for "defer"

    @property
    def remember(self) -> bool:
        """Whether the notice counts as handled (the replay guard then ignores it for good)."""
        return self.action in ("ignore", "reject")


def rollout_bucket(device_id: str) -> int:
    """A stable 0-99 bucket for ``device_id``: the same on every boot and every agent version.

    The bucket does not depend on the model, so raising a rollout from 10 to 50 percent keeps
    the first 10 percent of devices and adds more.
    """
    digest = hashlib.sha256(device_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") % 100


def rollout_selected(device_id: str, percent: int) -> bool:
    return rollout_bucket(device_id) < percent


def seconds_until_window(window: str, now: datetime) -> float:
    """Seconds from local time ``now`` until the window opens (0 inside it)."""
    start, end = parse_window(window)
    t = now.time().replace(tzinfo=None)
    inside = start <= t < end if start <= end else (t >= start or t < end)
    if inside:
        return 0.0
    opening = now.replace(hour=start.hour, minute=start.minute, second=0, microsecond=0)
    if opening <= now:
        opening += timedelta(days=1)
    return (opening - now).total_seconds()


def decide(
    notice: Notice,
    model: ModelState,
    *,
    updates: UpdatesConfig,
    max_bundle_bytes: int,
    on_battery: bool | None,
    now: datetime | None = None,
) -> Decision:
    """What to do with ``notice`` now. ``max_bundle_bytes`` is the device's cap (the smaller of the
    agent's and the updates' ``max_bundle_mb``); ``now`` is an aware datetime (local time for the window)."""
    now = now or datetime.now(timezone.utc).astimezone()
    running = model.active.version if model.active is not None else 0
    what = f"{notice.name} v{notice.version}"
    if notice.notice_id == model.last_notice_id:
        return Decision("ignore", f"notice {notice.notice_id} for {what} was handled already")
    if model.last_notice_issued and parse_time(notice.issued) < parse_time(model.last_notice_issued):
        return Decision(
            "ignore",
            f"notice {notice.notice_id} for {what} is stale: issued {notice.issued}, "
            f"before the last one handled ({model.last_notice_issued})",
        )
    if notice.version == running:
        return Decision("ignore", f"{what} is running already")
    if notice.version < model.max_version:
        return Decision(
            "reject",
            f"{what} is older than v{model.max_version}, installed before on this device "
            f"(running v{running}); publish a higher version",
        )
    if notice.version == model.max_version and model.status == "rolled_back":
        return Decision(
            "reject", f"{what} was rolled back on this device ({model.error}); fix it and publish a higher version"
        )
    if notice.expires is not None and parse_time(notice.expires) <= now:
        return Decision("reject", f"{what} expired at {notice.expires}; package and publish a fresh bundle")
    if notice.size_bytes > max_bundle_bytes:
        return Decision(
            "reject",
            f"{what} is {notice.size_bytes} bytes, over this device's {max_bundle_bytes}-byte cap (max_bundle_mb); "
            "publish a smaller bundle or raise the cap",
        )
    if not rollout_selected(updates.device_id, notice.rollout_percent):
        bucket = rollout_bucket(updates.device_id)
        return Decision("skip", f"rollout {notice.rollout_percent}% does not select this device (bucket {bucket})")
    if updates.maintenance_window is not None and not updates.in_maintenance_window(now):
        wait = seconds_until_window(updates.maintenance_window, now)
        return Decision("defer", f"waiting for the maintenance window {updates.maintenance_window}", wait)
    if updates.defer_on_battery and on_battery:
        return Decision("defer", "on battery: waiting for mains power (defer_on_battery)", BATTERY_RECHECK_S)
    return Decision("apply")
