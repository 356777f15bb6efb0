"""The fleet wire protocol: topic names, the signed desired state and keys, the reported state.

Both sides use this module: ``edgekit publish`` builds and signs a ``DesiredState`` and
``edgekit fleet status`` reads ``Reported``; the agent does the reverse. Payloads are UTF-8
JSON objects, parsed strictly (unknown keys are errors), ``schema_version`` first::

    edgekit/<fleet>/<device>/desired            retained, QoS 1: Signed(DesiredState) (device topic)
    edgekit/<fleet>/group/<group>/desired       retained, QoS 1: Signed(DesiredState) (group topic)
    edgekit/<fleet>/keys                        retained, QoS 1: Signed(KeysDocument), by root keys
    edgekit/<fleet>/<device>/reported           retained, QoS 1: Reported

A desired state is signed by a *notice* key (a role apart from the bundle-signing keys) and
says, for one device or one group of one fleet, which models it runs (``models``: one
``Notice`` per model name; the list is also the allowlist: a name it does not list is never
installed), when it was issued and when it stops being fresh (``expires``). ``Signed.signed``
holds the document as the exact JSON text that was signed, so no canonical form is needed.
The bundle a notice points to is verified on the device as well (signature, hashes, version,
expiry, hardware).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, TypeVar
from urllib.parse import urlsplit

from edgekit.bundle.codec import from_data, to_data
from edgekit.bundle.errors import EdgekitError
from edgekit.bundle.manifest import parse_time
from edgekit.bundle.signing import sign_detached

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

NOTICE_SCHEMA_VERSION = 2  # of the Signed envelope (1 was an unsigned notice)
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
    "frozen",  # the newest valid desired state has expired: nothing is updated; the models keep serving
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


def keys_topic(fleet: str) -> str:
    return f"edgekit/{check_topic_level('fleet', fleet)}/keys"


def device_of_reported_topic(topic: str) -> str:
    """``edgekit/f/cam-07/reported`` -> ``cam-07``."""
    parts = topic.split("/")
    if len(parts) != 4 or parts[0] != "edgekit" or parts[3] != "reported":
        raise NoticeError(f"{topic!r} is not a reported-state topic")
    return parts[2]


@dataclass(frozen=True)
class Notice:
    """One model of a desired state: 'run ``name`` ``version``, fetch it from ``url``'.

    ``notice_id`` and ``issued`` change only when this entry changes (a new publish of this
    model), not when the state is re-signed for another model or for freshness.
    """

    notice_id: str  # unique per publish of this model: the replay guard remembers the last one handled
    issued: str  # ISO 8601 UTC; an entry issued before the last one handled for this model is stale
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


@dataclass(frozen=True)
class DesiredState:
    """What one device (``device``) or group (``group``) of ``fleet`` runs; signed by a notice key."""

    type: Literal["desired"]
    fleet: str
    issued: str  # ISO 8601 UTC: a state issued before the newest one accepted on its topic is a replay
    expires: str  # after this the state is stale: the device reports "frozen" and updates nothing
    device: str = ""
    group: str = ""
    models: tuple[Notice, ...] = ()

    def __post_init__(self) -> None:
        _check_time("issued", self.issued)
        _check_time("expires", self.expires)
        if parse_time(self.expires) <= parse_time(self.issued):
            raise ValueError(f"expires {self.expires} is not after issued {self.issued}")
        if bool(self.device) == bool(self.group):
            raise ValueError("a desired state names exactly one of device or group")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models lists a name twice: {sorted(names)}")
        for m in self.models:
            if parse_time(m.issued) > parse_time(self.issued):
                raise ValueError(f"model {m.name} is issued {m.issued}, after the state itself ({self.issued})")

    @property
    def topic(self) -> str:
        if self.device:
            return device_desired_topic(self.fleet, self.device)
        return group_desired_topic(self.fleet, self.group)

    @property
    def bound_to(self) -> str:
        return f"device {self.device}" if self.device else f"group {self.group}"

    def model(self, name: str) -> Notice | None:
        return next((m for m in self.models if m.name == name), None)

    def to_json(self) -> bytes:
        data = to_data(self)
        return json.dumps({"type": data.pop("type"), **data}).encode()


@dataclass(frozen=True)
class BundleKey:
    """A bundle-signing key added by a keys document, optionally limited to model name patterns."""

    key: str  # base64 raw Ed25519 public key
    names: tuple[str, ...] = ()  # fnmatch patterns; empty = any name


@dataclass(frozen=True)
class KeysDocument:
    """Keys a fleet's root key(s) add or revoke, on top of those in the device's config.

    ``version`` only goes up: a device keeps the highest it accepted and refuses lower ones.
    """

    type: Literal["keys"]
    fleet: str
    version: int
    issued: str
    notice_keys: tuple[str, ...] = ()  # base64 raw Ed25519 public keys that may sign desired states
    bundle_keys: tuple[BundleKey, ...] = ()
    revoked: tuple[str, ...] = ()  # key ids no role trusts any more (bundle or notice)

    def __post_init__(self) -> None:
        _check_time("issued", self.issued)
        if self.version < 1:
            raise ValueError(f"version must be >= 1, got {self.version}")

    def to_json(self) -> bytes:
        data = to_data(self)
        return json.dumps({"type": data.pop("type"), **data}).encode()


@dataclass(frozen=True)
class Signature:
    key_id: str
    signature: str  # base64 Ed25519 signature over the UTF-8 bytes of ``Signed.signed``


@dataclass(frozen=True)
class Signed:
    """The envelope on the wire: the exact signed JSON text and its signatures."""

    schema_version: int
    signed: str
    signatures: tuple[Signature, ...] = ()

    def __post_init__(self) -> None:
        if self.schema_version != NOTICE_SCHEMA_VERSION:
            raise ValueError(f"schema_version {self.schema_version} is not {NOTICE_SCHEMA_VERSION}")

    @property
    def payload(self) -> bytes:
        return self.signed.encode()

    def signature_dicts(self) -> list[dict[str, str]]:
        return [{"key_id": s.key_id, "signature": s.signature} for s in self.signatures]

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


def sign_document(document: bytes, private_keys: Sequence[Ed25519PrivateKey]) -> Signed:
    """The envelope of ``document`` (``DesiredState.to_json()`` or ``KeysDocument.to_json()``)."""
    text = document.decode()
    sigs = tuple(Signature(**sign_detached(text.encode(), k)) for k in private_keys)
    return Signed(NOTICE_SCHEMA_VERSION, text, sigs)


def parse_signed(payload: bytes) -> Signed:
    """The envelope of a desired state or keys document, or ``NoticeError`` saying what is wrong.

    An unsigned (schema 1) notice is refused here with a line saying so.
    """
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise NoticeError(f"{len(payload)} bytes is over the {MAX_PAYLOAD_BYTES}-byte cap")
    try:
        data = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise NoticeError(f"not valid JSON ({exc})") from exc
    if isinstance(data, dict) and "signed" not in data:
        raise NoticeError(
            "it is not signed (an unsigned notice, or from an older edgekit); "
            "publish with `edgekit publish --notice-key KEY`"
        )
    return _parse(Signed, payload, "notice", NOTICE_SCHEMA_VERSION)


def parse_desired(envelope: Signed) -> DesiredState:
    """The ``DesiredState`` in a verified envelope (check the signature first)."""
    return _parse_inner(DesiredState, envelope, "desired")


def parse_keys(envelope: Signed) -> KeysDocument:
    return _parse_inner(KeysDocument, envelope, "keys")


def _parse_inner(cls: type[_T], envelope: Signed, kind: str) -> _T:
    try:
        data = json.loads(envelope.signed)
    except json.JSONDecodeError as exc:
        raise NoticeError(f"signed content is not valid JSON ({exc})") from exc
    if not isinstance(data, dict) or data.get("type") != kind:
        got = data.get("type") if isinstance(data, dict) else None
        raise NoticeError(f"signed content is a {got!r} document, not {kind!r}")
    return from_data(cls, data, kind, NoticeError)


def parse_reported(payload: bytes) -> Reported:
    return _parse(Reported, payload, "reported", REPORTED_SCHEMA_VERSION)
