"""The wire protocol: topics, strict notice parsing, reported state; and the reconnect backoff."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from device_agents.updates.backoff import Backoff
from device_agents.updates.protocol import (
    Notice,
    NoticeError,
    Reported,
    device_desired_topic,
    device_of_reported_topic,
    group_desired_topic,
    parse_notice,
    parse_reported,
    reported_topic,
)

NOTICE = Notice(
    schema_version=1,
    notice_id="0123abcd",
    issued="2026-03-04T11:59:00Z",
    name="tiny",
    version=2,
    sha256="b" * 64,
    size_bytes=1000,
    url="https://files.example/tiny-v2.ekb",
    rollout_percent=25,
)


def test_notice_round_trips_with_schema_version_first() -> None:
    raw = NOTICE.to_json()
    assert next(iter(json.loads(raw))) == "schema_version"
    assert parse_notice(raw) == NOTICE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, "unknown key 'colour'"),
        ({"schema_version": 2}, "newer than this agent understands (1); upgrade edgekit-agent"),
        ({"sha256": "xyz"}, "sha256 must be 64 lowercase hex digits"),
        ({"url": "file:///etc/passwd"}, "must be http:// or https://"),
        ({"rollout_percent": 101}, "rollout_percent must be 0-100"),
        ({"version": "2"}, "notice.version: expected an integer"),
        ({"issued": "yesterday"}, "is not an ISO 8601 time"),
    ],
)
def test_parse_notice_refuses_malformed_notices_naming_the_field(change: dict[str, object], message: str) -> None:
    data = {**json.loads(NOTICE.to_json()), **change}
    with pytest.raises(NoticeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_notice(json.dumps(data).encode())


def test_parse_notice_refuses_non_json_and_oversize_payloads() -> None:
    with pytest.raises(NoticeError, match="not valid JSON"):
        parse_notice(b"\xff\xfe")
    with pytest.raises(NoticeError, match="over the 65536-byte cap"):
        parse_notice(b" " * 70_000)


def test_topics_follow_the_fleet_layout_and_refuse_wildcards() -> None:
    assert device_desired_topic("f", "cam-07") == "edgekit/f/cam-07/desired"
    assert group_desired_topic("f", "cams") == "edgekit/f/group/cams/desired"
    assert reported_topic("f", "cam-07") == "edgekit/f/cam-07/reported"
    assert device_of_reported_topic("edgekit/f/cam-07/reported") == "cam-07"
    for bad in ("+", "#", "a/b", ""):
        with pytest.raises(NoticeError):
            device_desired_topic("f", bad)
    with pytest.raises(NoticeError, match="reserved for group topics"):
        reported_topic("f", "group")


def test_reported_state_round_trips() -> None:
    r = Reported(1, "cam-07", "f", "serving", "2026-03-04T12:00:00Z", "tiny", 2, 2, "n", models={"tiny": 2},
                 metrics={"download_s": 0.5})  # fmt: skip
    assert parse_reported(r.to_json()) == r
    with pytest.raises(NoticeError, match=r"reported\.state"):
        parse_reported(json.dumps({**json.loads(r.to_json()), "state": "dancing"}).encode())


def test_backoff_draws_full_jitter_under_a_doubling_ceiling_and_resets() -> None:
    backoff = Backoff(1.0, 8.0, random.Random(1))
    for ceiling in (1.0, 2.0, 4.0, 8.0, 8.0, 8.0):
        assert 0 <= backoff.next_delay() <= ceiling
    samples = []
    for _ in range(200):
        backoff.reset()
        samples.append(backoff.next_delay())
    assert all(0 <= s <= 1.0 for s in samples)
    assert max(samples) - min(samples) > 0.8  # spread over the window, not one fixed delay
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_notice_replace_keeps_validation() -> None:
    with pytest.raises(ValueError):
        replace(NOTICE, size_bytes=0)
