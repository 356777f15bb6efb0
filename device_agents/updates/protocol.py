"""The fleet wire protocol: topic names, the desired-state notice and the reported state.

Both sides use this module: ``edgekit publish`` builds a ``Notice`` and ``edgekit fleet status``
reads ``Reported``; the agent does the reverse. Payloads are UTF-8 JSON objects, parsed strictly
(unknown keys are errors), ``schema_version`` first::

    edgekit/<fleet>/<device>/desired            retained, QoS 1: Notice (device topic)
    edgekit/<fleet>/group/<group>/desired       retained, QoS 1: Notice (group topic)
    edgekit/<fleet>/<device>/reported           retained, QoS 1: Reported

A notice is not signed and is trusted for nothing but *where to look*: the bundle it points to
is verified on the device (signature, hashes, version, expiry, hardware). The notice's own fields
may only make the device refuse early (wrong size, older version, expired), never accept.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Literal, TypeVar
from urllib.parse import urlsplit

from edgekit.bundle.codec import from_data, to_data
from edgekit.bundle.errors import EdgekitError
from edgekit.bundle.manifest import parse_time

NOTICE_SCHEMA_VERSION = 1
REPORTED_SCHEMA_VERSION = 1
MAX_PAYLOAD_BYTES = 64 * 1024
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_TOPIC_LEVEL = re.compile(r"^[A-Za-z0-9_.-]+$")
_T = TypeVar("_T")
# "group" is the second level of group topics, so it cannot also be a device id.
RESERVED_DEVICE_IDS = ("group",)

UpdateState = Literal[
    "idle",  # running what is desired (or nothing desired yet)
    "deferred",  # an update waits for the maintenance window or mains power
    "skipped",  # the notice's rollout percentage does not select this device
    "downloading",
    "installing",  # verify, stage, self-test, switch
    "checking",  # the new version serves and is in its health window
    "serving",  # the desired version is running and passed the health check
    "rejected",  # the notice or bundle was refused (reason in error); the old version serves
    "failed",  # a transient failure (network, disk full); retried with backoff
    "rolled_back",  # the new version failed its health check or crash-looped
]


class NoticeError(EdgekitError):
    """A desired-state notice is malformed; the publisher must send a valid one."""


def check_topic_level(label: str, value: str) -> str:
    if not _TOPIC_LEVEL.match(value):
        raise NoticeError(f"{label} {value!r} must be letters, digits, '-', '_' or '.' (it is an MQTT topic level)")
    if label == "device" and value in RESERVED_DEVICE_IDS:
        raise NoticeError(f"device id {value!r} is reserved for group topics; choose another id")
    return value


def device_desired_topic(fleet: str, device: str) -> str:
    return f"edgekit/{check_topic_level('fleet', fleet)}/{check_topic_level('device', device)}/desired"


def group_desired_topic(fleet: str, group: str) -> str:
    return f"edgekit/{check_topic_level('fleet', fleet)}/group/{check_topic_level('group', group)}/desired"


def reported_topic(fleet: str, device: str) -> str:
    return f"edgekit/{check_topic_level('fleet', fleet)}/{check_topic_level('device', device)}/reported"


def reported_wildcard(fleet: str) -> str:
    return f"edgekit/{check_topic_level('fleet', fleet)}/+/reported"


def device_of_reported_topic(topic: str) -> str:
    """``edgekit/f/cam-07/reported`` -> ``cam-07``."""
    parts = topic.split("/")
    if len(parts) != 4 or parts[0] != "edgekit" or parts[3] != "reported":
        raise NoticeError(f"{topic!r} is not a reported-state topic")
    return parts[2]


@dataclass(frozen=True)
class Notice:
    """Desired state for one model: 'run ``name`` ``version``, fetch it from ``url``'."""

    schema_version: int
    notice_id: str  # unique per publish: the replay guard remembers the last one handled
    issued: str  # ISO 8601 UTC; a notice issued before the last one handled is stale
    name: str
    version: int
    sha256: str  # of the .ekb file
    size_bytes: int  # the download cap: a server sending more is cut off
    url: str
    rollout_percent: int = 100
    target: str = ""
    expires: str | None = None  # the bundle manifest's expiry, to refuse before downloading
    signer_key_id: str = ""

    def __post_init__(self) -> None:
        if self.schema_version != NOTICE_SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is not {NOTICE_SCHEMA_VERSION}")
        if not self.notice_id or len(self.notice_id) > 128:
            raise ValueError("notice_id must be 1-128 characters")
        _check_time("issued", self.issued)
        if self.expires is not None:
            _check_time("expires", self.expires)
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ValueError(f"name {self.name!r} must be letters, digits, '-', '_' or '.'")
        if self.version < 1:
            raise ValueError(f"version must be >= 1, got {self.version}")
        if not _SHA256.match(self.sha256):
            raise ValueError("sha256 must be 64 lowercase hex digits")
        if self.size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {self.size_bytes}")
        if urlsplit(self.url).scheme not in ("http", "https"):
            raise ValueError(f"url {self.url!r} must be http:// or https://")
        if not 0 <= self.rollout_percent <= 100:
            raise ValueError(f"rollout_percent must be 0-100, got {self.rollout_percent}")

    def to_json(self) -> bytes:
        data = to_data(self)
        return json.dumps({"schema_version": data.pop("schema_version"), **data}).encode()


@dataclass(frozen=True)
class Reported:
    """What a device says about itself on its reported topic (retained)."""

    schema_version: int
    device_id: str
    fleet: str
    state: UpdateState
    updated: str  # ISO 8601 UTC
    name: str = ""  # the model the last update concerned
    version: int = 0  # the version of ``name`` running now (0 = none)
    desired_version: int = 0
    notice_id: str = ""
    error: str = ""  # why the last update was rejected, failed or rolled back
    detail: str = ""  # why nothing happens yet (deferred, skipped)
    models: dict[str, int] = field(default_factory=dict)  # every model served: name -> version
    metrics: dict[str, float] = field(default_factory=dict)  # e.g. selftest/latency p50 of ``name``

    def to_json(self) -> bytes:
        data = to_data(self)
        return json.dumps({"schema_version": data.pop("schema_version"), **data}).encode()


def _check_time(label: str, text: str) -> None:
    try:
        parse_time(text)
    except EdgekitError as exc:  # raised as ValueError so that the codec names the field
        raise ValueError(f"{label} {text!r} is not an ISO 8601 time") from exc


def _parse(cls: type[_T], payload: bytes, what: str, schema_version: int) -> _T:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise NoticeError(f"{what}: {len(payload)} bytes is over the {MAX_PAYLOAD_BYTES}-byte cap")
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NoticeError(f"{what}: not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise NoticeError(f"{what}: expected a JSON object")
    version = data.get("schema_version")
    if isinstance(version, int) and version > schema_version:
        raise NoticeError(
            f"{what}: schema_version {version} is newer than this agent understands ({schema_version}); "
            "upgrade edgekit-agent"
        )
    return from_data(cls, data, what, NoticeError)


def parse_notice(payload: bytes) -> Notice:
    """A ``Notice`` from an MQTT payload, or ``NoticeError`` naming the bad field."""
    return _parse(Notice, payload, "notice", NOTICE_SCHEMA_VERSION)


def parse_reported(payload: bytes) -> Reported:
    return _parse(Reported, payload, "reported", REPORTED_SCHEMA_VERSION)
