"""policy.decide and its rules, one at a time (pure functions: no broker needed)."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from device_agents.config import UpdatesConfig
from device_agents.store import ModelState, Slot
from device_agents.updates.policy import decide, rollout_bucket, rollout_selected, seconds_until_window
from edgekit.bundle.fleet_protocol import Notice

NOW = datetime(2026, 3, 4, 12, 0, tzinfo=timezone.utc)
UPDATES = UpdatesConfig(
    broker="mqtt://127.0.0.1:1883", fleet="f", device_id="dev-1", notice_keys=(Path("keys/fleet.pub"),)
)
RUNNING_V1 = ModelState(max_version=1, active=Slot(1, "a" * 64, "models/tiny/1-aaaa"), status="healthy")
NOTICE = Notice(
    notice_id="n-2",
    issued="2026-03-04T11:59:00Z",
    name="tiny",
    version=2,
    sha256="b" * 64,
    size_bytes=1000,
    url="http://files/tiny-v2.ekb",
)


def _decide(notice: Notice = NOTICE, model: ModelState = RUNNING_V1, **kwargs: object) -> tuple[str, str]:
    args: dict[str, object] = {"updates": UPDATES, "max_bundle_bytes": 10_000, "on_battery": None, "now": NOW}
    args.update(kwargs)
    d = decide(notice, model, **args)  # type: ignore[arg-type]  # keyword values of the right types
    return d.action, d.reason


def test_decide_applies_a_newer_version() -> None:
    assert _decide() == ("apply", "")


@pytest.mark.parametrize(
    ("model", "notice", "reason"),
    [
        (replace(RUNNING_V1, last_notice_id="n-2"), NOTICE, "handled already"),
        (replace(RUNNING_V1, last_notice_id="n-1", last_notice_issued="2026-03-04T11:59:30Z"), NOTICE, "is stale"),
        (RUNNING_V1, replace(NOTICE, version=1), "is running already"),
    ],
)
def test_decide_ignores_replayed_stale_and_running_notices(model: ModelState, notice: Notice, reason: str) -> None:
    action, why = _decide(notice, model)
    assert action == "ignore" and reason in why


def test_decide_rejects_older_and_rolled_back_versions_but_retries_an_interrupted_one() -> None:
    tried_v3 = replace(RUNNING_V1, max_version=3)
    assert _decide(model=tried_v3)[0] == "reject" and "older than v3" in _decide(model=tried_v3)[1]
    rolled_back = replace(RUNNING_V1, max_version=2, status="rolled_back", error="crash loop")
    assert _decide(model=rolled_back) == ("reject", "tiny v2 was rolled back on this device (crash loop); "
                                          "fix it and publish a higher version")  # fmt: skip
    interrupted = replace(RUNNING_V1, max_version=2, status="failed", error="interrupted while testing v2")
    assert _decide(model=interrupted) == ("apply", "")


def test_decide_rejects_expired_and_oversize_notices_before_downloading() -> None:
    expired = replace(NOTICE, expires=(NOW - timedelta(seconds=1)).isoformat())
    assert _decide(expired)[0] == "reject" and "expired" in _decide(expired)[1]
    assert _decide(replace(NOTICE, expires=(NOW + timedelta(days=1)).isoformat())) == ("apply", "")
    action, why = _decide(max_bundle_bytes=999)
    assert action == "reject" and "1000 bytes, over this device's 999-byte cap" in why


def test_decide_skips_devices_outside_the_rollout() -> None:
    bucket = rollout_bucket("dev-1")
    assert _decide(replace(NOTICE, rollout_percent=bucket))[0] == "skip"
    assert _decide(replace(NOTICE, rollout_percent=bucket + 1)) == ("apply", "")


def test_decide_defers_outside_the_maintenance_window_and_on_battery() -> None:
    local_noon = datetime(2026, 3, 4, 12, 0).astimezone()
    windowed = replace(UPDATES, maintenance_window="13:30-14:00")
    action, why = _decide(updates=windowed, now=local_noon)
    assert action == "defer" and "13:30-14:00" in why
    d = decide(NOTICE, RUNNING_V1, updates=windowed, max_bundle_bytes=10_000, on_battery=None, now=local_noon)
    assert d.retry_in_s == 90 * 60
    assert _decide(updates=replace(UPDATES, maintenance_window="11:00-13:00"), now=local_noon) == ("apply", "")
    assert _decide(on_battery=True)[0] == "defer"
    assert _decide(on_battery=True, updates=replace(UPDATES, defer_on_battery=False)) == ("apply", "")


def test_seconds_until_window_handles_windows_across_midnight() -> None:
    at = datetime(2026, 3, 4, 23, 30).astimezone()
    assert seconds_until_window("23:00-01:00", at) == 0
    assert seconds_until_window("22:00-23:00", at) == 22.5 * 3600
    assert seconds_until_window("00:15-01:00", at) == 45 * 60


def test_rollout_bucket_is_stable_spread_and_monotonic_in_the_percentage() -> None:
    ids = [f"cam-{i:04d}" for i in range(2000)]
    buckets = [rollout_bucket(d) for d in ids]
    assert buckets == [rollout_bucket(d) for d in ids]  # the same on every call
    per_decile = [sum(1 for b in buckets if lo <= b < lo + 10) for lo in range(0, 100, 10)]
    assert min(per_decile) > 120 and max(per_decile) < 280, per_decile  # about 200 each
    for percent in (10, 50):  # devices updated at 10 % are still updated at 50 %
        assert {d for d in ids if rollout_selected(d, 10)} <= {d for d in ids if rollout_selected(d, percent)}
    assert not any(rollout_selected(d, 0) for d in ids) and all(rollout_selected(d, 100) for d in ids)
