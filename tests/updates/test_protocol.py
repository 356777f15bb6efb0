"""The wire protocol: topics, strict notice parsing, reported state; and the reconnect backoff."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest

from device_agents.updates.backoff import Backoff
from edgekit.bundle import generate_keypair, load_private_key
from edgekit.bundle.fleet_protocol import (
    DesiredState,
    Notice,
    NoticeError,
    Reported,
    device_desired_topic,
    device_of_reported_topic,
    group_desired_topic,
    keys_topic,
    parse_desired,
    parse_reported,
    parse_signed,
    reported_topic,
    sign_document,
)

NOTICE = Notice(
    notice_id="0123abcd",
    issued="2026-03-04T11:59:00Z",
    name="tiny",
    version=2,
    sha256="b" * 64,
    size_bytes=1000,
    url="https://files.example/tiny-v2.ekb",
    rollout_percent=25,
)
STATE = DesiredState("desired", "f", "2026-03-04T12:00:00Z", "2026-03-05T12:00:00Z", device="cam-07", models=(NOTICE,))


def test_signed_state_round_trips_with_schema_version_first(tmp_path: Path) -> None:
    key = load_private_key(generate_keypair(tmp_path, "fleet")[0])
    raw = sign_document(STATE.to_json(), [key]).to_json()
    assert next(iter(json.loads(raw))) == "schema_version"
    envelope = parse_signed(raw)
    assert parse_desired(envelope) == STATE
    assert STATE.topic == "edgekit/f/cam-07/desired" and STATE.model("tiny") == NOTICE


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "red"}, "unknown key 'colour'"),
        ({"sha256": "xyz"}, "sha256 must be 64 lowercase hex digits"),
        ({"url": "file:///etc/passwd"}, "must be http:// or https://"),
        ({"rollout_percent": 101}, "rollout_percent must be 0-100"),
        ({"version": "2"}, "desired.models[0].version: expected an integer"),
        ({"issued": "yesterday"}, "is not an ISO 8601 time"),
        ({"issued": "2026-03-04T12:30:00Z"}, "after the state itself"),
    ],
)
def test_parse_desired_refuses_malformed_models_naming_the_field(change: dict[str, object], message: str) -> None:
    data = json.loads(STATE.to_json())
    data["models"][0].update(change)
    envelope = parse_signed(json.dumps({"schema_version": 2, "signed": json.dumps(data), "signatures": []}).encode())
    with pytest.raises(NoticeError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        parse_desired(envelope)


def test_desired_state_must_name_one_binding_and_expire_after_it_is_issued() -> None:
    with pytest.raises(ValueError, match="exactly one of device or group"):
        replace(STATE, group="cams")
    with pytest.raises(ValueError, match="is not after issued"):
        replace(STATE, expires=STATE.issued)
    with pytest.raises(ValueError, match="lists a name twice"):
        replace(STATE, models=(NOTICE, NOTICE))
    assert replace(STATE, device="", group="cams").topic == "edgekit/f/group/cams/desired"


def test_parse_signed_refuses_unsigned_non_json_oversize_and_newer_payloads() -> None:
    unsigned = json.dumps({"schema_version": 1, "notice_id": "x", "issued": "2999-01-01T00:00:00Z"}).encode()
    with pytest.raises(NoticeError, match="it is not signed"):
        parse_signed(unsigned)
    with pytest.raises(NoticeError, match="not valid JSON"):
        parse_signed(b"\xff\xfe")
    with pytest.raises(NoticeError, match="over the 65536-byte cap"):
        parse_signed(b" " * 70_000)
    with pytest.raises(NoticeError, match=r"newer than this agent understands \(2\); upgrade edgekit-agent"):
        parse_signed(json.dumps({"schema_version": 3, "signed": "{}"}).encode())
    keys_doc = json.dumps({"type": "keys", "fleet": "f", "version": 1, "issued": "2026-03-04T12:00:00Z"})
    with pytest.raises(NoticeError, match="is a 'keys' document, not 'desired'"):
        parse_desired(parse_signed(json.dumps({"schema_version": 2, "signed": keys_doc}).encode()))


def test_topics_follow_the_fleet_layout_and_refuse_wildcards() -> None:
    assert device_desired_topic("f", "cam-07") == "edgekit/f/cam-07/desired"
    assert group_desired_topic("f", "cams") == "edgekit/f/group/cams/desired"
    assert reported_topic("f", "cam-07") == "edgekit/f/cam-07/reported"
    assert device_of_reported_topic("edgekit/f/cam-07/reported") == "cam-07"
    assert keys_topic("f") == "edgekit/f/keys"
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
