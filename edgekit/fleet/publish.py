"""``edgekit publish``: tell devices to run a bundle, and put the bundle where they can fetch it.

The bundle is verified here first (signature against ``--trusted-key``, expiry, schema), so that
a bundle the devices would refuse is refused before it reaches a fleet. Each device or group
topic holds one signed desired state listing every model of that device or group (the
allowlist): ``publish`` reads the retained state back from the broker, checks it is signed by
its own ``--notice-key``, puts the bundle's notice in place of that model's entry, and signs the
state again with a new ``issued`` and ``expires`` (``--fresh-for``; devices report ``frozen``
once it passes: ``edgekit fleet refresh`` re-signs the states unchanged). It is published
retained with QoS 1; devices that are offline pick it up when they reconnect. The bundle reaches
the devices one of two ways:

- ``--copy-to DIR`` places it in a directory that an HTTP(S) server serves at ``--base-url``;
- ``--upload s3://BUCKET/PREFIX`` puts it in S3-compatible object storage under its content
  address and points the notice at a presigned GET URL, or at ``--base-url`` + key where the
  bucket is public (``edgekit.fleet.s3``).

Without either, the bundle must already be at ``<base-url>/<file name>``.
"""

from __future__ import annotations

import os
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path
from urllib.parse import quote, urlsplit

from edgekit.bundle import (
    TrustStore,
    VerifiedManifest,
    key_id,
    load_private_key,
    load_public_key,
    read_verified_manifest,
)
from edgekit.bundle.errors import SignatureError
from edgekit.bundle.fleet_connection import BrokerAddress
from edgekit.bundle.fleet_protocol import (
    DesiredState,
    Notice,
    NoticeError,
    device_desired_topic,
    group_desired_topic,
    parse_desired,
    parse_signed,
    sign_document,
)
from edgekit.bundle.manifest import sha256_file
from edgekit.bundle.signing import RoleKeys
from edgekit.errors import ConfigError
from edgekit.fleet.s3 import S3Upload, StoredBundle, store_bundle
from edgekit.fleet.session import FleetSession

DEFAULT_FRESH_FOR_S = 24 * 3600.0
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd]?)$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400, "": 3600}


def parse_duration(text: str, flag: str = "--fresh-for") -> float:
    """``"24h"``, ``"30m"``, ``"90s"``, ``"7d"`` or a bare number of hours -> seconds (> 0)."""
    m = _DURATION.match(text.strip())
    if m is None or float(m.group(1)) <= 0:
        raise ConfigError(f"{flag} {text!r} must be a positive duration such as 24h, 30m, 90s or 7d (bare = hours)")
    return float(m.group(1)) * _UNIT_S[m.group(2)]


def now_iso(now: datetime) -> str:
    """Microseconds, so that two states published within a second are still ordered."""
    return now.astimezone(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


_NO_SOURCE = (
    "say where devices download the bundle: --base-url URL (with --copy-to DIR or a server of your own) "
    "or --upload s3://BUCKET/PREFIX"
)


@dataclass(frozen=True)
class PublishOptions:
    broker: BrokerAddress
    fleet: str
    base_url: str | None  # None only with ``upload``: devices get a presigned URL
    trusted_keys: tuple[Path, ...]
    devices: tuple[str, ...] = ()
    groups: tuple[str, ...] = ()
    rollout_percent: int = 100
    copy_to: Path | None = None
    timeout_s: float = 10.0
    upload: S3Upload | None = None
    notice_key: Path | None = None  # required: signs the desired state (role "notice")
    previous_notice_keys: tuple[Path, ...] = ()  # after a rotation: states they signed are carried over
    fresh_for_s: float = DEFAULT_FRESH_FOR_S

    def __post_init__(self) -> None:
        if self.notice_key is None:
            raise ConfigError(
                "--notice-key KEY is required: devices accept only a desired state signed by their fleet's notice "
                "key; make one with `edgekit keygen --out keys --name fleet` (devices list keys/fleet.pub in "
                "updates.notice_keys)"
            )
        if self.fresh_for_s <= 0:
            raise ConfigError(f"--fresh-for must be > 0, got {self.fresh_for_s:g} s")
        if not self.devices and not self.groups:
            raise ConfigError("name the devices or groups to update: --device ID or --group NAME")
        if self.base_url is None and self.upload is None:
            raise ConfigError(_NO_SOURCE)
        if self.base_url is not None and urlsplit(self.base_url).scheme not in ("http", "https"):
            raise ConfigError(f"--base-url {self.base_url!r} must start with http:// or https://")
        if self.upload is not None and self.copy_to is not None:
            raise ConfigError("--copy-to and --upload both place the bundle; choose one")
        if self.upload is not None and self.base_url is not None and self.upload.url_expires_s is not None:
            raise ConfigError(
                "--url-expires-s is the life of a presigned URL, but with --base-url devices download from the "
                "public URL: leave one of them out"
            )
        if not 0 <= self.rollout_percent <= 100:
            raise ConfigError(f"--rollout {self.rollout_percent} must be 0-100 (percent of devices)")
        if not self.trusted_keys:
            raise ConfigError("--trusted-key PUB is required: the bundle is verified before it is published")

    def topics(self) -> tuple[str, ...]:
        return tuple(t for t, _, _ in bindings(self.fleet, self.devices, self.groups))


def bindings(fleet: str, devices: tuple[str, ...], groups: tuple[str, ...]) -> list[tuple[str, str, str]]:
    """(topic, device, group) of each device and group, topic levels checked."""
    try:
        return [(device_desired_topic(fleet, d), d, "") for d in devices] + [
            (group_desired_topic(fleet, g), "", g) for g in groups
        ]
    except NoticeError as exc:
        raise ConfigError(str(exc)) from exc


@dataclass(frozen=True)
class Published:
    notice: Notice
    topics: tuple[str, ...]
    copied_to: Path | None
    stored: StoredBundle | None = None  # with ``upload``
    states: tuple[DesiredState, ...] = ()  # as signed and published, one per topic
    warnings: tuple[str, ...] = ()  # e.g. a retained message that was not ours, replaced


def build_notice(
    bundle: Path, verified: VerifiedManifest, url: str, *, rollout_percent: int = 100, issued: str | None = None
) -> Notice:
    """The notice (one model's entry of a desired state) for ``bundle``, verified as ``verified``."""
    m = verified.manifest
    return Notice(
        notice_id=uuid.uuid4().hex,
        issued=issued or now_iso(datetime.now(timezone.utc)),
        name=m.name,
        version=m.version,
        sha256=sha256_file(bundle),
        size_bytes=Path(bundle).stat().st_size,
        url=url,
        rollout_percent=rollout_percent,
        target=m.target,
        expires=m.expires,
        signer_key_id=verified.key_id,
    )


def bundle_url(base_url: str, bundle: Path) -> str:
    return f"{base_url.rstrip('/')}/{quote(Path(bundle).name)}"


def copy_bundle(bundle: Path, directory: Path) -> Path:
    """Place ``bundle`` in ``directory`` under its own name, atomically; refuse to replace other content."""
    directory.mkdir(parents=True, exist_ok=True)
    dest = directory / Path(bundle).name
    if dest.exists():
        if sha256_file(dest) == sha256_file(bundle):
            return dest
        raise ConfigError(
            f"{dest} exists with other content; devices may be downloading it. Give the new bundle another file name"
        )
    tmp = directory / f".{dest.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        shutil.copyfile(bundle, tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest


def publish(bundle: Path, options: PublishOptions) -> Published:
    """Verify ``bundle``, copy (``copy_to``) or upload it (``upload``), then publish its notice on every topic."""
    bundle = Path(bundle)
    trust = TrustStore.from_files(options.trusted_keys)
    verified = read_verified_manifest(bundle, trust)
    topics = options.topics()
    copied = copy_bundle(bundle, options.copy_to) if options.copy_to is not None else None
    stored = None
    if options.upload is not None:
        stored = store_bundle(bundle, sha256_file(bundle), options.upload, public_base_url=options.base_url)
        url = stored.url
    elif options.base_url is not None:
        url = bundle_url(options.base_url, bundle)
    else:  # PublishOptions refuses this combination already; this branch narrows the type
        raise ConfigError(_NO_SOURCE)
    now = datetime.now(timezone.utc)
    notice = build_notice(bundle, verified, url, rollout_percent=options.rollout_percent, issued=now_iso(now))

    def put(models: tuple[Notice, ...]) -> tuple[Notice, ...]:
        return (*(n for n in models if n.name != notice.name), notice)

    if options.notice_key is None:  # PublishOptions refuses this already; this branch narrows the type
        raise ConfigError("--notice-key KEY is required")
    states, warnings = update_states(
        options.broker, options.fleet, options.devices, options.groups, options.notice_key, put,
        fresh_for_s=options.fresh_for_s, timeout_s=options.timeout_s, now=now,
        previous_notice_keys=options.previous_notice_keys,
    )  # fmt: skip
    return Published(notice, topics, copied, stored, states, warnings)


def update_states(
    broker: BrokerAddress,
    fleet: str,
    devices: tuple[str, ...],
    groups: tuple[str, ...],
    notice_key: Path,
    change: Callable[[tuple[Notice, ...]], tuple[Notice, ...]],
    *,
    fresh_for_s: float = DEFAULT_FRESH_FOR_S,
    timeout_s: float = 10.0,
    now: datetime | None = None,
    previous_notice_keys: tuple[Path, ...] = (),
) -> tuple[tuple[DesiredState, ...], tuple[str, ...]]:
    """Read each topic's retained state, apply ``change`` to its models, sign it afresh, publish it.

    A retained message that is not a state signed by ``notice_key`` (or one of
    ``previous_notice_keys``, public keys retired by a rotation) for that topic is replaced (its
    models cannot be trusted, so none is carried over) and named in the warnings.
    """
    now = now or datetime.now(timezone.utc)
    key = load_private_key(notice_key)
    own = RoleKeys(
        "notice",
        {key_id(k): k for k in (key.public_key(), *(load_public_key(p) for p in previous_notice_keys))},
    )
    issued, expires = now_iso(now), now_iso(now + timedelta(seconds=fresh_for_s))
    states: list[DesiredState] = []
    warnings: list[str] = []
    with FleetSession(broker, timeout_s=timeout_s) as session:
        for topic, device, group in bindings(fleet, devices, groups):
            current: tuple[Notice, ...] = ()
            payload = session.read_retained(topic)
            if payload:
                try:
                    envelope = parse_signed(payload)
                    own.verify(envelope.payload, envelope.signature_dicts(), f"the state on {topic}")
                    old = parse_desired(envelope)
                    if old.topic != topic:
                        raise NoticeError(f"it is bound to {old.bound_to}")
                    current = old.models
                except (NoticeError, SignatureError) as exc:
                    warnings.append(f"the retained message on {topic} is not a state signed by this notice key "
                                    f"({exc}); replaced, none of its models carried over")  # fmt: skip
            state = DesiredState("desired", fleet, issued, expires, device=device, group=group, models=change(current))
            session.publish_retained(topic, sign_document(state.to_json(), [key]).to_json())
            states.append(state)
    return tuple(states), tuple(warnings)


def drop_models(names: tuple[str, ...]) -> Callable[[tuple[Notice, ...]], tuple[Notice, ...]]:
    """For ``update_states``: the models without ``names`` (``edgekit fleet refresh --drop``)."""
    return lambda models: tuple(n for n in models if n.name not in names)


def keep_models(models: tuple[Notice, ...]) -> tuple[Notice, ...]:
    return models
